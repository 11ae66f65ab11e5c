"""Random operation sequences on RadixCache, checked against a plain reference model after every step.

The reference knows which page-aligned prefixes are cached, when each was last used and which are
locked; it learns *which* node an eviction removed from the freed slots (every slot carries the identity
of the prefix whose KV it holds) and then checks that the choice was allowed: an unlocked leaf, and the
least recently used one.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radix import KVOutOfMemoryError, NaiveCache, PagedAllocator, PrefixCache, RadixCache, ReqKV, ReqToTokenPool

PAGES = 20
NAMESPACES = [None, "ns-b"]


class RecordingAllocator(PagedAllocator):
    """Logs every free() call, so the test can see each evicted node."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[list[int]] = []

    def free(self, slots):
        super().free(slots)
        self.log.append(slots.tolist())


class Running:
    def __init__(self, state: ReqKV, tokens: list[int], locked: tuple):
        self.state = state
        self.tokens = tokens  # tokens whose KV the request holds
        self.locked = locked  # (ns, prefix) it keeps locked


class CacheMachine(RuleBasedStateMachine):
    page_size = 1

    def make_cache(self, alloc: PagedAllocator, pool: ReqToTokenPool) -> PrefixCache:
        """The cache under test (test_reference_sanity swaps in broken ones)."""
        return RadixCache(alloc, pool)

    @initialize()
    def setup(self):
        ps = self.page_size
        self.alloc = RecordingAllocator(PAGES * ps, page_size=ps)
        self.cache = self.make_cache(self.alloc, ReqToTokenPool(16, 256))
        self.evictions_checked = 0  # evictions whose choice of node the reference verified
        self.content: dict[int, tuple] = {}  # slot -> (ns, prefix) whose KV it holds
        self.cached: dict[tuple, int] = {}  # (ns, page-aligned prefix) -> slot of its last token
        self.access: dict[tuple, int] = {}  # (ns, prefix) -> logical time of last use
        self.clock = 0
        self.running: list[Running] = []

    # ------------------------------------------------------------------ reference helpers
    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def aligned_prefixes(self, ns, tokens, upto):
        ps = self.page_size
        return [(ns, tuple(tokens[:k])) for k in range(ps, upto + 1, ps)]

    def ref_match_len(self, ns, tokens):
        n = 0
        for p in self.aligned_prefixes(ns, tokens, len(tokens)):
            if p not in self.cached:
                break
            n = len(p[1])
        return n

    def touch(self, ns, tokens, upto):
        t = self.tick()
        for p in self.aligned_prefixes(ns, tokens, upto):
            self.access[p] = t

    def locked_prefixes(self):
        out = set()
        for r in self.running:
            ns, pre = r.locked
            out.update(self.aligned_prefixes(ns, list(pre), len(pre)))
        return out

    def evictable_leaves(self):
        locked = self.locked_prefixes()
        keys = set(self.cached)
        leaves = []
        for p in keys:
            ns, pre = p
            has_child = any(
                q[0] == ns and len(q[1]) == len(pre) + self.page_size and q[1][: len(pre)] == pre
                for q in keys
            )
            if not has_child and p not in locked:
                leaves.append(p)
        return leaves

    def absorb_frees(self):
        """Apply the allocator's free log: frees of cached slots are evictions, checked for LRU order."""
        for chunk in self.alloc.log:
            ids = {self.content[s] for s in chunk if s in self.content}
            cached = [
                p
                for p in ids
                if self.cached.get(p) is not None
                and self.content[self.cached[p]] == p
                and self.cached[p] in chunk
            ]
            if not cached:
                continue
            deepest = max(cached, key=lambda p: len(p[1]))
            leaves = self.evictable_leaves()
            assert deepest in leaves, f"evicted {deepest} which is not an unlocked leaf"
            oldest = min(self.access[p] for p in leaves)
            assert self.access[deepest] == oldest, "eviction did not take the least recently used leaf"
            self.evictions_checked += 1
            for p in cached:
                del self.cached[p]
        self.alloc.log.clear()

    def load_host(self, m, ns, tokens, expect):
        """A tiered cache brings host-resident nodes after the device match back here (see the host-tier
        machine); a device-only cache has none."""
        return m, expect

    def write_content(self, st: ReqKV, ns, tokens, start):
        slots = self.cache.req_to_token.read(st.row, start, len(tokens)).tolist()
        for i, s in enumerate(slots, start):
            self.content[s] = (ns, tuple(tokens[: i + 1]))

    def record_insert(self, ns, tokens, n):
        ps = self.page_size
        aligned = n // ps * ps
        slots = self.cache.match_prefix(tokens[:aligned], ns, record=False).kv_indices.tolist()
        assert len(slots) == aligned
        for k in range(ps, aligned + 1, ps):
            self.cached[(ns, tuple(tokens[:k]))] = slots[k - 1]
        self.touch(ns, tokens, aligned)

    # ------------------------------------------------------------------ rules
    tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=40)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def start_request(self, ns, tokens):
        if self.cache.req_to_token.available == 0:
            return
        m = self.cache.match_prefix(tokens, ns)
        expect = self.ref_match_len(ns, tokens)
        assert m.length == expect
        m, expect = self.load_host(m, ns, tokens, expect)
        for i, s in enumerate(m.kv_indices.tolist()):
            assert self.content[s] == (ns, tuple(tokens[: i + 1])), "matched slot holds someone else's KV"
        self.touch(ns, tokens, expect)
        state = self.cache.new_request(ns)
        self.cache.assign_prefix(state, m)
        self.running.append(Running(state, tokens[:expect], (ns, tuple(tokens[:expect]))))
        self._extend(self.running[-1], tokens[expect:])

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def start_twins(self, ns, tokens):
        """Two requests with the same prompt admitted together: both compute it, one copy is a duplicate."""
        if self.cache.req_to_token.available < 2:
            return
        expect = self.ref_match_len(ns, tokens)
        twins = []
        for _ in range(2):
            m = self.cache.match_prefix(tokens, ns)
            assert m.length == expect
            state = self.cache.new_request(ns)
            self.cache.assign_prefix(state, m)
            twins.append(Running(state, tokens[:expect], (ns, tuple(tokens[:expect]))))
        self.touch(ns, tokens, expect)
        self.running.extend(twins)
        for r in twins:
            self._extend(r, tokens[expect:])

    def _extend(self, r: Running, new):
        if not new:
            return
        need = self.cache.allocator.pages_for(r.state.kv_len + len(new)) - self.cache.allocator.pages_for(
            r.state.kv_len
        )
        if need * self.page_size > self.cache.available_size:
            with pytest.raises(KVOutOfMemoryError):
                self.cache.alloc_tokens(r.state, len(new))
            self.absorb_frees()
            return
        start = r.state.kv_len
        self.cache.alloc_tokens(r.state, len(new))
        self.absorb_frees()
        r.tokens = r.tokens + list(new)
        self.write_content(r.state, r.state.namespace, r.tokens, start)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 15), new=tokens_st)
    def extend(self, i, new):
        self._extend(self.running[i % len(self.running)], new[:8])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 15))
    def cache_unfinished(self, i):
        r = self.running[i % len(self.running)]
        ns = r.state.namespace
        self.cache.cache_unfinished_req(r.state, r.tokens)
        self.absorb_frees()
        if len(r.tokens) >= self.page_size:
            self.record_insert(ns, r.tokens, len(r.tokens))
            aligned = len(r.tokens) // self.page_size * self.page_size
            r.locked = (ns, tuple(r.tokens[:aligned])) if aligned > len(r.locked[1]) else r.locked
        # the row now points at the cache's slots for the shared part
        self.write_content(r.state, ns, r.tokens, 0)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 15))
    def finish(self, i):
        r = self.running.pop(i % len(self.running))
        ns = r.state.namespace
        self.cache.cache_finished_req(r.state, r.tokens)
        self.absorb_frees()
        if len(r.tokens) >= self.page_size:
            self.record_insert(ns, r.tokens, len(r.tokens))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 15))
    def release(self, i):
        r = self.running.pop(i % len(self.running))
        self.cache.release_req(r.state)
        self.absorb_frees()

    @rule(n=st.integers(1, 3 * 16))
    def evict(self, n):
        before = self.alloc.free_size
        self.cache.evict(n)
        self.absorb_frees()
        freed = self.alloc.free_size - before
        assert freed >= min(n, 1) or not self.evictable_leaves()

    @rule()
    def evict_one_node(self):
        self.cache.evict(1)
        self.absorb_frees()

    @precondition(lambda self: not self.running)
    @rule()
    def flush(self):
        self.cache.reset()
        self.alloc.log.clear()
        self.cached.clear()
        assert self.alloc.free_size == self.alloc.capacity

    # ------------------------------------------------------------------ invariants
    @invariant()
    def books_balance(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity([r.state for r in self.running])
        cached_tokens = self.cache.evictable_size + self.cache.protected_size
        assert cached_tokens == len(self.cached) * self.page_size
        assert self.cache.protected_size == len(self.locked_prefixes() & set(self.cached)) * self.page_size

    @invariant()
    def locked_prefixes_stay_cached(self):
        if not hasattr(self, "cache"):
            return
        for p in self.locked_prefixes():
            assert p in self.cached, f"locked prefix {p} was evicted"


def make_case(ps: int):
    cls = type(f"CacheMachinePs{ps}", (CacheMachine,), {"page_size": ps})
    case = cls.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    return case


TestPageSize1 = make_case(1)
TestPageSize4 = make_case(4)
TestPageSize16 = make_case(16)


class LFUCacheMachine(CacheMachine):
    """The LRU reference over a cache that evicts the least *frequently* used leaf instead."""

    def make_cache(self, alloc: PagedAllocator, pool: ReqToTokenPool) -> PrefixCache:
        return RadixCache(alloc, pool, eviction_policy="lfu")


class NaiveCacheMachine(CacheMachine):
    """The reference over a cache that never keeps anything."""

    def make_cache(self, alloc: PagedAllocator, pool: ReqToTokenPool) -> PrefixCache:
        return NaiveCache(alloc, pool)


def scripted_run(machine: CacheMachine) -> CacheMachine:
    """A fixed sequence of rules: prompt A is used three times, then B once, then one leaf is evicted.
    A is the least recently used leaf (LRU evicts it); B the least frequently used (LFU would evict it)."""
    a, b = [0, 0, 0, 0], [1, 1, 1, 1]
    machine.setup()
    for tokens in (a, a, a, b):
        machine.start_request(None, tokens)
        machine.books_balance()
        machine.finish(0)
        machine.books_balance()
        machine.locked_prefixes_stay_cached()
    machine.evict(4)
    machine.books_balance()
    return machine


def test_reference_sanity():
    """The reference catches what it is there to catch: the real cache passes a scripted run in which an
    eviction is checked; a cache evicting the wrong leaf, and one that forgets what it cached, fail it."""
    good = scripted_run(CacheMachine())
    assert good.evictions_checked == 1
    assert (None, (0, 0, 0, 0)) not in good.cached and (None, (1, 1, 1, 1)) in good.cached
    assert good.cache.match_prefix([1, 1, 1, 1], record=False).length == 4
    with pytest.raises(AssertionError, match="least recently used"):
        scripted_run(LFUCacheMachine())
    with pytest.raises(AssertionError):
        scripted_run(NaiveCacheMachine())
