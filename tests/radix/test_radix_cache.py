import pytest
import torch

from radix import (
    CacheMirror,
    KVCacheError,
    NaiveCache,
    PagedAllocator,
    RadixCache,
    ReqToTokenPool,
)


def make(ps=1, cap=64, **kw):
    alloc = PagedAllocator(cap, page_size=ps)
    pool = ReqToTokenPool(8, 256)
    return RadixCache(alloc, pool, **kw), alloc


def cache_seq(cache, tokens, ns=None):
    """Run one request over ``tokens`` and finish it, as the scheduler would."""
    st = cache.new_request(ns)
    cache.assign_prefix(st, cache.match_prefix(tokens, ns, record=False))
    cache.alloc_tokens(st, len(tokens) - st.kv_len)
    cache.cache_finished_req(st, tokens)


def test_match_splits_a_node_and_keeps_accounting():
    cache, alloc = make()
    slots = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], slots) == 0
    assert cache.stats().num_nodes == 1
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.kv_indices.tolist() == slots[:3].tolist()
    assert cache.stats().num_nodes == 2, "the node was split at the mismatch"
    assert m.last_node.num_tokens == 3
    assert cache.evictable_size == 6
    # the lower half is still reachable and intact
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).kv_indices.tolist() == slots.tolist()
    cache.check_integrity()


def test_insert_returns_already_cached_length():
    cache, alloc = make()
    a = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], a) == 0
    b = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], b) == 4
    alloc.free(b[:4])  # the caller frees its duplicates
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).kv_indices.tolist() == a.tolist() + b[4:].tolist()
    cache.check_integrity()


@pytest.mark.parametrize("ps", [4, 16])
def test_pages_only_whole_pages_are_cached_and_matched(ps):
    cache, alloc = make(ps=ps, cap=8 * ps)
    toks = list(range(2 * ps + 3))
    cache_seq(cache, toks)
    assert cache.evictable_size == 2 * ps, "the unaligned tail was freed, not cached"
    m = cache.match_prefix(toks[: 2 * ps - 1] + [999])
    assert m.length == ps, "a partial page never matches"
    cache.check_integrity()


def test_namespaces_never_share():
    cache, alloc = make()
    cache_seq(cache, [1, 2, 3, 4], ns="tenant-a")
    assert cache.match_prefix([1, 2, 3, 4], "tenant-b").length == 0
    assert cache.match_prefix([1, 2, 3, 4]).length == 0
    assert cache.match_prefix([1, 2, 3, 4], "tenant-a").length == 4
    cache_seq(cache, [1, 2, 3, 4], ns="tenant-b")
    a = cache.match_prefix([1, 2, 3, 4], "tenant-a").kv_indices
    b = cache.match_prefix([1, 2, 3, 4], "tenant-b").kv_indices
    assert set(a.tolist()).isdisjoint(b.tolist())
    cache.check_integrity()


def test_lock_moves_sizes_and_blocks_eviction():
    cache, alloc = make()
    cache_seq(cache, [1, 2, 3, 4])
    cache_seq(cache, [1, 2, 7, 8])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.last_node)
    assert cache.protected_size == 4 and cache.evictable_size == 2
    cache.lock(m.last_node)  # second lock: no size change
    assert cache.protected_size == 4
    tail78 = cache.match_prefix([1, 2, 7, 8], record=False).kv_indices[2:].tolist()
    freed = cache.evict(100)
    assert sorted(freed.tolist()) == sorted(tail78), "only the unlocked branch is evicted"
    assert cache.match_prefix([1, 2, 3, 4]).length == 4
    cache.unlock(m.last_node)
    assert cache.protected_size == 4
    cache.unlock(m.last_node)
    assert cache.protected_size == 0 and cache.evictable_size == 4
    with pytest.raises(KVCacheError):
        cache.unlock(m.last_node)


