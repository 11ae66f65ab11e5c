"""Sampling parameters, stop conditions, logprobs and validation, end to end through the Engine."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from runtime.core import stop_regex
from runtime.core.messages import FinishReason
from runtime.core.sampling_params import SamplingParams
from runtime.executor.sampler import Sampler, edit_logits, restrict_top_k_top_p
from runtime.request.decode_stream import DecodeStream
from tests.oracle import WITH_TOP2, Greedy, assert_greedy_agrees

PROMPT = list(range(500, 540))


def gen(engine, params, prompt=PROMPT, **kw):
    return engine.generate(input_ids=prompt, sampling_params=params, **kw)


# Seeded draws compared across batches: in float32 a draw moves only if float drift carries it across a
# CDF boundary (as rare as a near tie, tests/oracle.py); bfloat16's drift does that routinely, so these
# tests pin float32 whatever the device's default (bit-exact outputs are --enable-deterministic-inference's).
FP32 = {"dtype": "float32"}


def test_same_seed_same_output_whatever_the_batch(tiny_engine):
    engine = tiny_engine(**FP32)
    params = {"temperature": 1.0, "seed": 1234, "max_new_tokens": 16, "ignore_eos": True}
    alone = gen(engine, params)["output_ids"]
    crowd = engine.generate(input_ids=[list(range(10, 90)), PROMPT, list(range(7, 20))],
                            sampling_params=[{"temperature": 0.7, "max_new_tokens": 9}, params,
                                             {"temperature": 0, "max_new_tokens": 30}])
    assert crowd[1]["output_ids"] == alone
    other = gen(engine, dict(params, seed=99))["output_ids"]
    assert other != alone


def test_seeded_output_survives_retraction(tiny_engine):
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 5, "max_new_tokens": 40, "ignore_eos": True}
    prompts = [list(range(100 + 7 * i, 160 + 7 * i)) for i in range(6)]
    roomy = tiny_engine(**FP32).generate(input_ids=prompts, sampling_params=params)
    tight_engine = tiny_engine(max_total_tokens=260, schedule_conservativeness=0.01, **FP32)
    tight = tight_engine.generate(input_ids=prompts, sampling_params=params)
    assert tight_engine.server_info()["scheduler"]["retractions"] > 0
    assert [o["output_ids"] for o in tight] == [o["output_ids"] for o in roomy]


def test_top_k_1_is_greedy(tiny_engine):
    engine = tiny_engine(**FP32)  # the oracle's tolerances are float32's
    greedy = Greedy.from_native(gen(engine, {"temperature": 0, "max_new_tokens": 12}, **WITH_TOP2))
    top_k_1 = gen(engine, {"temperature": 1.5, "top_k": 1, "seed": 3, "max_new_tokens": 12}, **WITH_TOP2)
    assert_greedy_agrees(greedy, Greedy.from_native(top_k_1), "top_k = 1 (over the cached prompt)")


def test_logit_bias_forces_a_token(tiny_engine):
    out = gen(tiny_engine(), {"temperature": 0, "max_new_tokens": 5, "logit_bias": {"777": 100}})
    assert out["output_ids"] == [777] * 5


def test_stop_token_ids_and_min_new_tokens(tiny_engine):
    engine = tiny_engine(**FP32)  # the oracle's tolerances are float32's
    ref = Greedy.from_native(gen(engine, {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}, **WITH_TOP2))
    greedy = ref.tokens
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    tie = ref.near_tie()
    assert tie is None or tie > first, f"this prompt has a near tie at step {tie}: pick another"
    out = gen(engine, {"temperature": 0, "max_new_tokens": 10, "stop_token_ids": [stop_at]}, **WITH_TOP2)
    assert_greedy_agrees(ref.prefix(first + 1), Greedy.from_native(out), "stopped at a stop token")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    # min_new_tokens keeps the stop token out until enough tokens exist
    out = gen(engine, {"temperature": 0, "max_new_tokens": 10, "min_new_tokens": 8, "stop_token_ids": [stop_at]})
    assert len(out["output_ids"]) >= 8 and stop_at not in out["output_ids"][:8]


def test_prefill_only_request(tiny_engine):
    engine = tiny_engine()
    out = gen(engine, {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    again = gen(engine, {"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1


def test_stop_strings_are_trimmed(smol_engine):
    base = smol_engine.generate("The capital of France is", {"max_new_tokens": 40, "temperature": 0}, **WITH_TOP2)
    assert "answer" in base["text"]
    out = smol_engine.generate("The capital of France is",
                               {"max_new_tokens": 40, "temperature": 0, "stop": ["answer"]}, **WITH_TOP2)
    ref, stopped = Greedy.from_native(base), Greedy.from_native(out)
    tie = ref.near_tie()
    assert tie is None or tie >= len(stopped.tokens), f"this prompt has a near tie at step {tie}: pick another"
    assert_greedy_agrees(ref.prefix(len(stopped.tokens)), stopped, "up to the stop string (over a cached prompt)")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "answer"}
    assert out["text"] == base["text"][: base["text"].index("answer")]
    kept = smol_engine.generate("The capital of France is", {"max_new_tokens": 40, "temperature": 0,
                                                              "stop": "answer", "no_stop_trim": True})
    assert kept["text"].endswith("answer")


def test_ignore_eos_and_max_new_tokens(smol_engine):
    out = smol_engine.generate("The capital of France is", {"max_new_tokens": 50, "temperature": 0,
                                                             "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 50
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 50}


def test_streaming_text_is_cumulative_and_ends_as_non_streaming(smol_engine):
    params = {"max_new_tokens": 30, "temperature": 0, "stop": ["answer"]}
    full = smol_engine.generate("The capital of France is", params)
    texts = [c["text"] for c in smol_engine.generate("The capital of France is", params, stream=True)]
    assert len(texts) > 3
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"]


def test_output_and_prompt_logprobs_match_transformers(smol_engine, smol_hf):
    tok, hf = smol_hf
    prompt = "The quick brown fox jumps over the lazy"
    ids = tok(prompt).input_ids
    out = smol_engine.generate(prompt, {"max_new_tokens": 5, "temperature": 0}, return_logprob=True,
                               logprob_start_len=0, top_logprobs_num=3, return_text_in_logprobs=True)
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == ids and inp[0][0] is None
    for j in range(1, len(ids)):
        assert math.isclose(inp[j][0], ref[j - 1, ids[j]].item(), abs_tol=2e-3)
    outp = meta["output_token_logprobs"]
    assert [e[1] for e in outp] == out["output_ids"]
    for k, (lp, tid, text) in enumerate(outp):
        assert math.isclose(lp, ref[len(ids) - 1 + k, tid].item(), abs_tol=2e-3)
        assert text == tok.decode([tid])
    for k, top in enumerate(meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == out["output_ids"][k]
        assert top[0][0] >= top[1][0] >= top[2][0]


def test_prompt_logprobs_from_a_start_over_a_cached_prefix(smol_engine):
    prompt = "One two three four five six seven eight nine ten"
    first = smol_engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    n = first["meta_info"]["prompt_tokens"]
    again = smol_engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=n - 3)
    entries = again["meta_info"]["input_token_logprobs"]
    assert len(entries) == 3
    for a, b in zip(entries, first["meta_info"]["input_token_logprobs"][-3:]):
        assert a[1] == b[1] and math.isclose(a[0], b[0], abs_tol=1e-4)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"min_new_tokens": 9, "max_new_tokens": 3}, "min_new_tokens"),
        ({"json_schema": "{}", "regex": "a"}, "regex"),
        ({"banana": 1}, "banana"),
        ({"max_new_tokens": 10_000}, "max_new_tokens"),
        ({"stop_regex": "(unclosed"}, "stop_regex"),
        ({"stop_regex": [""]}, "stop_regex"),
        ({"stop_regex": ["x"] * 33}, "stop_regex"),
        ({"stop_regex": "a" * 257}, "stop_regex"),
        ({"stop_regex": 7}, "stop_regex"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"custom_params": [1]}, "custom_params"),
        ({"beam_width": 4}, "beam_width"),
        ({"watermark": {"enabled": True}}, "watermark"),
        ({"choice": ["yes", "no"]}, "choice"),
    ],
)
def test_invalid_sampling_values_raise_naming_the_field(tiny_engine, params, field):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=field):
        gen(engine, params)


def test_penalties_reference_semantics():
    row = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    req = SimpleNamespace(sampling=sp, seed=0, input_ids=[0], output_ids=[1, 1, 2], eos_ids=frozenset(),
                          return_logprob=False, top_logprobs_num=0, grammar=None)
    edit_logits(row, Sampler(4).prepare([req]))
    expected = torch.tensor([[1.0, -4.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.5]])
    assert torch.allclose(row, expected)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.0}, {"presence_penalty": 2.0},
                                     {"repetition_penalty": 1.5}])
def test_penalties_break_repetition(smol_engine, penalty):
    prompt = "List: apple, apple, apple, apple, apple,"
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    plain = smol_engine.generate(prompt, params)["output_ids"]
    assert len(set(plain)) <= 3, "the model loops on this prompt"
    penal = smol_engine.generate(prompt, dict(params, **penalty))["output_ids"]
    assert len(set(penal)) > 10


def test_top_p_keeps_the_nucleus():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.4, 0.2, 0.3]])
    out = restrict_top_k_top_p(p, top_k=torch.tensor([0, 2]), top_p=torch.tensor([0.8, 1.0], dtype=torch.float64))
    assert torch.equal(out[0] > 0, torch.tensor([True, True, False, False]))
    assert torch.equal(out[1] > 0, torch.tensor([False, True, False, True]))


# ---------------------------------------------------------------------- SGLang's sampling_params fields
# Every API field of SGLang's SamplingParams (0.5.23) at the value its clients send when the caller set nothing.
SGLANG_DEFAULTS = {
    "max_new_tokens": 128, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 1.0, "top_p": 1.0,
    "top_k": 1 << 30, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None, "logit_bias": None,
    "sampling_seed": None, "custom_params": None, "watermark": None, "choice": [],
}


def test_every_sglang_field_at_its_default_is_accepted():
    sp = SamplingParams.from_dict(SGLANG_DEFAULTS)
    assert sp == SamplingParams()  # top_k 1 << 30 is SGLang's "no cut", the same as -1
    nulls = SamplingParams.from_dict(dict.fromkeys(SGLANG_DEFAULTS))  # null means "the default"
    assert nulls == SamplingParams()
    assert SamplingParams.from_dict({"beam_width": 1, "watermark": {"enabled": False}, "regex": ""}) == SamplingParams()


def test_sglang_fields_with_meaning():
    sp = SamplingParams.from_dict({"stop_regex": r"\d+:", "sampling_seed": 7, "stream_interval": 3,
                                   "custom_params": {"anything": [1, "x"]}})
    assert sp.stop_regex == [r"\d+:"] and sp.seed == 7 and sp.stream_interval == 3
    assert sp.custom_params == {"anything": [1, "x"]}  # accepted, never read


def test_stop_regex_tail_bounds():
    assert stop_regex.tail_chars("answer") == 6
    assert stop_regex.tail_chars(r"(ab|cde){2}\.") == 7
    assert stop_regex.tail_chars(r"[a-z]{3,5}") == 5
    # unbounded, or dependent on the text before a window: the scheduler decodes the whole output
    for pattern in (r"\d+:", r"^x", r"x\b", r"(?<=: )\d", r"(a)\1"):
        assert stop_regex.tail_chars(pattern) is None, pattern
    assert stop_regex.first_match([r"a*", r"b+"], "xxbbaa") == ("b+", 2, 4)  # empty matches never stop


@pytest.mark.parametrize("pattern", [r"\d+:", r"answer\s+is", r"(?<=: )\d", "is: 2"])
def test_streamed_text_never_passes_a_stop_regex(smol_dir, pattern):
    """Feed a known output token by token: every text the stream releases stops before the match, and the
    final text is cut at it (or kept through it with no_stop_trim)."""
    from runtime.models.folders import load_tokenizer

    tok = load_tokenizer(smol_dir)
    full = " Paris.\n\nThe answer is: 2018-01-22 12:12:53."
    ids = tok(full, add_special_tokens=False).input_ids
    m = re.search(pattern, full)
    assert m is not None
    for keep in (False, True):
        stream = DecodeStream(tok, SamplingParams(stop_regex=[pattern], no_stop_trim=keep))
        released = []
        for k, t in enumerate(ids):
            # the scheduler's check: a match anywhere in the output so far
            hit = stop_regex.first_match([pattern], tok.decode(ids[: k + 1]))
            done = FinishReason("stop", matched=pattern) if hit else None
            text = stream.add([t], done)
            released.append(text)
            if done is not None:
                break
        assert all(len(t) <= m.start() for t in released[:-1]), released
        assert all(b.startswith(a) for a, b in zip(released, released[1:]))
        assert released[-1] == (full[: m.end()] if keep else full[: m.start()])
        assert len(released[-2]) >= m.start() - 2  # text before the match is not held back for long


def test_stop_regex_end_to_end(smol_engine):
    prompt = "The capital of France is"
    params = {"max_new_tokens": 40, "temperature": 0}
    base = smol_engine.generate(prompt, params)["text"]
    for pattern in (r"answer\s+is", r"\w+ is:"):  # bounded (a tail is decoded), unbounded (all of it)
        m = re.search(pattern, base)
        assert m is not None, f"the greedy output changed: {base!r}"
        out = smol_engine.generate(prompt, dict(params, stop_regex=pattern))
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
        assert out["text"] == base[: m.start()]
        frames = [f["text"] for f in smol_engine.generate(prompt, dict(params, stop_regex=[pattern]), stream=True)]
        assert all(b.startswith(a) for a, b in zip(frames, frames[1:])) and frames[-1] == out["text"]
        kept = smol_engine.generate(prompt, dict(params, stop_regex=pattern, no_stop_trim=True))
        assert kept["text"] == base[: m.end()]
