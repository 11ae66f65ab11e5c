"""A float-aware oracle for greedy generations that must agree in the default (non-deterministic) mode.

Two runs of one greedy request that differ only in batch composition, cache hits, chunking or page size
do the same math in a different float order (reductions split another way, attention over cached KV
instead of recomputed KV). In fp32 their logits then differ in the last bits; where the two best tokens
are closer than that, either may win, and after one different token the continuations are different
texts with nothing left to compare. Exact token equality is therefore the wrong oracle for these runs,
and "anything goes" is no oracle at all. The rule here:

* The reference's greedy tokens come with their top-2 logprobs (the runtime's own API:
  ``return_logprob=True, top_logprobs_num=2``; ``meta_info["output_top_logprobs"]`` holds, per output
  token, ``[[logprob, token_id, text], ...]`` best first).
* The candidate's tokens must equal the reference's up to the first step where the reference's top-2 gap
  is below ``tie_eps`` (a *near tie*). At that step the candidate may take either of the two best tokens;
  after it nothing more is compared. Without a near tie the two sequences must be equal, length included.
* Where the candidate has logprobs too, each agreed token's logprob must match within ``logprob_tol``.
* The reference must be consistent: its token is its own top-1 (or, at a near tie, one of its top-2).
  Logit processing (penalties, logit bias, grammars, ``min_new_tokens``) breaks that, and the oracle says
  so instead of guessing.

The thresholds scale with the size of the logits, because fp32 rounding errors do: ``tie_eps`` is
``TIE_REL = 1e-4`` of the logit scale, ``logprob_tol`` is ``LOGPROB_REL = 3e-5`` of it. The default scale,
32, bounds |logit| of the models these tests run (measured: tiny random Llama ~23, SmolLM2-135M ~34), so
``tie_eps = 3.2e-3`` and ``logprob_tol = 9.6e-4``. The largest drift measured between the configurations
of tests/runtime/test_engine_consistency.py (page sizes, chunking, retraction, no cache; 32 prompts of 24
greedy tokens, AVX-512 and ATEN_CPU_CAPABILITY=avx2 kernels) was 8.6e-5 in a logprob: the tolerance is
11x that. Since each logprob moves by at most ``logprob_tol``, a gap can move by at most
``2 * logprob_tol < tie_eps``: a gap the reference sees above ``tie_eps`` cannot flip in the candidate.
A real scheduling bug (a wrong token where the gap is large, KV of the wrong prefix, a lost chunk) still
fails: tests/test_oracle.py shows both sides.

These tolerances are float32's. In bfloat16 one rounding is ~4e-3 relative: the same float-order changes
move logprobs by up to ~0.3 (measured on the tiny model) and make exact top-2 ties common. A test using
this oracle therefore pins ``dtype="float32"`` (``--dtype float32`` for a server) instead of taking the
device's default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TIE_REL = 1e-4
LOGPROB_REL = 3e-5
DEFAULT_LOGIT_SCALE = 32.0
TIE_EPS = TIE_REL * DEFAULT_LOGIT_SCALE
LOGPROB_TOL = LOGPROB_REL * DEFAULT_LOGIT_SCALE

# Keyword arguments of Engine.generate (and fields of a native /generate body) that make a reference.
WITH_TOP2 = {"return_logprob": True, "top_logprobs_num": 2}

Top2 = tuple[tuple[float, int], tuple[float, int]]  # ((logprob, token id) best, second best)


@dataclass(frozen=True)
class Greedy:
    """One greedy generation: its tokens and, when known, their logprobs and the top-2 at each step."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top2: list[Top2] | None = None

    @classmethod
    def from_native(cls, out: dict[str, Any]) -> Greedy:
        """From an Engine.generate / native /generate result (with logprobs if it asked for them)."""
        meta = out["meta_info"]
        lps = meta.get("output_token_logprobs")
        tops = meta.get("output_top_logprobs")
        top2: list[Top2] | None = None
        if tops is not None:
            assert all(len(t) >= 2 for t in tops), "the reference needs top_logprobs_num >= 2"
            top2 = [((float(t[0][0]), int(t[0][1])), (float(t[1][0]), int(t[1][1]))) for t in tops]
        return cls(list(out["output_ids"]), [float(e[0]) for e in lps] if lps is not None else None, top2)

    @classmethod
    def from_logits(cls, tokens: Sequence[int], logits: Any) -> Greedy:
        """From the logits (``[steps, vocab]``, a torch tensor) each token was chosen from."""
        import torch

        logp = torch.log_softmax(logits.float(), dim=-1)
        vals, ids = logp.topk(2, dim=-1)
        chosen = logp.gather(1, torch.tensor(list(tokens))[:, None]).squeeze(1)
        top2: list[Top2] = [((float(v[0]), int(i[0])), (float(v[1]), int(i[1])))
                            for v, i in zip(vals.tolist(), ids.tolist())]
        return cls(list(tokens), [float(x) for x in chosen.tolist()], top2)

    @classmethod
    def from_hf_generate(cls, model: Any, ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> Greedy:
        """Hugging Face ``generate`` (greedy, one prompt) as a reference: the top-2 come from the scores
        greedy compared (after HF's logits processors, e.g. ``min_new_tokens`` masking EOS), the chosen
        tokens' logprobs from the raw logits (what the runtime reports)."""
        import torch

        with torch.inference_mode():
            out = model.generate(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                                 output_logits=True, return_dict_in_generate=True, **kwargs)
        tokens = out.sequences[0, len(ids):].tolist()
        top2 = cls.from_logits(tokens, torch.cat(out.scores)).top2
        return cls(tokens, cls.from_logits(tokens, torch.cat(out.logits)).logprobs, top2)

    def prefix(self, n: int) -> Greedy:
        """The first ``n`` steps (a reference for a run that stopped there on purpose)."""
        return Greedy(self.tokens[:n], None if self.logprobs is None else self.logprobs[:n],
                      None if self.top2 is None else self.top2[:n])

    def near_tie(self, tie_eps: float = TIE_EPS) -> int | None:
        """The first step whose two best tokens are closer than ``tie_eps`` (None: no such step)."""
        assert self.top2 is not None, "a reference needs its top-2 logprobs"
        for i, ((best, _), (second, _)) in enumerate(self.top2):
            if best - second < tie_eps:
                return i
        return None


def check_greedy(reference: Greedy, candidate: Greedy, *, tie_eps: float = TIE_EPS,
                 logprob_tol: float = LOGPROB_TOL) -> str | None:
    """None when ``candidate`` agrees with ``reference`` under the rule above, else what is wrong."""
    ref, cand = reference, candidate
    assert ref.top2 is not None, "a reference needs its top-2 logprobs (return_logprob, top_logprobs_num=2)"
    if len(ref.top2) != len(ref.tokens):
        return f"the reference has {len(ref.tokens)} tokens but {len(ref.top2)} top-2 entries"
    for i, (token, ((best, best_id), (second, second_id))) in enumerate(zip(ref.tokens, ref.top2)):
        if best - second < tie_eps:  # a near tie: either token may win, and then nothing compares
            if token not in (best_id, second_id):
                return f"step {i}: the reference chose {token}, not one of its top-2 {best_id}, {second_id}"
            if i < len(cand.tokens) and cand.tokens[i] not in (best_id, second_id):
                return (f"step {i} (a near tie, gap {best - second:.2e}): the candidate chose {cand.tokens[i]}, "
                        f"not one of the reference's top-2 {best_id}, {second_id}")
            return None
        if token != best_id:
            return (f"step {i}: the reference chose {token} but its top-1 is {best_id} (gap {best - second:.3g});"
                    " its logits were processed, so its logprobs cannot judge ties")
        if i >= len(cand.tokens):
            return f"the candidate stopped after {len(cand.tokens)} tokens, the reference made {len(ref.tokens)}"
        if cand.tokens[i] != token:
            return (f"step {i}: the candidate chose {cand.tokens[i]}, the reference {token} "
                    f"(top-2 gap {best - second:.3g}, no near tie)")
        want = best if ref.logprobs is None else ref.logprobs[i]
        if cand.logprobs is not None and abs(cand.logprobs[i] - want) > logprob_tol:
            return f"step {i}: logprob {cand.logprobs[i]:.6f} vs the reference's {want:.6f} (tolerance {logprob_tol})"
    if len(cand.tokens) != len(ref.tokens):
        return f"the candidate made {len(cand.tokens)} tokens, the reference {len(ref.tokens)}"
    return None


def assert_greedy_agrees(reference: Greedy, candidate: Greedy, what: str = "", **tolerances: float) -> None:
    problem = check_greedy(reference, candidate, **tolerances)
    assert problem is None, f"{what}: {problem}\n reference {reference.tokens}\n candidate {candidate.tokens}"


def assert_all_agree(references: Sequence[dict[str, Any]], candidates: Sequence[dict[str, Any]],
                     what: str = "") -> None:
    """Native results (a batch, in order) against references generated WITH_TOP2."""
    assert len(references) == len(candidates), what
    for i, (ref, cand) in enumerate(zip(references, candidates)):
        assert_greedy_agrees(Greedy.from_native(ref), Greedy.from_native(cand), f"{what} [{i}]")


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_text(reference: dict[str, Any], text: str, decode: Callable[[list[int]], str],
               want: str | None = None, tie_eps: float = TIE_EPS) -> str | None:
    """The same rule for a candidate known only by its text (an OpenAI-API response, a DSL variable).

    ``reference`` is a native result generated WITH_TOP2; ``decode`` turns token ids into text the way the
    server does; ``want`` is the text the candidate should have (default: the reference's own, or that
    text trimmed as the candidate's request trims it). Equal texts agree. Otherwise the reference must
    have a near tie, and the texts may only part where the text decoded up to that step ends (or later):
    the characters before it are fixed.
    """
    want = str(reference["text"]) if want is None else want
    if text == want:
        return None
    greedy = Greedy.from_native(reference)
    tie = greedy.near_tie(tie_eps)
    if tie is None:
        return f"the text differs from the reference {want!r} and the reference has no near tie: {text!r}"
    agreed = decode(greedy.tokens[:tie]).rstrip("\ufffd")  # an unfinished UTF-8 sequence is not text yet
    at = first_difference(text, want)
    if at < len(agreed):
        return (f"the text departs from the reference {want!r} at character {at}, before its near tie at "
                f"step {tie} (text fixed up to character {len(agreed)}): {text!r}")
    return None


def assert_text_agrees(reference: dict[str, Any], text: str, decode: Callable[[list[int]], str],
                       what: str = "", want: str | None = None) -> None:
    problem = check_text(reference, text, decode, want)
    assert problem is None, f"{what}: {problem}"


def reference_from_meta(text: str, meta: dict[str, Any]) -> dict[str, Any]:
    """A native-shaped reference from a DSL ``gen``'s text and meta_info (run with WITH_TOP2)."""
    return {"text": text, "output_ids": [int(e[1]) for e in meta["output_token_logprobs"]], "meta_info": meta}


def check_choice(reference_meta: dict[str, Any], choices: Sequence[str], reference: str, got: str,
                 tie_eps: float = TIE_EPS) -> str | None:
    """A ``select``: the reference's decision, or another choice whose score (a mean token logprob,
    ``normalized_prompt_logprobs``) is within ``tie_eps`` of it (each mean moves at most as much as one
    logprob does)."""
    if got == reference:
        return None
    scores = reference_meta["normalized_prompt_logprobs"]
    gap = scores[list(choices).index(reference)] - scores[list(choices).index(got)]
    if gap < tie_eps:
        return None
    return f"select chose {got!r}, the reference {reference!r} by a clear margin ({gap:.3g}): {scores}"


def dsl_agrees(reference: Any, candidate: Any, name: str, decode: Callable[[list[int]], str],
               choices: Sequence[str] | None = None) -> bool:
    """Variable ``name`` of two DSL program states (``reference`` run with WITH_TOP2 as its defaults; a
    ``select`` when ``choices`` are given). True: equal. False: they differ where the reference had a near
    tie, so whatever the program did after it saw different inputs and is not comparable. Fails otherwise."""
    want, got = reference[name], candidate[name]
    if want == got:
        return True
    meta = reference.get_meta_info(name)
    if choices is not None:
        problem = check_choice(meta, choices, want, got)
    else:
        problem = check_text(reference_from_meta(want, meta), got, decode)
    assert problem is None, f"{name}: {problem}"
    return False