def test_evict_is_lru_over_leaves():
    cache, alloc = make()
    for seq in ([1, 1], [2, 2], [3, 3]):
        cache_seq(cache, seq)
    cache.match_prefix([1, 1])  # touch: [2,2] is now the oldest
    order = [n.key for n in cache.eviction_order()]
    assert len(order) == 3
    m22 = cache.match_prefix([2, 2], record=False).kv_indices.tolist()
    # that match touched [2,2]; now [3,3] is the oldest
    freed = cache.evict(1)
    assert cache.match_prefix([3, 3]).length == 0
    assert cache.match_prefix([2, 2]).kv_indices.tolist() == m22
    assert freed.numel() == 2
    cache.check_integrity()


def test_evict_parent_becomes_leaf():
    cache, alloc = make()
    cache_seq(cache, [1, 2, 3])
    cache_seq(cache, [1, 2, 4])
    assert cache.stats().num_nodes == 3
    cache.evict(10**6)
    assert cache.stats().num_nodes == 0 and cache.evictable_size == 0
    assert alloc.free_size == alloc.capacity


def test_lfu_policy_evicts_least_hit():
    cache, alloc = make(eviction_policy="lfu")
    cache_seq(cache, [1, 1])
    cache_seq(cache, [2, 2])
    for _ in range(3):
        cache.match_prefix([1, 1])
    cache.match_prefix([2, 2])  # most recent, but fewer hits
    cache.evict(1)
    assert cache.match_prefix([2, 2]).length == 0
    assert cache.match_prefix([1, 1]).length == 2


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make(eviction_policy="random")


def test_reset_and_stats():
    cache, alloc = make()
    cache_seq(cache, [1, 2, 3])
    cache.match_prefix([1, 2, 3, 4])
    s = cache.stats()
    assert (s.hit_tokens, s.miss_tokens, s.cached_tokens) == (3, 1, 3)
    assert s.hit_rate == pytest.approx(0.75)
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.last_node)
    with pytest.raises(KVCacheError, match="locked"):
        cache.reset()
    cache.unlock(m.last_node)
    cache.reset()
    assert cache.stats().num_nodes == 0 and alloc.free_size == alloc.capacity


@pytest.mark.parametrize("ps", [1, 4])
def test_events_mirror_equals_tree(ps):
    mirror = CacheMirror()
    events = []

    def sink(ev):
        events.append(ev)
        mirror.apply(ev)

    cache, alloc = make(ps=ps, cap=64 * ps, event_sink=sink)
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12, [1, 2, 3, 4, 5, 6, 0, 0]]
    for i, s in enumerate(seqs):
        cache_seq(cache, s, ns="x" if i == 2 else None)
        assert set(mirror.blocks) == cache.block_hashes()
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9])  # split: no change in blocks
    assert set(mirror.blocks) == cache.block_hashes()
    for s in seqs + [[1, 2, 3, 4, 5, 5, 5, 5]]:
        for ns in (None, "x"):
            assert mirror.match_len(s, ns) == cache.match_prefix(s, ns, record=False).length
    cache.evict(3)
    assert set(mirror.blocks) == cache.block_hashes()
    late = CacheMirror()
    for ev in cache.snapshot_events():
        late.apply(ev)
    assert late.blocks == mirror.blocks, "a consumer joining late catches up from a snapshot"
    cache.reset()
    assert mirror.blocks == {}


def test_event_hashes_are_stable_across_instances():
    hashes = []
    for _ in range(2):
        got = []
        cache, _ = make(event_sink=got.append)
        cache_seq(cache, [4, 5, 6])
        hashes.append(got[0].block_hashes)
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize("ps", [1, 4])
def test_cache_unfinished_req_makes_prefix_shareable(ps):
    cache, alloc = make(ps=ps, cap=32 * ps)
    toks = list(range(3 * ps + 1))
    st = cache.new_request()
    cache.assign_prefix(st, cache.match_prefix(toks))
    cache.alloc_tokens(st, len(toks))
    cache.cache_unfinished_req(st, toks)
    aligned = len(toks) // ps * ps
    assert st.protected_len == aligned
    assert cache.protected_size == aligned
    cache.check_integrity([st])
    # another request now hits the prefix while the first keeps running
    other = cache.new_request()
    cache.assign_prefix(other, cache.match_prefix(toks))
    assert other.protected_len == aligned
    cache.alloc_tokens(st, 2)
    cache.check_integrity([st, other])
    cache.cache_finished_req(st, toks + [7, 7])
    cache.release_req(other)
    cache.check_integrity()
    assert cache.protected_size == 0


