"""Router unit tests without servers: policies, the prefix tree, health hysteresis, the slot gate, parsing."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radix.events import BlocksRemoved, BlocksStored, CacheMirror, chain_hashes, root_hash
from router.errors import RouterError
from router.kv_mirror import KvEventFeed, KvEventHub
from router.observe import ResponseObserver
from router.policies import CacheAware, PowerOfTwo, RoundRobin, ShortestQueue, imbalanced
from router.prefix_tree import PrefixTree
from router.request_view import CHAT, GENERATE, RequestView
from router.workers import SlotGate, Worker, WorkerRegistry


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", healthy=True, checked=True, load=ld) for i, ld in enumerate(loads)]


def gen(text: str) -> RequestView:
    return RequestView.parse(GENERATE, {"text": text})


def cache_aware(ws: list[Worker], **kw: object) -> CacheAware:
    policy = CacheAware(**kw)  # type: ignore[arg-type]
    for w in ws:
        policy.add_worker(w)
    return policy


def route(policy: CacheAware, view: RequestView, ws: list[Worker]):
    policy.prepare(view)
    return policy.select(view, ws)


# ---------------------------------------------------------------------- imbalance guard
def test_imbalanced_needs_both_thresholds() -> None:
    assert not imbalanced([10, 3], abs_threshold=8, rel_threshold=1.5)  # spread 7 <= 8
    assert imbalanced([12, 3], abs_threshold=8, rel_threshold=1.5)
    assert not imbalanced([40, 30], abs_threshold=8, rel_threshold=1.5)  # 40 <= 1.5 * 30
    assert imbalanced([0, 9], abs_threshold=8, rel_threshold=1.5)
    assert not imbalanced([], 0, 1.0)


def test_guard_overrules_the_cache_when_the_best_worker_is_too_busy() -> None:
    ws = workers(0, 0, 0)
    policy = cache_aware(ws, balance_abs_threshold=2, balance_rel_threshold=1.0)
    prefix = "shared system prompt " * 20
    first = route(policy, gen(prefix + "q0"), ws)
    assert first.reason == "load"
    home = first.worker
    # The group follows its prefix while the spread after placing stays within 2 ...
    home.load = 1
    again = route(policy, gen(prefix + "q1"), ws)
    assert again.worker is home and again.reason == "cache" and again.match > 0
    # ... and is sent elsewhere once following it would make the spread 3.
    home.load = 2
    moved = route(policy, gen(prefix + "q2"), ws)
    assert moved.worker is not home and moved.reason == "balance"
    assert policy.guard_overrides == 1
    # The prefix now lives on two workers: the next request can use either.
    home.load, moved.worker.load = 2, 1
    nxt = route(policy, gen(prefix + "q3"), ws)
    assert nxt.worker is moved.worker and nxt.reason == "cache"


def test_relative_threshold_tolerates_spread_between_busy_workers() -> None:
    ws = workers(20, 12, 12)
    policy = cache_aware(ws, balance_abs_threshold=4, balance_rel_threshold=2.0)
    policy.trees[ws[0].url].insert(gen("x" * 400).text_key()[0])
    choice = route(policy, gen("x" * 400 + "tail"), ws)
    assert choice.worker is ws[0] and choice.reason == "cache"  # 21 - 12 > 4, but 21 <= 2 * 12


# ---------------------------------------------------------------------- threshold
def test_threshold_decides_between_cache_and_load() -> None:
    ws = workers(0, 0)
    policy = cache_aware(ws, cache_threshold=0.5)
    system = "You are a helpful assistant. " * 4  # ~116 bytes
    policy.trees[ws[0].url].insert(gen(system + "first question").text_key()[0])
    ws[0].load = 1
    short = route(policy, gen(system + "a much longer and different question " * 4), ws)
    assert short.reason == "load" and short.worker is ws[1]  # match < half the prompt: balance instead
    long = route(policy, gen(system + "first question, again"), ws)
    assert long.reason == "cache" and long.worker is ws[0]
    assert long.match == len((system + "first question").encode())
    assert long.prompt_units == len((system + "first question, again").encode())


def test_namespaces_and_prompt_kinds_never_match_each_other() -> None:
    ws = workers(0)
    policy = cache_aware(ws)
    policy.trees[ws[0].url].insert(gen("hello world " * 20).text_key()[0])
    salted = RequestView.parse(GENERATE, {"text": "hello world " * 20, "cache_salt": "tenant-a"})
    chat = RequestView.parse(CHAT, {"messages": [{"role": "user", "content": "hello world " * 20}]})
    for view in (salted, chat):
        policy.prepare(view)
        found = policy.matches(view, ws)
        assert found is not None and found[0][ws[0].url] == 0


def test_chat_keys_grow_append_only() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn1 = RequestView.parse(CHAT, {"messages": msgs})
    after = turn1.text_key_with_completion("hello there")
    turn2 = RequestView.parse(CHAT, {"messages": [*msgs, {"role": "assistant", "content": "hello there"},
                                                  {"role": "user", "content": "and then?"}]})
    assert turn2.text_key()[0].startswith(after)
    assert after.startswith(turn1.text_key()[0])


def test_cache_aware_spreads_new_prefixes_and_follows_answers() -> None:
    ws = workers(0, 0, 0)
    policy = cache_aware(ws)
    homes = {}
    for g in range(3):
        view = gen(f"group {g} " + "context " * 50)
        choice = route(policy, view, ws)
        homes[g] = choice.worker
        policy.on_finished(view, choice, True, " the answer")
    assert len({w.url for w in homes.values()}) == 3  # empty trees: least loaded, then least recent
    follow = route(policy, gen("group 1 " + "context " * 50 + " the answer and more"), ws)
    assert follow.worker is homes[1]
    assert follow.match == len(("group 1 " + "context " * 50 + " the answer").encode())


# ---------------------------------------------------------------------- prefix tree
def test_tree_match_insert_split() -> None:
    t = PrefixTree(10_000)
    t.insert(b"hello world")
    t.insert(b"hello there")
    assert t.match(b"hello world!") == 11
    assert t.match(b"hello th") == 8
    assert t.match(b"help") == 3
    assert t.match(b"xyz") == 0
    assert t.size == len(b"hello world") + len(b"there")
    t.check()


def test_tree_token_units_never_split_a_token() -> None:
    from array import array

    t = PrefixTree(10_000, unit=4)
    t.insert(array("i", [1, 2, 3, 256]).tobytes())
    assert t.match(array("i", [1, 2, 3, 257]).tobytes()) == 3  # 256 and 257 share three bytes
    assert t.size == 4
    t.check()


def test_tree_lru_pruning_keeps_recent_prefixes_and_the_bound() -> None:
    t = PrefixTree(max_size=100)
    for i in range(5):
        t.insert(f"{i}".encode() * 30)  # 30 units each: only 3 fit
    assert t.size <= 100
    assert t.match(b"0" * 30) == 0 and t.match(b"1" * 30) == 0  # oldest gone first
    assert t.match(b"4" * 30) == 30 and t.match(b"3" * 30) == 30
    t.insert(b"2" * 30)  # a use: 2 becomes the most recent
    t.insert(b"5" * 30)
    assert t.match(b"2" * 30) == 30 and t.match(b"3" * 30) == 0
    assert t.pruned == 90  # "0", "1" and "3"
    t.check()


def test_tree_prunes_whole_leaves_and_inner_nodes_become_leaves() -> None:
    t = PrefixTree(max_size=60)
    t.insert(b"a" * 20 + b"b" * 20)
    t.insert(b"a" * 20 + b"c" * 20)  # split: "a"*20 inner, two leaves of 20 -> 60 units
    assert t.size == 60
    t.insert(b"d" * 20)  # 80 > 60: the oldest leaf ("b" branch) goes
    assert t.size == 60 and t.match(b"a" * 20 + b"b" * 20) == 20
    t.insert(b"e" * 20)  # then the "c" branch; its parent becomes a leaf
    assert t.match(b"a" * 20 + b"c" * 5) == 20
    t.insert(b"f" * 20)  # now the lone "a" leaf is the oldest
    assert t.match(b"a" * 20) == 0
    t.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="abc", min_size=1, max_size=12), min_size=1, max_size=40),
       st.integers(min_value=4, max_value=60))
def test_tree_matches_a_naive_model_and_stays_consistent(keys: list[str], max_size: int) -> None:
    t = PrefixTree(max_size)
    for k in keys:
        t.insert(k.encode())
        t.check()
        assert t.size <= max_size or t.size == 0
        if len(k) <= max_size:  # pruning takes older leaves first: the key just inserted survives
            assert t.match(k.encode()) == len(k)


def test_tree_without_pruning_equals_longest_common_prefix() -> None:
    rng = random.Random(0)
    keys = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 15))) for _ in range(200)]
    t = PrefixTree(1 << 20)
    for k in keys:
        t.insert(k.encode())
    for _ in range(200):
        q = "".join(rng.choice("ab") for _ in range(rng.randint(1, 15)))
        best = max(len(_lcp(q, k)) for k in keys)
        assert t.match(q.encode()) == best
    t.check()


def _lcp(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# ---------------------------------------------------------------------- load-based policies
def test_round_robin_takes_turns_and_skips_absent_workers() -> None:
    ws = workers(0, 0, 0)
    rr = RoundRobin()
    picks = [rr.select(gen("x"), ws).worker.url for _ in range(6)]
    assert picks == [w.url for w in ws] * 2
    # w1 is full for a while: the others keep alternating, and w1 is next once it is back
    picks = [rr.select(gen("x"), [ws[0], ws[2]]).worker.url for _ in range(2)]
    assert picks == [ws[0].url, ws[2].url]
    assert rr.select(gen("x"), ws).worker is ws[1]


def test_shortest_queue_picks_min_load_and_rotates_ties() -> None:
    ws = workers(3, 1, 1)
    sq = ShortestQueue()
    assert {sq.select(gen("x"), ws).worker.url for _ in range(2)} == {ws[1].url, ws[2].url}
    ws[2].load = 0
    assert sq.select(gen("x"), ws).worker is ws[2]


def test_power_of_two_never_picks_the_busiest_of_the_pair() -> None:
    ws = workers(0, 5, 10)
    p2 = PowerOfTwo(seed=1)
    counts = Counter(p2.select(gen("x"), ws).worker.url for _ in range(600))
    assert counts[ws[2].url] == 0  # the busiest loses every pair it is drawn in
    assert counts[ws[0].url] > counts[ws[1].url] > 0  # w0 wins 2 of 3 pairs, w1 one
    assert 300 < counts[ws[0].url] < 500
    assert p2.select(gen("x"), ws[:1]).worker is ws[0]


# ---------------------------------------------------------------------- health hysteresis
def test_health_hysteresis() -> None:
    reg = WorkerRegistry(failure_threshold=3, success_threshold=2)
    events: list[str] = []
    reg.listeners.append(lambda w, what: events.append(what))
    w, _ = reg.add("http://127.0.0.1:1/")
    assert w.url == "http://127.0.0.1:1" and not w.healthy
    reg.check_passed(w)  # a new worker is decided by its first check
    assert w.healthy
    reg.failed(w, "slow")
    reg.failed(w, "slow")
    assert w.healthy  # two soft failures are noise
    reg.check_passed(w)  # ... and a success resets the count
    reg.failed(w, "slow")
    reg.failed(w, "slow")
    assert w.healthy
    reg.failed(w, "slow")
    assert not w.healthy  # the third in a row takes it out
    reg.check_passed(w)
    assert not w.healthy  # one success is not enough to come back
    reg.failed(w, "slow")
    reg.check_passed(w)
    assert not w.healthy  # the failure reset the success streak
    reg.check_passed(w)
    assert w.healthy
    reg.failed(w, "connection refused", hard=True)
    assert not w.healthy  # nothing listens there: out at once
    assert events == ["added", "healthy", "unhealthy", "healthy", "unhealthy"]


def test_first_failed_check_needs_the_full_success_streak() -> None:
    reg = WorkerRegistry(failure_threshold=3, success_threshold=2)
    w, _ = reg.add("http://127.0.0.1:2")
    reg.failed(w, "down")
    reg.check_passed(w)
    assert not w.healthy
    reg.check_passed(w)
    assert w.healthy


# ---------------------------------------------------------------------- slot gate
def test_gate_queues_fifo_then_429_and_503() -> None:
    async def scenario() -> None:
        reg = WorkerRegistry()
        w, _ = reg.add("http://127.0.0.1:3")
        reg.check_passed(w)
        gate = SlotGate(reg, max_inflight_per_worker=1, max_queued=2, timeout=5)
        rr = RoundRobin()
        choose = lambda ws: rr.select(gen("x"), ws)  # noqa: E731
        first = await gate.acquire(choose)
        assert first.worker is w and w.load == 1
        order: list[int] = []

        async def waiter(i: int) -> None:
            c = await gate.acquire(choose)
            order.append(i)
            await asyncio.sleep(0.01)
            gate.release(c.worker)

        tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        assert gate.waiting == 2
        with pytest.raises(RouterError) as full:
            await gate.acquire(choose)
        assert full.value.status == 429
        gate.release(w)
        await asyncio.gather(*tasks)
        assert order == [0, 1] and w.load == 0
        # a queued request learns at once that the last worker is gone
        await gate.acquire(choose)
        pending = asyncio.create_task(gate.acquire(choose))
        await asyncio.sleep(0.01)
        reg.failed(w, "refused", hard=True)
        with pytest.raises(RouterError) as gone:
            await pending
        assert gone.value.status == 503
        with pytest.raises(RouterError):
            await gate.acquire(choose)

    asyncio.run(scenario())


def test_gate_timeout_is_503() -> None:
    async def scenario() -> None:
        reg = WorkerRegistry()
        w, _ = reg.add("http://127.0.0.1:4")
        reg.check_passed(w)
        gate = SlotGate(reg, 1, 4, timeout=0.05)
        rr = RoundRobin()
        await gate.acquire(lambda ws: rr.select(gen("x"), ws))
        with pytest.raises(RouterError) as late:
            await gate.acquire(lambda ws: rr.select(gen("x"), ws))
        assert late.value.status == 503 and late.value.code == "queue_timeout" and gate.waiting == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------------- exact mode's matching
def test_hub_matches_like_the_cache_mirror() -> None:
    async def scenario() -> None:
        hub = KvEventHub()
        try:
            rng = random.Random(3)
            prompts = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
            for bs in (1, 4):
                feed = KvEventFeed(hub.ctx, "inproc://unused")
                hub.feeds[f"w{bs}"] = feed
                for p in prompts[:2]:
                    n = len(p) // bs * bs
                    hashes = chain_hashes(root_hash(None), _pack(p[:n]), 4 * bs).tolist()
                    feed.mirror.apply(BlocksStored(None, root_hash(None), hashes, p[:n], bs))
                feed.mirror.apply(BlocksRemoved(hashes[-2:]))
                feed.synced = True
            for q in [prompts[0], prompts[1][:30] + [7] * 10, prompts[2]]:
                got = hub.match_lens(q, None, ["w1", "w4", "missing"])
                for bs in (1, 4):
                    ref = CacheMirror(bs, dict(hub.feeds[f"w{bs}"].mirror.blocks))
                    assert got[f"w{bs}"] == ref.match_len(q), (bs, got)
                assert got["missing"] == 0
            assert hub.match_lens(prompts[0], "other-namespace", ["w1"])["w1"] == 0
        finally:
            hub.feeds.clear()
            await hub.close()

    asyncio.run(scenario())


def _pack(tokens: list[int]) -> bytes:
    from array import array

    return array("i", tokens).tobytes()


# ---------------------------------------------------------------------- parsing and observing
def test_request_view_parsing() -> None:
    v = RequestView.parse(GENERATE, {"text": ["a", "b"], "cache_salt": ["s1", "s2"], "stream": True})
    assert v.text == "a" and v.namespace == "s1" and v.stream
    v = RequestView.parse(GENERATE, {"input_ids": [[1, 2], [3]]})
    assert v.input_ids == [1, 2]
    v = RequestView.parse("/v1/completions", {"prompt": [5, 6, 7]})
    assert v.input_ids == [5, 6, 7]
    assert not RequestView.parse(GENERATE, ["not", "an", "object"]).routable
    assert not RequestView.parse(CHAT, {"messages": "nope"}).routable


def test_observer_reads_split_sse_and_json() -> None:
    frames = [b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
              b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":50,"completion_tokens":2,'
              b'"prompt_tokens_details":{"cached_tokens":32}}}\n\ndata: [DONE]\n\n']
    stream = b"".join(frames)
    obs = ResponseObserver()
    for i in range(0, len(stream), 7):  # chunks cut anywhere
        obs.feed_sse(stream[i : i + 7])
    assert obs.tokens() == (50, 32) and obs.completion() == "Hello"
    native = ResponseObserver()
    native.feed_sse(b'data: {"text":"a","meta_info":{"prompt_tokens":9,"cached_tokens":4}}\n\n'
                    b'data: {"text":"ab","meta_info":{"prompt_tokens":9,"cached_tokens":4}}\n\ndata: [DONE]\n\n')
    assert native.tokens() == (9, 4) and native.completion() == "ab"
    batch = ResponseObserver()
    batch.feed_json(b'[{"text":"x","meta_info":{"prompt_tokens":5,"cached_tokens":1}},'
                    b'{"text":"y","meta_info":{"prompt_tokens":6,"cached_tokens":2}}]')
    assert batch.tokens() == (11, 3) and batch.completion() == "x"
    chat = ResponseObserver()
    chat.feed_json(b'{"choices":[{"index":0,"message":{"content":"ok"}}],'
                   b'"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}')
    assert chat.tokens() == (3, 0) and chat.completion() == "ok"


def test_token_trees_follow_a_conversation(tiny_model_dir: Path) -> None:
    from router.tokens import RequestTokenizer

    ws = workers(0, 0)
    policy = cache_aware(ws, tree_mode="tokens")
    policy.tokenizer = RequestTokenizer.load(str(tiny_model_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers. " * 5}]
    first_view = RequestView.parse(CHAT, {"messages": msgs})
    first = route(policy, first_view, ws)
    assert first.reason == "load" and first.prompt_units == len(first_view.tokens or [])
    policy.on_finished(first_view, first, True, "The Nile, the Amazon and the Danube.")
    nxt = RequestView.parse(CHAT, {"messages": [*msgs, {"role": "assistant", "content": "The Nile, the Amazon "
                                                        "and the Danube."}, {"role": "user", "content": "More?"}]})
    second = route(policy, nxt, ws)
    assert second.worker is first.worker and second.reason == "cache"
    assert second.match > first.prompt_units  # the answer is matched too
    assert policy.describe(first.worker)["tree_unit"] == "tokens"
