"""The memory hierarchy in the running scheduler (``--enable-hierarchical-cache``): conversations whose
prefixes no longer fit the KV pool come back from the host pool instead of being recomputed, with the
same tokens and logprobs, bit for bit, as a server without the hierarchy (deterministic mode promises
that), and the KV accounting holds on both tiers after every round."""

from __future__ import annotations

import random
from typing import Any

import pytest

DET = {"enable_deterministic_inference": True}
POOL = 1024  # the device pool holds about two of the conversations below


def conversations(n: int, length: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(n)]


def rounds(engine: Any, prompts: list[list[int]], turns: int) -> list[list[Any]]:
    """Every conversation takes a turn, one after the other (so each evicts the older ones), ``turns`` times;
    a turn is the transcript so far plus a few new tokens. The KV books are checked after every round."""
    out: list[list[Any]] = []
    history = [list(p) for p in prompts]
    for t in range(turns):
        got = []
        for i, ids in enumerate(history):
            r = engine.generate(input_ids=ids, return_logprob=True,
                                sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
            got.append((r["output_ids"], [lp for lp, _t, _x in r["meta_info"]["output_token_logprobs"]],
                        r["meta_info"]["cached_tokens"]))
            history[i] = ids + r["output_ids"] + [100 + t, 200 + i]
        report = engine.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
        out.append(got)
    return out


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_serves_evicted_prefixes_with_identical_output(tiny_engine: Any, policy: str) -> None:
    prompts = conversations(6, 300)
    flat = tiny_engine(max_total_tokens=POOL, **DET)
    tiered = tiny_engine(max_total_tokens=POOL, enable_hierarchical_cache=True, hicache_ratio=8,
                         hicache_write_policy=policy, **DET)
    base = rounds(flat, prompts, 3)
    got = rounds(tiered, prompts, 3)
    for turn_base, turn_got in zip(base, got):
        for (ids_b, lp_b, _c), (ids_g, lp_g, _c2) in zip(turn_base, turn_got):
            assert ids_g == ids_b
            assert lp_g == lp_b  # bit for bit
    # without the host tier, the pool forgets the older conversations between their turns ...
    flat_cached = sum(c for turn in base[1:] for _i, _l, c in turn)
    tiered_cached = sum(c for turn in got[1:] for _i, _l, c in turn)
    transcripts = sum(len(p) for p in prompts)
    assert flat_cached < transcripts // 2
    # ... with it, every later turn hits its whole previous transcript (whole pages of it)
    assert tiered_cached >= transcripts * 2
    info = tiered.server_info()["cache"]["tiers"]
    assert info["host"]["hit_tokens"] > transcripts
    assert info["host"]["bytes_to_device"] > 0
    assert info["device"]["hit_tokens"] + info["host"]["hit_tokens"] == tiered.server_info()["cache"]["hit_tokens"]


def test_host_pool_smaller_than_the_working_set_still_matches(tiny_engine: Any) -> None:
    """A host pool that cannot hold every conversation drops the least recently used ones; outputs are
    still those of the flat cache, and both tiers' books still balance."""
    prompts = conversations(6, 300, seed=5)
    flat = tiny_engine(max_total_tokens=POOL, **DET)
    tiered = tiny_engine(max_total_tokens=POOL, enable_hierarchical_cache=True, hicache_ratio=1.0, **DET)
    base = rounds(flat, prompts, 2)
    got = rounds(tiered, prompts, 2)
    assert [[ids for ids, _l, _c in t] for t in got] == [[ids for ids, _l, _c in t] for t in base]
    host = tiered.server_info()["cache"]["tiers"]["host"]
    assert host["dropped_tokens"] > 0
