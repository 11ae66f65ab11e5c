"""Draft-model speculative decoding (``--speculative-algorithm draft``) end to end: the same tokens and logprobs
as without it (greedy and seeded, bit for bit in deterministic mode), stops and length limits inside an accepted
run, grammars, retraction, page sizes, a step budget that cuts drafts short, an abort with drafts in flight; the
KV books after every scenario; the draft model's KV equal to the served model's in every cached slot; the
start-up refusals.

Two drafts: the served tiny model itself (deterministic kernels make the draft's argmax the served model's, so
every draft token must be accepted: a slot whose draft KV were missing or stale would show as a rejection),
and a smaller one — the first layer of a target whose second layer adds little — accepted about half the time,
so partial acceptance and rejection are exercised too."""

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
from runtime.engine import Engine
from runtime.executor.draft_model import load_draft
from runtime.scheduler.speculation import make_speculation
from tests.conftest import TOKENIZER_FILES, checked_engine
from tests.runtime.test_overlap import make_scheduler
from tests.runtime.test_speculative import (
    REPEAT,
    ids_and_finish,
    repeating_prompts,
    run,
    small_vocab_model,
    stop_cases,
)

DET: dict[str, Any] = {"enable_deterministic_inference": True}
OPTS: dict[str, Any] = {"max_total_tokens": 8192, "dtype": "float32", **DET}


def draft(path: Path, k: int = 5) -> dict[str, Any]:
    return {"speculative_algorithm": "draft", "speculative_draft_model": str(path), "speculative_num_draft_tokens": k,
            "speculative_draft_budget": "full"}  # every step drafts, so the paths under test really run


def spec_stats(engine: Any) -> dict[str, Any]:
    return {k: v for k, v in engine.server_info()["scheduler"].items() if k.startswith("spec_")}


def assert_draft_kv_mirrors(engine: Any) -> None:
    """With the served model as its own draft, every slot the cache holds has the same K and V in both storages
    (both computed by the same batches through the same weights and kernels)."""
    runner = engine.runner
    slots = torch.cat([s.flatten() for s in engine.scheduler.cache.owned_slots()] + [torch.empty(0, dtype=torch.int64)])
    assert slots.numel() > 0
    assert torch.equal(runner.draft.kv.k_buffer[:, slots], runner.kv.k_buffer[:, slots])
    assert torch.equal(runner.draft.kv.v_buffer[:, slots], runner.kv.v_buffer[:, slots])


@pytest.fixture(scope="module")
def weak_pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): the tiny model with its second layer's output projections scaled by 0.1, and its first
    layer alone (1 layer instead of 2): the draft agrees with the target about half the time."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("weak-pair")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(0.1)
        model.model.layers[1].mlp.down_proj.weight.mul_(0.1)
    out = []
    for name, layers in (("target", 2), ("draft", 1)):
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        model.save_pretrained(root / name)
        for f in TOKENIZER_FILES:
            if (tiny_model_dir / f).exists():
                (root / name / f).write_bytes((tiny_model_dir / f).read_bytes())
        out.append(root / name)
    return out[0], out[1]


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "page-16": {"page_size": 16, "chunked_prefill_size": 32},
    "no-radix": {"disable_radix_cache": True},
    "tiny-pool-retraction": {"max_total_tokens": 400, "schedule_conservativeness": 0.01},
    "step-budget-cuts-drafts": {"chunked_prefill_size": 12},  # 6 draft tokens a step: ragged draft lengths
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_self_draft_greedy_tokens_and_logprobs_identical_and_every_draft_accepted(tiny_engine, tiny_model_dir,
                                                                                  name):
    opts = CONFIGS[name]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    ps = repeating_prompts()
    ref = run(tiny_engine(**DET, **opts), ps, params, return_logprob=True, top_logprobs_num=2)
    eng = tiny_engine(**DET, **opts, **draft(tiny_model_dir))
    for _ in range(2):  # the second pass runs over a warm cache: drafts read the draft KV of cached prefixes
        got = run(eng, ps, params, return_logprob=True, top_logprobs_num=2)
        assert ids_and_finish(got) == ids_and_finish(ref)
        for x, y in zip(ref, got):
            assert x["meta_info"]["output_token_logprobs"] == y["meta_info"]["output_token_logprobs"]
            assert x["meta_info"]["output_top_logprobs"] == y["meta_info"]["output_top_logprobs"]
    stats = spec_stats(eng)
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"], stats
    assert all(r["meta_info"]["spec_accepted_tokens"] > 0 for r in got)
    if name == "tiny-pool-retraction":
        assert eng.server_info()["scheduler"]["retractions"] > 0
    if name != "no-radix":
        assert_draft_kv_mirrors(eng)


