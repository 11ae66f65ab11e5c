"""The waiting-queue order: LPM puts the longest cached prefix first, FCFS keeps arrival order; and the
scheduler admits in the order its policy gives."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from radix import PagedAllocator, RadixCache, ReqToTokenPool
from runtime.core.messages import RequestOptions, TokenizedRequest
from runtime.core.sampling_params import SamplingParams
from runtime.scheduler.policy import LPM_MAX_QUEUE, FCFSPolicy, LPMPolicy, PriorityPolicy, make_schedule_policy
from runtime.scheduler.req import Req

CACHED = list(range(100, 160))  # 60 tokens in the cache


def cache_with(*prompts: list[int]) -> RadixCache:
    alloc = PagedAllocator(512, page_size=1)
    cache = RadixCache(alloc, ReqToTokenPool(8, 256))
    for tokens in prompts:
        cache.insert(tokens, alloc.alloc(len(tokens)))
    return cache


def req(rid: str, tokens: list[int], retractions: int = 0, priority: int = 0) -> Req:
    msg = TokenizedRequest(rid, tokens, SamplingParams(max_new_tokens=4), RequestOptions(priority=priority))
    r = Req.from_message(msg, seed=0, eos_ids=frozenset())
    r.retractions = retractions
    return r


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def test_lpm_puts_the_longest_cached_prefix_first_and_fcfs_keeps_arrival_order() -> None:
    cache = cache_with(CACHED)
    waiting = [req("miss", list(range(900, 940))), req("short-hit", CACHED[:20] + [1, 2, 3]),
               req("long-hit", CACHED[:50] + [4, 5]), req("miss-2", list(range(700, 730)))]
    fcfs, lpm = FCFSPolicy(), LPMPolicy()
    assert rids(fcfs.order(waiting, cache)) == ["miss", "short-hit", "long-hit", "miss-2"]
    assert rids(lpm.order(waiting, cache)) == ["long-hit", "short-hit", "miss", "miss-2"]  # stable for ties
    assert (fcfs.reorders, lpm.reorders) == (0, 1)
    # the lookups only looked: nothing counted as a hit, the queue itself is untouched
    assert cache.stats().hit_tokens == 0 and rids(waiting)[0] == "miss"


def test_lpm_keeps_retracted_requests_first_and_falls_back_to_arrival_order_when_long() -> None:
    cache = cache_with(CACHED)
    lpm = LPMPolicy()
    waiting = [req("retracted", list(range(900, 940)), retractions=1), req("hit", CACHED[:50] + [4])]
    assert rids(lpm.order(waiting, cache)) == ["retracted", "hit"]
    assert lpm.reorders == 0
    many = [req(f"m{i}", list(range(1000 + i, 1010 + i))) for i in range(LPM_MAX_QUEUE)] + [req("hit", CACHED)]
    assert rids(lpm.order(many, cache)) == rids(many)  # past LPM_MAX_QUEUE: FCFS
    assert rids(lpm.order(many[-LPM_MAX_QUEUE:], cache))[0] == "hit"
    with pytest.raises(ValueError, match="unknown schedule policy"):
        make_schedule_policy("sjf")


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_the_scheduler_admits_in_its_policys_order(tiny_engine: Any, policy: str) -> None:
    """One request runs at a time. While a blocker runs, a request with nothing cached and then one whose
    prompt is cached queue up; the blocker is aborted and the next admission shows who went first."""
    engine = tiny_engine(max_running_requests=1, schedule_policy=policy)
    cached = list(range(2000, 2100))
    engine.generate(input_ids=cached, sampling_params={"max_new_tokens": 1})  # now in the cache
    long = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}
    results: dict[str, dict] = {}

    def go(rid: str, ids: list[int]) -> None:
        results[rid] = engine.generate(input_ids=ids, rid=rid, sampling_params=long)

    def running() -> list[str]:
        return list(engine.inspect(lambda s: [r.rid for r in s.running]))

    def wait_until(what: str, predicate: Any) -> None:
        deadline = time.time() + 60
        while not predicate():
            assert time.time() < deadline, what
            time.sleep(0.01)

    threads = [threading.Thread(target=go, args=args) for args in
               (("blocker", list(range(10, 30))), ("miss", list(range(5000, 5100))), ("hit", cached + [7, 8]))]
    threads[0].start()
    wait_until("the blocker runs", lambda: running() == ["blocker"])
    for t in threads[1:]:  # "miss" arrives first
        t.start()
        n = threads.index(t)
        wait_until(f"{n} requests wait", lambda n=n: engine.server_info()["num_waiting_reqs"] == n)
    engine.abort("blocker")
    wait_until("the next request runs", lambda: running() not in ([], ["blocker"]))
    first = running()
    for rid in ("miss", "hit"):
        engine.abort(rid)
    for t in threads:
        t.join(30)
    assert first == (["hit"] if policy == "lpm" else ["miss"])
    info = engine.server_info()
    assert info["scheduler"]["schedule_policy"] == policy
    assert (info["scheduler"]["queue_reorders"] > 0) == (policy == "lpm")
    if policy == "lpm":
        assert results["hit"]["meta_info"]["cached_tokens"] == len(cached)
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results.values())
    report = engine.check_integrity()
    assert report["private"] == 0 and report["protected"] == 0


def test_priority_classes_first_then_the_inner_order() -> None:
    cache = cache_with(CACHED)
    waiting = [req("low-miss", list(range(900, 940)), priority=0), req("low-hit", CACHED[:50] + [4], priority=0),
               req("high-miss", list(range(700, 730)), priority=5), req("mid", list(range(600, 610)), priority=1)]
    high_first = make_schedule_policy("lpm", by_priority=True)
    assert isinstance(high_first, PriorityPolicy) and high_first.name == "priority+lpm"
    assert rids(high_first.order(waiting, cache)) == ["high-miss", "mid", "low-hit", "low-miss"]
    low_first = make_schedule_policy("fcfs", by_priority=True, low_values_first=True)
    assert rids(low_first.order(waiting, cache)) == ["low-miss", "low-hit", "mid", "high-miss"]
    assert make_schedule_policy("lpm").name == "lpm"  # off unless asked for


def test_retraction_gives_back_the_lowest_priority_first() -> None:
    running = [req("old-low", [1, 2], priority=0), req("new-high", [3, 4], priority=9), req("new-low", [5], priority=0)]
    for i, r in enumerate(running):
        r.arrival = float(i)
    assert LPMPolicy().retraction_victim(running).rid == "new-low"  # newest
    assert make_schedule_policy("lpm", by_priority=True).retraction_victim(running).rid == "new-low"
    running[2].options = dataclasses.replace(running[2].options, priority=20)
    assert make_schedule_policy("lpm", by_priority=True).retraction_victim(running).rid == "old-low"
    assert LPMPolicy().retraction_victim(running).rid == "new-low"