def test_concurrent_duplicates_are_freed():
    cache, alloc = make()
    toks = [1, 2, 3, 4, 5]
    a, b = cache.new_request(), cache.new_request()
    for st in (a, b):  # both computed the same prompt before either finished
        cache.assign_prefix(st, cache.match_prefix(toks))
        cache.alloc_tokens(st, 5)
    cache.check_integrity([a, b])
    cache.cache_finished_req(a, toks)
    cache.cache_finished_req(b, toks)
    cache.check_integrity()
    assert cache.evictable_size == 5 and alloc.free_size == alloc.capacity - 5


def test_alloc_tokens_evicts_and_reports_oom():
    cache, alloc = make(cap=8)
    cache_seq(cache, [1, 2, 3, 4, 5, 6])
    st = cache.new_request()
    cache.alloc_tokens(st, 7)  # needs eviction
    assert cache.evictable_size == 0
    cache.check_integrity([st])
    from radix import KVOutOfMemoryError

    with pytest.raises(KVOutOfMemoryError):
        cache.alloc_tokens(st, 2)
    cache.release_req(st)
    cache.check_integrity()


@pytest.mark.parametrize("ps", [1, 4])
def test_decode_allocation_gives_each_row_the_slot_of_a_one_token_allocation(ps):
    """alloc_decode_tokens (one call per decode step) must hand out exactly what alloc_tokens(state, 1) gives
    the rows in turn: mid-page rows their page's next slot, the others fresh pages in order."""
    lens = [0, 3, 4, 7, 1, 8]
    caches, states = [], []
    for _ in range(2):
        cache, _ = make(ps=ps, cap=128)
        rows = [cache.new_request() for _ in lens]
        for st, n in zip(rows, lens):
            cache.alloc_tokens(st, n)
        caches.append(cache)
        states.append(rows)
    for _ in range(6):
        for st in states[0]:
            caches[0].alloc_tokens(st, 1)
        caches[1].alloc_decode_tokens(states[1])
    assert torch.equal(caches[0].req_to_token.table, caches[1].req_to_token.table)
    assert [st.kv_len for st in states[1]] == [n + 6 for n in lens]
    assert caches[1].allocator.free_size == caches[0].allocator.free_size
    caches[1].check_integrity(states[1])


def test_decode_allocation_evicts_and_reports_oom_before_taking_anything():
    from radix import KVOutOfMemoryError

    cache, alloc = make(cap=8)
    cache_seq(cache, [1, 2, 3, 4, 5, 6])
    a, b = cache.new_request(), cache.new_request()
    cache.alloc_tokens(a, 1)
    cache.alloc_tokens(b, 1)
    cache.alloc_decode_tokens([a, b])  # no slot is free: evicts the cached sequence
    assert cache.evictable_size == 0 and a.kv_len == b.kv_len == 2
    cache.alloc_decode_tokens([a, b])
    cache.alloc_decode_tokens([a, b])
    free = alloc.free_size
    assert free == 0
    with pytest.raises(KVOutOfMemoryError):
        cache.alloc_decode_tokens([a, b])
    assert (a.kv_len, b.kv_len, alloc.free_size) == (4, 4, free), "nothing taken by the failed call"
    cache.check_integrity([a, b])
    cache.release_req(a)
    cache.release_req(b)
    cache.check_integrity()


def test_naive_cache_shares_nothing():
    alloc = PagedAllocator(32, 1)
    cache = NaiveCache(alloc, ReqToTokenPool(4, 64))
    st = cache.new_request()
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0
    cache.assign_prefix(st, m)
    cache.alloc_tokens(st, 3)
    cache.cache_unfinished_req(st, [1, 2, 3])
    cache.check_integrity([st])
    cache.cache_finished_req(st, [1, 2, 3])
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert alloc.free_size == 32
    assert cache.insert([1], torch.tensor([5])) == 0
    assert cache.stats().miss_tokens == 6
    cache.check_integrity()
