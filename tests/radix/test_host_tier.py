"""The host-memory tier: HostKVPool copies and HierarchicalRadixCache scenarios, with real K/V tensors.

Every token's K/V is a pseudo-random function of its prefix (``kv_for``), written into the device storage
when a request computes it, so a load back can be compared bit for bit with what was computed.
"""

from __future__ import annotations

import pytest
import torch

from radix import (
    BlocksRemoved,
    CacheMirror,
    KVCacheError,
    KVOutOfMemoryError,
    KVShape,
    KVStorage,
    PagedAllocator,
    ReqToTokenPool,
)
from radix.hierarchical_cache import HierarchicalRadixCache
from radix.host_pool import HostKVPool, host_capacity_tokens

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=4)


def kv_for(tokens: list[int], start: int, n: int, shape: KVShape = SHAPE) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, n, heads, dim]`` of positions ``start..start+n`` of ``tokens`` (a function of the prefix)."""
    if n == 0:
        empty = torch.empty((shape.num_layers, 0, shape.num_kv_heads, shape.head_dim), dtype=shape.dtype)
        return empty, empty
    ks, vs = [], []
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(hash(tuple(tokens[: i + 1])) % (2**31))
        kv = torch.randn((2, shape.num_layers, shape.num_kv_heads, shape.head_dim), generator=g)
        ks.append(kv[0].to(shape.dtype))
        vs.append(kv[1].to(shape.dtype))
    return torch.stack(ks, 1), torch.stack(vs, 1)


def make(ps=4, dev_pages=5, host_pages=8, policy="write_back", events=None, lower=None):
    alloc = PagedAllocator(dev_pages * ps, page_size=ps)
    kv = KVStorage(SHAPE, alloc.total_slots, ps)
    host = HostKVPool.for_device(kv, host_pages * ps)
    return HierarchicalRadixCache(
        alloc, ReqToTokenPool(8, 256), kv, host, policy, event_sink=events, lower_tier=lower
    )


def start(cache, tokens, ns=None):
    """Admit a request as the scheduler would: match, load back what is on the host, record the lookup
    (which attributes the loaded tokens to the host tier), lock, compute."""
    m = cache.match_prefix(tokens, ns, record=False)
    loaded = 0
    if m.host_len:
        lb = cache.load_back(m)
        lb.handle.wait()
        loaded = lb.slots.numel()
        m = lb.match
    cache.record_lookup(m.length, len(tokens))
    st = cache.new_request(ns)
    cache.assign_prefix(st, m)
    k, v = kv_for(tokens, 0, m.length)
    assert torch.equal(cache.device_kv.k_buffer[:, m.kv_indices], k), "cached K is not what was computed"
    assert torch.equal(cache.device_kv.v_buffer[:, m.kv_indices], v)
    slots = cache.alloc_tokens(st, len(tokens) - m.length)
    k, v = kv_for(tokens, m.length, len(slots))
    cache.device_kv.k_buffer[:, slots] = k
    cache.device_kv.v_buffer[:, slots] = v
    cache.check_integrity([st])
    return st, m.length, loaded


def run(cache, tokens, ns=None):
    st, hit, loaded = start(cache, tokens, ns)
    cache.cache_finished_req(st, tokens)
    cache.check_integrity()
    return hit, loaded


def tiers(cache, tokens, ns=None):
    """Tier of each node on the path of ``tokens``, top-down (a match with record=False)."""
    m = cache.match_prefix(tokens, ns, record=False)
    node, out = m.last_node, []
    while node.parent is not None:
        out.append(node.tier)
        node = node.parent
    return out[::-1] + [n.tier for n in m.host_nodes]


# ---------------------------------------------------------------------- the pool
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_round_trip_is_bit_exact(dtype):
    shape = KVShape(num_layers=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    dev = KVStorage(shape, 64, page_size=4)
    g = torch.Generator().manual_seed(0)
    dev.k_buffer.copy_(torch.randn(dev.k_buffer.shape, generator=g).to(dtype))
    dev.v_buffer.copy_(torch.randn(dev.v_buffer.shape, generator=g).to(dtype))
    src = torch.arange(20, 32)
    want_k, want_v = dev.k_buffer[:, src].clone(), dev.v_buffer[:, src].clone()
    pool = HostKVPool.for_device(dev, 32)
    host_slots, handle = pool.backup(dev, src)
    handle.wait()
    assert handle.done() and host_slots.numel() == 12 and pool.free_size == 32 - 12
    dev.k_buffer.zero_()
    dev.v_buffer.zero_()
    dst = torch.arange(40, 52)
    pool.restore(host_slots, dev, dst).wait()
    for layer in range(shape.num_layers):  # compare the bits, not the values (-0.0, NaN payloads)
        assert torch.equal(dev.k(layer)[dst].view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want_k[layer].view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.equal(dev.v_buffer[:, dst], want_v)
    pool.free(host_slots)
    assert pool.free_size == pool.capacity


def test_pool_full_and_mismatched_storage_are_refused():
    dev = KVStorage(SHAPE, 32, page_size=4)
    pool = HostKVPool.for_device(dev, 8)
    pool.backup(dev, torch.arange(4, 12))
    with pytest.raises(KVOutOfMemoryError):
        pool.backup(dev, torch.arange(12, 16))
    other = KVStorage(KVShape(3, 2, 8), 32, page_size=4)
    with pytest.raises(ValueError, match="does not match"):
        pool.restore(torch.arange(4, 8), other, torch.arange(4, 8))


def test_host_capacity_from_ratio_or_bytes():
    assert host_capacity_tokens(100, 4, SHAPE, ratio=2.5) == 248
    per_page = SHAPE.bytes_per_token * 4
    assert host_capacity_tokens(100, 4, SHAPE, size_bytes=11 * per_page) == 40  # one page is reserved
    with pytest.raises(ValueError):
        host_capacity_tokens(100, 4, SHAPE)


# ---------------------------------------------------------------------- the tiered cache
A, B, C = [1] * 12, [2] * 12, [3] * 12


@pytest.mark.parametrize("ps", [1, 4])
def test_evicted_prefix_goes_to_host_and_loads_back_bit_exactly(ps):
    cache = make(ps=ps, dev_pages=20 // ps, host_pages=32 // ps)
    run(cache, A)
    run(cache, B)  # 20 device tokens: A (12) is evicted to make room for B
    assert tiers(cache, A) == ["host"]
    m = cache.match_prefix(A, record=False)
    assert (m.length, m.host_len) == (0, 12)
    assert cache.stats().host_only_tokens == 12 and cache.evictable_size == 12
    hit, loaded = run(cache, A + [9])  # start() checks the loaded K/V against kv_for bit for bit
    assert (hit, loaded) == (12, 12)
    assert tiers(cache, A) == ["device+host"] and tiers(cache, B) == ["host"]
    s = cache.stats()
    assert s.host_hit_tokens == 12 and s.bytes_to_device == 12 * SHAPE.bytes_per_token


def test_hits_are_counted_for_the_tier_they_came_from_when_the_lookup_is_recorded():
    """A load whose request is not admitted moves KV but serves no hit: when the request comes back its prefix
    is on the device. A recorded admission that loads is a host hit. The tiers always add up to the hits."""
    bpt = SHAPE.bytes_per_token
    cache = make(ps=4, dev_pages=5, host_pages=8)
    run(cache, A)
    run(cache, B)  # A goes to the host
    m = cache.load_to_device(cache.match_prefix(A, record=False), A)  # admission refused: nothing recorded
    assert m.length == 12 and tiers(cache, A) == ["device+host"]
    s = cache.stats()
    assert s.host_hit_tokens == 0 and s.host_loads == 1 and s.bytes_to_device == 12 * bpt
    m = cache.load_to_device(cache.match_prefix(A + [9], record=False), A + [9])  # it comes back: on the device
    cache.record_lookup(m.length, 13)
    s = cache.stats()
    assert (s.hit_tokens, s.device_hit_tokens, s.host_hit_tokens, s.host_loads) == (12, 12, 0, 1)
    run(cache, C)  # A (least recently used on the device) goes to the host again
    assert tiers(cache, A) == ["host"]
    m = cache.load_to_device(cache.match_prefix(A + [9], record=False), A + [9])
    cache.record_lookup(m.length, 13)
    cache.match_prefix(A, record=True)  # a recorded lookup that loads nothing is all device
    s = cache.stats()
    assert (s.hit_tokens, s.device_hit_tokens, s.host_hit_tokens, s.host_loads) == (36, 24, 12, 2)
    assert s.host_load_seconds > 0 and s.bytes_to_device == 24 * bpt
    cache.check_integrity()


def test_write_through_copies_on_insert_write_back_on_eviction():
    bpt = SHAPE.bytes_per_token
    wt, wb = make(policy="write_through"), make(policy="write_back")
    for cache in (wt, wb):
        run(cache, A)
    assert tiers(wt, A) == ["device+host"] and wt.stats().bytes_to_host == 12 * bpt
    assert tiers(wb, A) == ["device"] and wb.stats().bytes_to_host == 0 and wb.stats().host_tokens == 0
    for cache in (wt, wb):
        run(cache, B)  # evicts A in both
        assert tiers(cache, A) == ["host"]
    assert wt.stats().bytes_to_host == 24 * bpt, "write_through copied B on insert, nothing more on eviction"
    assert wb.stats().bytes_to_host == 12 * bpt, "write_back copied A when it was evicted"
    assert tiers(wt, B) == ["device+host"] and tiers(wb, B) == ["device"]


def test_host_pressure_drops_the_least_recently_used_host_only_leaf():
    dropped = []

    class Lower:
        def on_host_evict(self, node, hashes, host_slots, pool):
            dropped.append((node.tier, list(hashes), pool.k_buffer[:, host_slots].clone()))

    mirror = CacheMirror()
    events = []

    def sink(ev):
        events.append(ev)
        mirror.apply(ev)

    cache = make(dev_pages=3, host_pages=6, events=sink, lower=Lower())  # device 12 tokens, host 24
    a_blocks = None
    for tokens in (A, B, C):  # each evicts the previous one to the host
        run(cache, tokens)
        if tokens is A:
            a_blocks = sorted(cache.block_hashes())
        assert mirror.blocks.keys() == cache.block_hashes()
    assert tiers(cache, A) == tiers(cache, B) == ["host"]
    assert not any(isinstance(e, BlocksRemoved) for e in events), "moving to the host removes no block"
    run(cache, [4] * 12)  # C goes to the host too: no room for 3 host-only nodes, A (the oldest) is dropped
    assert len(dropped) == 1
    tier, hashes, kv = dropped[0]
    assert tier == "host" and sorted(hashes) == a_blocks
    assert torch.equal(kv, kv_for(A, 0, 12)[0]), "the lower tier sees the node's own K"
    assert [e.block_hashes for e in events if isinstance(e, BlocksRemoved)] == [hashes]
    assert mirror.blocks.keys() == cache.block_hashes()
    assert cache.match_prefix(A, record=False).host_len == 0
    assert tiers(cache, B) == tiers(cache, C) == ["host"]
    assert cache.stats().host_evicted_tokens == 12


def test_locked_nodes_never_lose_their_device_copy():
    cache = make(dev_pages=5, host_pages=8)  # 20 device tokens
    run(cache, A)
    st, hit, _ = start(cache, A + [7] * 4)  # A locked by a running request
    assert hit == 12
    with pytest.raises(KVOutOfMemoryError):
        start(cache, B)  # 12 more do not fit beside the 16 held: A is not evicted for them
    assert tiers(cache, A) == ["device"] and cache.stats().host_tokens == 0
    assert cache.evict(100).numel() == 0
    cache.check_integrity([st])
    cache.cache_finished_req(st, A + [7] * 4)
    cache.check_integrity()


def test_load_back_without_room_raises_and_keeps_the_host_copy():
    cache = make(dev_pages=5, host_pages=8)
    run(cache, A)
    run(cache, B)
    st, _, _ = start(cache, B + [5] * 4)  # B locked: 16 of 20 device tokens held
    m = cache.match_prefix(A, record=False)
    with pytest.raises(KVOutOfMemoryError):
        cache.load_back(m)
    assert tiers(cache, A) == ["host"]
    cache.check_integrity([st])
    with pytest.raises(KVCacheError, match="host only"):
        cache.lock(m.host_nodes[0])
    cache.release_req(st)
    cache.match_prefix(A[:4] + [0], record=False)  # splits A's node: the old match is stale
    with pytest.raises(KVCacheError, match="stale"):
        cache.load_back(m)
    cache.check_integrity()


def test_split_host_node_loads_only_the_matched_pages():
    cache = make(dev_pages=5, host_pages=8)
    run(cache, A)
    run(cache, B)
    hit, loaded = run(cache, A[:8] + [6] * 4)
    assert (hit, loaded) == (8, 8)
    assert tiers(cache, A) == ["device+host", "host"]
    cache.check_integrity()


def test_insert_through_host_nodes_adopts_the_request_slots():
    """A request that recomputed a host-resident prefix (not loaded back) hands its slots to those nodes."""
    cache = make(dev_pages=5, host_pages=8)
    run(cache, A)
    run(cache, B)
    st = cache.new_request()
    m = cache.match_prefix(A, record=False)
    cache.assign_prefix(st, m)  # the device part only: nothing
    slots = cache.alloc_tokens(st, 16)  # evicts B to the host
    cache.device_kv.k_buffer[:, slots] = kv_for(A + [8] * 4, 0, 16)[0]
    cache.device_kv.v_buffer[:, slots] = kv_for(A + [8] * 4, 0, 16)[1]
    cache.cache_finished_req(st, A + [8] * 4)
    assert tiers(cache, A + [8] * 4) == ["device+host", "device"]
    assert cache.match_prefix(A, record=False).kv_indices.tolist() == slots[:12].tolist()
    cache.check_integrity()


def test_flush_empties_both_tiers():
    cache = make(policy="write_through")
    for tokens in (A, B, C):
        run(cache, tokens)
    assert cache.stats().host_tokens > 0
    cache.reset()
    s = cache.stats()
    assert s.host_tokens == 0 and s.host_only_tokens == 0 and cache.allocator.free_size == cache.allocator.capacity
    cache.check_integrity()


def test_integrity_check_catches_a_leaked_host_page():
    cache = make()
    run(cache, A)
    run(cache, B)
    cache.host_pool.allocator.alloc(4)  # taken by nobody the cache knows of
    with pytest.raises(Exception, match="host"):
        cache.check_integrity()


def test_snapshot_names_each_node_tier():
    cache = make(policy="write_through")
    run(cache, A)
    run(cache, B)
    by_preview = {tuple(n.preview_ids[:1]): n.tier for n in cache.snapshot().nodes if n.preview_ids}
    assert by_preview == {(1,): "host", (2,): "device+host"}
