"""The float-aware oracle of tests/oracle.py: it forgives a divergence at a near tie and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import checked_engine
from tests.oracle import (
    LOGPROB_TOL,
    TIE_EPS,
    WITH_TOP2,
    Greedy,
    check_choice,
    check_greedy,
    check_text,
)


def steps(*gaps: float, tokens: list[int] | None = None) -> Greedy:
    """A reference whose step i chose token 10 + i with a top-2 gap of gaps[i] (logprobs -0.5 - i / 10)."""
    toks = tokens or [10 + i for i in range(len(gaps))]
    lps = [-0.5 - i / 10 for i in range(len(gaps))]
    top2 = [((lp, t), (lp - g, 1000 + i)) for i, (t, lp, g) in enumerate(zip(toks, lps, gaps))]
    return Greedy(toks, lps, top2)


def test_equal_runs_agree_and_float_drift_is_tolerated() -> None:
    ref = steps(2.0, 1.5, 3.0)
    assert check_greedy(ref, ref) is None
    drift = Greedy(ref.tokens, [lp + 0.5 * LOGPROB_TOL for lp in ref.logprobs or []])
    assert check_greedy(ref, drift) is None
    assert check_greedy(ref, Greedy(ref.tokens)) is None  # a candidate without logprobs: tokens only


def test_a_wrong_token_where_the_gap_is_large_fails() -> None:
    ref = steps(2.0, 1.5, 3.0, 0.8)
    bug = Greedy([10, 11, 999, 13])
    assert "step 2" in (check_greedy(ref, bug) or "")
    # ... and so does the second-best token there: only a near tie lets it win
    assert "step 1" in (check_greedy(ref, Greedy([10, 1001, 12, 13])) or "")
    # a wrong token after a near tie is not compared, but one before it is
    tie_late = steps(2.0, 1.5, 1e-6, 3.0)
    assert check_greedy(tie_late, Greedy([10, 11, 1002, 55, 56])) is None
    assert check_greedy(tie_late, Greedy([10, 999, 1002])) is not None


def test_a_divergence_at_a_near_tie_passes_and_ends_the_comparison() -> None:
    ref = steps(2.0, 0.5 * TIE_EPS, 3.0, 3.0)
    other = Greedy([10, 1001, 77, 78, 79, 80])  # took the runner-up, then went its own way (and longer)
    assert check_greedy(ref, other) is None
    assert check_greedy(ref, Greedy([10, 11, 12, 13])) is None  # or kept the same token
    # at the tie the candidate must still take one of the two best tokens
    assert "near tie" in (check_greedy(ref, Greedy([10, 555, 12, 13])) or "")
    # just above the threshold it is not a tie
    assert check_greedy(steps(2.0, 2 * TIE_EPS, 3.0), Greedy([10, 1001, 12])) is not None


def test_logprob_drift_beyond_the_tolerance_fails_and_so_do_lengths_without_a_tie() -> None:
    ref = steps(2.0, 1.5, 3.0)
    far = Greedy(ref.tokens, [lp - 3 * LOGPROB_TOL for lp in ref.logprobs or []])
    assert "logprob" in (check_greedy(ref, far) or "")
    assert check_greedy(ref, Greedy(ref.tokens[:2])) is not None
    assert check_greedy(ref, Greedy([*ref.tokens, 99])) is not None


def test_a_reference_whose_logits_were_processed_is_refused() -> None:
    ref = steps(2.0, 1.5)
    processed = Greedy([10, 1001], None, ref.top2)  # it chose its runner-up with a clear gap
    assert "processed" in (check_greedy(processed, processed) or "")


def test_text_rule() -> None:
    decode = "".join  # tokens are characters here: ord() ids decode to their letters

    def native(text: str, gaps: list[float]) -> dict[str, Any]:
        ids = [ord(c) for c in text]
        tops = [[[-0.1, t, None], [-0.1 - g, 0, None]] for t, g in zip(ids, gaps)]
        return {"text": text, "output_ids": ids, "meta_info": {"output_top_logprobs": tops}}

    def dec(ids: list[int]) -> str:
        return decode(chr(i) for i in ids)

    ref = native("abcdef", [1.0, 1.0, 1.0, 1e-6, 1.0, 1.0])
    assert check_text(ref, "abcdef", dec) is None
    assert check_text(ref, "abcXYZ", dec) is None  # parts at the near tie (step 3)
    assert check_text(ref, "abcdXY", dec) is None  # or later
    assert check_text(ref, "abXdef", dec) is not None  # before it: a real difference
    no_tie = native("abcdef", [1.0] * 6)
    assert check_text(no_tie, "abcdeX", dec) is not None
    assert check_text(no_tie, "abcde", dec) is not None


def test_select_rule_and_prefix() -> None:
    meta = {"normalized_prompt_logprobs": [-1.0, -1.0 - 0.5 * TIE_EPS, -3.0]}
    choices = ["yes", "no", "maybe"]
    assert check_choice(meta, choices, "yes", "yes") is None
    assert check_choice(meta, choices, "yes", "no") is None  # a near tie between the two
    assert check_choice(meta, choices, "yes", "maybe") is not None
    ref = steps(2.0, 1.5, 3.0)
    assert check_greedy(ref.prefix(2), Greedy(ref.tokens[:2])) is None
    assert check_greedy(ref.prefix(2), Greedy(ref.tokens)) is not None


# ---------------------------------------------------------------------- with the runtime's own logprobs
@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    with checked_engine(tiny_model_dir, max_total_tokens=4096, dtype="float32") as eng:
        yield eng


GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPT = list(range(400, 460))


def test_real_references_and_real_bugs(engine: Any) -> None:
    ref = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, **WITH_TOP2)
    meta = ref["meta_info"]
    assert len(meta["output_top_logprobs"]) == 24 and all(len(t) == 2 for t in meta["output_top_logprobs"])
    greedy = Greedy.from_native(ref)
    assert greedy.near_tie() is None, "this prompt has no near tie (so every step below is judged)"
    # the same request again (now over a cached prompt) agrees
    again = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, **WITH_TOP2)
    assert again["meta_info"]["cached_tokens"] > 0
    assert check_greedy(greedy, Greedy.from_native(again)) is None
    # a scheduling bug that swaps in the runner-up token where the gap is large is caught
    top2 = greedy.top2
    assert top2 is not None
    k = max(range(24), key=lambda i: top2[i][0][0] - top2[i][1][0])
    swapped = list(greedy.tokens)
    swapped[k] = top2[k][1][1]
    assert f"step {k}" in (check_greedy(greedy, Greedy(swapped)) or "")
    # KV of the wrong prefix (one prompt token different, as if another request's cache entry matched)
    wrong = engine.generate(input_ids=PROMPT[:20] + [PROMPT[20] + 1] + PROMPT[21:], sampling_params=GREEDY,
                            **WITH_TOP2)
    assert check_greedy(greedy, Greedy.from_native(wrong)) is not None
    # the text rule on a real reference: its own text agrees, a text changed early does not
    decode = engine.tokenizer.decode
    assert check_text(ref, ref["text"], decode) is None
    text = ref["text"]
    assert text and check_text(ref, ("y" if text[0] == "x" else "x") + text[1:], decode) is not None