def test_smaller_draft_is_partly_accepted_and_changes_nothing(weak_pair):
    target, small = weak_pair
    ps = repeating_prompts()
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    seeded = [{"max_new_tokens": 20, "temperature": 0.8, "top_k": 20, "seed": 5 + i, "ignore_eos": True}
              for i in range(len(ps))]
    with checked_engine(target, **OPTS) as plain:
        ref = [run(plain, ps, p, return_logprob=True) for p in (greedy, seeded)]
    with checked_engine(target, **OPTS, **draft(small, k=4)) as eng:
        assert eng.runner.draft.model.arch.num_layers == 1
        for want, params in zip(ref, (greedy, seeded)):
            got = run(eng, ps, params, return_logprob=True)
            assert ids_and_finish(got) == ids_and_finish(want)
            assert [r["meta_info"]["output_token_logprobs"] for r in got] == \
                [r["meta_info"]["output_token_logprobs"] for r in want]
        stats = spec_stats(eng)
    assert 0.1 < stats["spec_accept_rate"] < 0.9, stats  # partly accepted: runs end inside drafts


def test_seeded_sampling_identical_with_penalties_and_min_tokens(tiny_engine, tiny_model_dir):
    ps = repeating_prompts()
    params = [{"max_new_tokens": 20, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 11 + i,
               "frequency_penalty": 0.3 * (i % 2), "repetition_penalty": 1.1 if i == 2 else 1.0,
               "min_new_tokens": 6, "stop_token_ids": [REPEAT[1]]} for i in range(len(ps))]
    ref = run(tiny_engine(**DET), ps, params, return_logprob=True)
    eng = tiny_engine(**DET, **draft(tiny_model_dir))
    got = run(eng, ps, params, return_logprob=True)
    assert ids_and_finish(got) == ids_and_finish(ref)
    assert [r["meta_info"]["output_token_logprobs"] for r in got] == \
        [r["meta_info"]["output_token_logprobs"] for r in ref]
    assert spec_stats(eng)["spec_accepted_tokens"] > 0


def test_stops_inside_an_accepted_run_and_length_limits(tiny_engine, tiny_model_dir):
    """Every draft of the self-draft is accepted, so drafts run past the stop points; stop tokens, stop strings
    and max_new_tokens from 1 up must end the output exactly where they do without speculation."""
    ps = repeating_prompts()
    lock = tiny_engine(**DET)
    free = ids_and_finish(run(lock, ps, {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}))
    params = stop_cases(free, lock.tokenizer)
    ref = ids_and_finish(run(lock, ps, params))
    assert any(f["type"] == "stop" for _ids, f in ref)
    eng = tiny_engine(**DET, **draft(tiny_model_dir))
    got = run(eng, ps, params)
    assert ids_and_finish(got) == ref
    stats = spec_stats(eng)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats  # the stops cut accepted runs
    for r, p in zip(got, params):
        assert r["meta_info"]["completion_tokens"] <= p["max_new_tokens"]


