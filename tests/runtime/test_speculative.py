"""N-gram speculative decoding end to end: the same tokens (and logprobs) as without it, greedy and seeded,
with stop strings and tokens inside an accepted run, max_new_tokens, grammars, retraction, page sizes, aborts
and streaming; the output distribution of sampling kept (chi-square); KV accounting after every scenario and
with drafts in flight.

Drafts come from a request's own tokens and from finished requests: most scenarios run their requests once to
fill the store, then again, and assert that drafts were accepted, so the comparison proves speculation ran.
Comparisons between the tiny model's runs use ``--enable-deterministic-inference`` (a drafted decode is an
extend of several positions, whose float sums may differ from a one-token decode's in the last bits; with
the batch-invariant kernels they may not); the default model's run uses the default kernels."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import ServerArgs
from runtime.core.messages import TokenizedRequest
from runtime.core.sampling_params import SamplingParams
from runtime.scheduler.speculation import make_speculation
from tests.runtime.test_overlap import make_scheduler, prompts

# "full": every step drafts as far as each request's own length allows, so the paths under test really run (the
# default "auto" budget may find that drafts do not pay on a given machine; tests/runtime/test_step_budget.py)
SPEC: dict[str, Any] = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 5,
                        "speculative_draft_budget": "full"}
DET: dict[str, Any] = {"enable_deterministic_inference": True}
REPEAT = list(range(300, 340))


def repeating_prompts() -> list[list[int]]:
    """Prompts whose text repeats (own-sequence drafts) plus the varied mix of the overlap tests."""
    return [REPEAT * 3, [7, 8, 9] + REPEAT * 2 + REPEAT[:5], *prompts(5, n=4)]


def run(engine: Any, ps: list[list[int]], params: Any, **kw: Any) -> list[dict]:
    return engine.generate(input_ids=ps, sampling_params=params, **kw)


def ids_and_finish(res: list[dict]) -> list[tuple[list[int], Any]]:
    return [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in res]


def accepted(engine: Any) -> int:
    return engine.server_info()["scheduler"]["spec_accepted_tokens"]


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "page-16": {"page_size": 16, "chunked_prefill_size": 32},
    "no-radix": {"disable_radix_cache": True},
    "tiny-pool-retraction": {"max_total_tokens": 400, "schedule_conservativeness": 0.01},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_and_logprobs_identical(tiny_engine, name):
    opts = CONFIGS[name]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    ps = repeating_prompts()
    ref = run(tiny_engine(**DET, **opts), ps, params, return_logprob=True, top_logprobs_num=2)
    eng = tiny_engine(**DET, **opts, **SPEC)
    for _ in range(2):  # the second pass drafts from the first one's outputs
        got = run(eng, ps, params, return_logprob=True, top_logprobs_num=2)
        assert ids_and_finish(got) == ids_and_finish(ref)
        for x, y in zip(ref, got):
            assert x["meta_info"]["output_token_logprobs"] == y["meta_info"]["output_token_logprobs"]
            assert x["meta_info"]["output_top_logprobs"] == y["meta_info"]["output_top_logprobs"]
    assert accepted(eng) > 0
    assert sum(r["meta_info"]["spec_accepted_tokens"] for r in got) > 0
    if name == "tiny-pool-retraction":
        assert eng.server_info()["scheduler"]["retractions"] > 0


def test_seeded_sampling_identical_with_penalties_and_min_tokens(tiny_engine):
    ps = repeating_prompts()
    params = [{"max_new_tokens": 20, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 11 + i,
               "frequency_penalty": 0.3 * (i % 2), "repetition_penalty": 1.1 if i == 2 else 1.0,
               "min_new_tokens": 6, "stop_token_ids": [REPEAT[1]]} for i in range(len(ps))]
    ref = run(tiny_engine(**DET), ps, params, return_logprob=True)
    eng = tiny_engine(**DET, **SPEC)
    for _ in range(2):
        got = run(eng, ps, params, return_logprob=True)
        assert ids_and_finish(got) == ids_and_finish(ref)
        assert [r["meta_info"]["output_token_logprobs"] for r in got] == \
            [r["meta_info"]["output_token_logprobs"] for r in ref]
    assert accepted(eng) > 0


def stop_cases(outputs: list, tokenizer: Any) -> list[dict]:
    """Per greedy output ``(ids, finish)``: a stop token, a stop string or a length limit that ends it early, in
    turn (so a draft running past the stop point must be cut exactly there)."""
    params: list[dict] = []
    for i, (ids, _f) in enumerate(outputs):
        p: dict = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 30}
        if i % 3 == 0:
            p["stop_token_ids"] = [ids[9 + i]]
        elif i % 3 == 1:
            text = tokenizer.decode(ids[12:13]).strip()
            if text:
                p["stop"] = [text[:3]]
        else:
            p["max_new_tokens"] = 1 + i
        params.append(p)
    return params


def test_stops_inside_an_accepted_run_and_length_limits(tiny_engine):
    """The store first holds free runs (so drafts run past the stop point); then stop tokens, stop strings and
    max_new_tokens from 1 up must end the output exactly where they do without speculation."""
    ps = repeating_prompts()
    free = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    lock = tiny_engine(**DET)
    ref_free = ids_and_finish(run(lock, ps, free))
    params = stop_cases(ref_free, lock.tokenizer)
    ref = ids_and_finish(run(lock, ps, params))
    assert any(f["type"] == "stop" for _ids, f in ref)
    eng = tiny_engine(**DET, **SPEC)
    assert ids_and_finish(run(eng, ps, free)) == ref_free
    before = accepted(eng)
    got = run(eng, ps, params)
    assert ids_and_finish(got) == ref
    assert accepted(eng) > before
    for r, p in zip(got, params):
        assert r["meta_info"]["completion_tokens"] <= p["max_new_tokens"]


def test_grammar_constrained_requests_do_not_draft_and_are_unchanged(tiny_engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [{"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)},
              {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}]
    ps = [REPEAT * 2, REPEAT * 2]
    ref = ids_and_finish(run(tiny_engine(**DET), ps, params))
    eng = tiny_engine(**DET, **SPEC)
    for _ in range(2):
        got = run(eng, ps, params)
        assert ids_and_finish(got) == ref
    assert got[0]["meta_info"]["spec_draft_tokens"] == 0
    assert got[1]["meta_info"]["spec_accepted_tokens"] > 0


def test_streaming_frames_carry_several_tokens_and_end_equal(tiny_engine):
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    eng = tiny_engine(**DET, **SPEC)
    whole = run(eng, [REPEAT * 2], params)[0]
    frames = list(eng.generate(input_ids=REPEAT * 2, sampling_params=params, stream=True))
    assert frames[-1]["output_ids"] == whole["output_ids"]
    sizes = [len(b["output_ids"]) - len(a["output_ids"]) for a, b in zip(frames, frames[1:])]
    assert max(sizes) > 1  # accepted drafts arrive together


def test_default_model_greedy_identical(smol_engine):
    tok = smol_engine.tokenizer
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in ("Copy this code exactly, then add mul in the same style:\n\n" + code,
                       "Repeat this sentence three times: the cat sat on the mat and looked at the moon.")]
    params = {"max_new_tokens": 40, "temperature": 0}
    ref = smol_engine.generate(prompt=texts, sampling_params=params)
    from runtime.engine import Engine

    eng = Engine(model="default", max_total_tokens=8192, dtype="float32", log_level="warning", **SPEC)
    try:
        got = eng.generate(prompt=texts, sampling_params=params)
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
        assert accepted(eng) > 0  # own-sequence drafts: the answers copy their prompts
        report = eng.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
    finally:
        eng.shutdown()


# ---------------------------------------------------------------------- driving the scheduler by hand
def test_books_balance_with_drafts_in_flight_and_abort_frees_them(tiny_model_dir):
    """The invariant counted while drafts hold KV (after scheduling, before processing), and after every step;
    an abort between steps leaves nothing behind; the other requests' tokens are unchanged."""
    reqs = [(f"r{i}", p, {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
            for i, p in enumerate(repeating_prompts())]
    outs: dict[str, list[int]] = {}
    for spec in (False, True):
        sched = make_scheduler(tiny_model_dir, page_size=4, **(SPEC if spec else {}))
        for rnd in range(2):
            for rid, ids, sp in reqs:
                sched.submit(TokenizedRequest(f"{rid}-{rnd}", ids, SamplingParams.from_dict(sp)))
            steps = 0
            while sched.busy:
                inp = sched.schedule_next()
                if inp is None:
                    sched.pop_outputs()
                    continue
                holders = {id(r.kv): r.kv for r in [*sched.running, *inp.requests()] if r.kv is not None}
                sched.cache.check_integrity(list(holders.values()))
                for out in sched.pop_outputs() + sched.process(sched.launch(inp)):
                    outs.setdefault(f"{spec}-{out.rid}", []).extend(out.new_token_ids)
                steps += 1
                if rnd == 1 and steps == 4:
                    assert sched.abort("r1-1")
                sched.check_integrity()
        report = sched.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
        if spec:
            assert sched.stats.spec_accepted_tokens > 0
    for key in outs:
        if key.startswith("True") and "r1-1" not in key:
            assert outs[key] == outs[key.replace("True", "False", 1)], key


def test_overlap_loop_runs_without_speculation_and_says_so(caplog):
    args = ServerArgs(device="cpu", enable_overlap_schedule=True, **SPEC).resolve()
    with caplog.at_level(logging.WARNING, logger="runtime.scheduler.speculation"):
        assert make_speculation(args, overlap=True) is None
    assert "overlap" in caplog.text
    assert make_speculation(ServerArgs(device="cpu", **SPEC).resolve(), overlap=False) is not None
    assert make_speculation(ServerArgs(device="cpu").resolve(), overlap=False) is None
    with pytest.raises(ValueError):
        ServerArgs(speculative_num_draft_tokens=0).validate()


# ---------------------------------------------------------------------- the distribution of sampling
VOCAB = 12


def small_vocab_model(folder: Path, smol_dir: Path) -> Path:
    """A random Llama over 12 tokens (the default tokenizer; ids 0..11 only), flat enough to sample from."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.conftest import TOKENIZER_FILES

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      initializer_range=0.15)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smol_dir / name).exists():
            (folder / name).write_bytes((smol_dir / name).read_bytes())
    return folder


# chi-square critical values at p = 0.001 by degrees of freedom (a correct sampler fails one run in 1000)
CHI2_999 = {df: v for df, v in enumerate([0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88,
                                              29.59, 31.26, 32.91, 34.53, 36.12, 37.70], 0)}


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic over cells with an expected count >= 5 (the rest pooled), and its degrees of freedom."""
    n = sum(counts)
    cells: list[tuple[float, float]] = []
    pooled = [0.0, 0.0]
    for c, p in zip(counts, probs):
        if n * p >= 5:
            cells.append((c, n * p))
        else:
            pooled[0] += c
            pooled[1] += n * p
    if pooled[1] > 0:
        cells.append((pooled[0], pooled[1]))
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def test_sampling_with_speculation_keeps_the_distribution(tmp_path, smol_dir):
    """Every request drafts its second token (the prompt holds "5 x x+1" for every x and ends in 5, so the draft
    after its first token x is x+1); over many seeds the first two tokens follow the model's exact
    distributions (from its logits) by a chi-square test. An acceptance rule that favoured drafts (always
    accepting, or accepting with a probability above p(draft)) fails it."""
    model = small_vocab_model(tmp_path / "v12", smol_dir)
    prompt = [t for x in range(VOCAB) for t in (5, x, (x + 1) % VOCAB)] + [5]
    from runtime.engine import Engine

    eng = Engine(model=str(model), max_total_tokens=16384, dtype="float32", log_level="warning", **SPEC)
    try:
        n = 1500
        params = [{"max_new_tokens": 3, "temperature": 1.0, "seed": s, "ignore_eos": True} for s in range(n)]
        res = eng.generate(input_ids=[prompt] * n, sampling_params=params)
        stats = eng.server_info()["scheduler"]
        assert stats["spec_verifications"] >= n // 2 and stats["spec_accepted_tokens"] > 0, stats
        first = [r["output_ids"][0] for r in res]
        second = [r["output_ids"][1] for r in res]
        # the exact distributions, from the model's logits (HF transformers, fp32)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        with torch.no_grad():
            p0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
            nxt = torch.tensor([prompt + [t] for t in range(VOCAB)])
            p1_given = torch.softmax(hf(nxt).logits[:, -1].double(), -1)
        p1 = (p0[:, None] * p1_given).sum(0)
        for observed, probs in ((first, p0), (second, p1)):
            counts = [observed.count(t) for t in range(VOCAB)]
            stat, df = chi_square(counts, probs.tolist())
            assert df >= 3 and stat < CHI2_999[df], (counts, probs.tolist(), stat)
        report = eng.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
    finally:
        eng.shutdown()
