"""The scheduler's features under tensor parallelism (tp 2, the tiny model): the overlap loop with retraction,
the host tier and grammar-constrained requests; aborts; cascade attention over a shared prefix.

Deterministic mode promises batch invariance at any tp size, so at tp 2 the overlap loop with a pool small
enough to retract (and the host tier behind it, whose copies are collectives with the other rank) must give
the lockstep loop's bits; any difference is a scheduling or copy bug. Cascade groups are planned by every
rank from its mirror of the page table: their logits must be tp 1's (up to the row-parallel sums' rounding).
Every Engine ends with the KV books checked on every tier and its rank processes gone (``tp_engine``).
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import torch

from runtime.core.forward_batch import build_forward_batch
from tests.runtime.test_constrained import REGEX, SCHEMA, valid_json, valid_regex
from tests.runtime.test_tensor_parallel import rank_processes, tp_engine
from tests.runtime.test_tensor_parallel_tiers import prefill, runner

DET = {"enable_deterministic_inference": True}


def prompts(seed: int = 0) -> list[list[int]]:
    """Eight prompts of varied lengths, four of them under one 70-token prefix."""
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(k)]

    base = toks(70)
    return [base + toks(k) for k in (3, 11, 25, 40)] + [toks(k) for k in (5, 33, 60, 17)]


def greedy_params() -> list[dict[str, Any]]:
    """Greedy requests finishing at different steps: each finish is cached (and, write-through, copied to the
    host: a collective) while the overlap loop's next batch runs on the worker thread."""
    return [{"temperature": 0, "max_new_tokens": 6 + 5 * i, "ignore_eos": True} for i in range(8)]


def grammar_params() -> list[dict[str, Any]]:
    """Seeded sampling under a JSON schema or a regex (every third, from the first) among greedy requests;
    grammars make the overlap loop process each batch before it schedules the next (lockstep)."""
    out: list[dict[str, Any]] = []
    for i in range(8):
        if i % 3 == 0:
            out.append({"temperature": 1.0, "seed": i, "max_new_tokens": 48, "json_schema": json.dumps(SCHEMA)})
        elif i % 3 == 1:
            out.append({"temperature": 1.0, "seed": i, "max_new_tokens": 48, "regex": REGEX})
        else:
            out.append({"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    return out


def run(engine: Any, params: list[dict[str, Any]]) -> list[tuple[list[int], list[float], str]]:
    res = engine.generate(input_ids=prompts(), sampling_params=params, return_logprob=True)
    return [(r["output_ids"], [lp for lp, _t, _x in r["meta_info"]["output_token_logprobs"]], r["text"])
            for r in res]


def workload(engine: Any) -> list[list[tuple[list[int], list[float], str]]]:
    """Greedy, then grammars, then greedy again over prefixes now cached on the device and the host."""
    return [run(engine, greedy_params()), run(engine, grammar_params()), run(engine, greedy_params())]


def test_overlap_retraction_host_tier_and_grammars_at_tp2_equal_lockstep(tiny_model_dir: Path) -> None:
    with tp_engine(tiny_model_dir, 2, max_total_tokens=4096, **DET) as eng:
        lockstep = workload(eng)
    tight = {"max_total_tokens": 320, "schedule_conservativeness": 0.01, "enable_hierarchical_cache": True,
             "hicache_ratio": 4}
    with tp_engine(tiny_model_dir, 2, enable_overlap_schedule=True, **tight, **DET) as eng:
        overlapped = workload(eng)
        info = eng.server_info()
        sched, host = info["scheduler"], info["cache"]["tiers"]["host"]
        assert sched["retractions"] > 0, sched
        assert sched["lockstep_steps"] < sched["steps"] // 2, sched  # most steps overlapped a batch in flight
        assert host["bytes_to_host"] > 0 and host["hit_tokens"] > 0, host
    assert overlapped == lockstep
    for i, (_ids, _lp, text) in enumerate(overlapped[1]):
        if i % 3 == 0:
            assert valid_json(text), text
        elif i % 3 == 1:
            assert valid_regex(text), text


def test_aborts_at_tp2_free_their_kv_and_the_ranks_keep_serving(tiny_model_dir: Path) -> None:
    """A queued and a running request aborted by id, and a stream abandoned midway, in the overlap loop."""
    with tp_engine(tiny_model_dir, 2, enable_overlap_schedule=True, max_running_requests=1) as eng:
        results: dict[str, dict[str, Any]] = {}

        def go(rid: str, n: int) -> None:
            results[rid] = eng.generate(input_ids=list(range(10, 60)), rid=rid,
                                        sampling_params={"max_new_tokens": n, "ignore_eos": True})

        threads = [threading.Thread(target=go, args=("long", 4000)), threading.Thread(target=go, args=("queued", 5))]
        threads[0].start()
        deadline = time.time() + 60
        while eng.server_info()["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.01)
        threads[1].start()
        while eng.server_info()["num_waiting_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.01)
        eng.abort("queued")
        threads[1].join(30)
        eng.abort("long")
        threads[0].join(30)
        assert results["queued"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert results["long"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < results["long"]["meta_info"]["completion_tokens"] < 4000
        stream = eng.generate(input_ids=list(range(10, 40)), stream=True,
                              sampling_params={"max_new_tokens": 4000, "ignore_eos": True})
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the caller walked away: the request is aborted
        while eng.server_info()["num_running_reqs"]:
            assert time.time() < deadline
            time.sleep(0.01)
        assert eng.server_info()["kv"]["private"] == 0
        out = eng.generate(input_ids=list(range(10, 60)), sampling_params={"max_new_tokens": 5, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 5


def test_cascade_groups_at_tp2_match_tp1(tiny_model_dir: Path) -> None:
    """Four requests under one cached 320-token prefix: the backend attends them as a cascade group, planned
    on every rank from its mirror table (broadcast rows include the shared prefix's slots)."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 49000) for _ in range(320)]
    own = [[rng.randrange(3, 49000) for _ in range(2)] for _ in range(4)]
    logits = {}
    for tp in (1, 2):
        r = runner(tiny_model_dir, tp)
        try:
            prefix = prefill(r, 0, shared)
            slots = r.allocator.alloc(8)
            table = r.req_to_token.table
            for i in range(4):
                table[i + 1, :320] = prefix
                table[i + 1, 320:322] = slots[2 * i : 2 * i + 2]
            fb = build_forward_batch(own, [320] * 4, [1, 2, 3, 4], slots, r.kv, table, r.device)
            logits[tp] = r.forward(fb, torch.arange(fb.num_tokens))
            cascade = fb.attn_metadata.cascade
            assert cascade is not None and len(cascade.shared) == 1 and cascade.shared[0].prefix_len == 320
        finally:
            r.close()
    torch.testing.assert_close(logits[2], logits[1], rtol=0, atol=1e-4)
    assert rank_processes() == []