def test_grammar_constrained_requests_do_not_draft(tiny_engine, tiny_model_dir):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [{"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)},
              {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}]
    ps = [REPEAT * 2, REPEAT * 2]
    ref = ids_and_finish(run(tiny_engine(**DET), ps, params))
    got = run(tiny_engine(**DET, **draft(tiny_model_dir)), ps, params)
    assert ids_and_finish(got) == ref
    assert got[0]["meta_info"]["spec_draft_tokens"] == 0
    assert got[1]["meta_info"]["spec_accepted_tokens"] > 0


# ---------------------------------------------------------------------- driving the scheduler by hand
def holders(sched: Any, inp: Any) -> list[Any]:
    """The KV of every request holding some between scheduling and processing a step (admitted prompts are not
    running yet)."""
    return list({id(r.kv): r.kv for r in [*sched.running, *inp.requests()] if r.kv is not None}.values())


def test_abort_with_a_draft_in_flight_frees_it_and_the_books_balance(weak_pair):
    """Between scheduling and processing a step, a request holding draft slots is aborted: its draft's slots are
    freed (not cached), the books balance at every point, and the other requests' tokens are unchanged."""
    target, small = weak_pair
    reqs = [(f"r{i}", p, {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
            for i, p in enumerate(repeating_prompts())]
    outs: dict[bool, dict[str, list[int]]] = {False: {}, True: {}}
    aborted = None
    for spec in (False, True):
        sched = make_scheduler(target, page_size=4, **(draft(small, k=4) if spec else {}))
        for rid, ids, sp in reqs:
            sched.submit(TokenizedRequest(rid, ids, SamplingParams.from_dict(sp)))
        while sched.busy:
            inp = sched.schedule_next()
            if inp is None:
                sched.pop_outputs()
                continue
            sched.cache.check_integrity(holders(sched, inp))  # drafts in flight count as private slots
            with_draft = [p.req for p in inp.plans if p.draft]
            if spec and aborted is None and with_draft:
                victim = with_draft[0]
                aborted = victim.rid
                assert victim.kv is not None and victim.kv_len > len(victim.tokens)
                assert sched.abort(aborted)
                assert victim.kv is None
                sched.cache.check_integrity(holders(sched, inp))
            for out in sched.pop_outputs() + sched.process(sched.launch(inp)):
                outs[spec].setdefault(out.rid, []).extend(out.new_token_ids)
            sched.check_integrity()
        report = sched.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
    assert aborted is not None and sched.stats.spec_accepted_tokens > 0
    for rid, tokens in outs[True].items():
        if rid != aborted:
            assert tokens == outs[False][rid], rid
    assert outs[True][aborted] == outs[False][aborted][: len(outs[True][aborted])]


# ---------------------------------------------------------------------- start-up: memory, refusals, overlap
def test_pool_sized_for_both_storages(tiny_model_dir, monkeypatch):
    """From a memory budget the pool's capacity pays for the served and the draft KV (here the same shape: half
    the tokens), and the draft storage has a slot for every slot of the pool."""
    from runtime.executor.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_memory_available", lambda self: 64 << 20)
    base = {"model": str(tiny_model_dir), "device": "cpu", "dtype": "float32", "mem_fraction_static": 0.5}
    alone = ModelRunner(ServerArgs(**base).resolve())
    both = ModelRunner(ServerArgs(**base, **draft(tiny_model_dir)).resolve())
    assert alone.draft is None and both.draft is not None and both.draft.kv is not None
    assert abs(both.allocator.capacity - alone.allocator.capacity // 2) <= 2
    assert both.draft.kv.total_slots == both.kv.total_slots


def test_refusals_name_the_flag(tiny_model_dir, tmp_path, smol_dir):
    ok = ServerArgs(**draft(tiny_model_dir))
    ok.validate()
    for bad, flag, words in (
        ({"tp_size": 2}, "speculative_algorithm", "--tp-size"),
        ({"enable_hierarchical_cache": True}, "speculative_algorithm", "--enable-hierarchical-cache"),
        ({"speculative_draft_model": None}, "speculative_draft_model", "needs --speculative-draft-model"),
        ({"speculative_algorithm": "ngram"}, "speculative_draft_model", "--speculative-algorithm draft"),
    ):
        with pytest.raises(ValueError, match=flag) as err:
            ServerArgs(**{**draft(tiny_model_dir), **bad}).validate()
        assert words in str(err.value)
    small = small_vocab_model(tmp_path / "v12", smol_dir)
    with pytest.raises(ValueError, match=r"speculative_draft_model: .* vocabulary of 12 tokens .* 49152"):
        Engine(model=str(tiny_model_dir), max_total_tokens=1024, log_level="warning", **draft(small))
    with pytest.raises(ValueError, match=r"speculative_draft_model: .*does not exist"):
        Engine(model=str(tiny_model_dir), max_total_tokens=1024, log_level="warning",
               **draft(tmp_path / "missing"))


def test_cli_refuses_and_explains_the_flag(tiny_model_dir, capsys):
    from runtime.cli import build_parser, main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tiny_model_dir), "--speculative-algorithm", "draft",
              "--speculative-draft-model", str(tiny_model_dir), "--tp-size", "2"])
    assert exit_.value.code == 2
    assert "speculative_algorithm" in capsys.readouterr().err
    ns = build_parser().parse_args(["serve", "--speculative-algorithm", "draft", "--speculative-draft-model-path",
                                    "x"])
    assert ns.speculative_draft_model == "x"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--speculative-draft-model" in text and "same vocabulary" in text


def test_overlap_loop_runs_without_speculation_and_loads_no_draft(tiny_model_dir, caplog):
    args = ServerArgs(device="cpu", enable_overlap_schedule=True, **draft(tiny_model_dir)).resolve()
    assert load_draft(args, None, torch.device("cpu")) is None  # never read: nothing is loaded
    with caplog.at_level(logging.WARNING, logger="runtime.scheduler.speculation"):
        assert make_speculation(args, overlap=True) is None
    assert "overlap" in caplog.text
    with pytest.raises(ValueError, match="speculative_algorithm"):  # a runner without the draft model
        make_speculation(ServerArgs(device="cpu", **draft(tiny_model_dir)).resolve(), overlap=False)
