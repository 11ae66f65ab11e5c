"""RadixCache.snapshot: the dashboard's read-only, aggregated copy of the tree."""

import random

import pytest

from radix import PagedAllocator, RadixCache, ReqToTokenPool


def make(ps=1, cap=4096):
    return RadixCache(PagedAllocator(cap, page_size=ps), ReqToTokenPool(8, 1024)), None


def cache_seq(cache, tokens, ns=None, keep=False):
    """Run one request over ``tokens`` (as the scheduler would); ``keep``: leave it running (locked)."""
    st = cache.new_request(ns)
    cache.assign_prefix(st, cache.match_prefix(tokens, ns))
    cache.alloc_tokens(st, len(tokens) - st.kv_len)
    if keep:
        cache.cache_unfinished_req(st, tokens)
        return st
    cache.cache_finished_req(st, tokens)
    return None


def by_id(snap):
    return {n.id: n for n in snap.nodes}


def check_sums(snap):
    """Every shown node's subtree tokens = its own tokens + its children's subtree tokens."""
    nodes = by_id(snap)
    kids = {}
    for n in snap.nodes:
        if n.parent is not None:
            kids.setdefault(n.parent, []).append(n)
    for n in nodes.values():
        assert n.subtree_tokens == n.tokens + sum(c.subtree_tokens for c in kids.get(n.id, [])), n
    assert nodes[0].subtree_tokens == snap.total_tokens


def test_shared_prefix_is_one_node_with_its_tokens_and_hits():
    cache, _ = make()
    prefix = list(range(100, 140))  # 40 shared tokens
    for q in range(5):
        cache_seq(cache, prefix + [1000 + q] * 3)
    snap = cache.snapshot(max_nodes=100, preview_tokens=8)
    real = [n for n in snap.nodes if n.id > 0]
    assert len(real) == 6 and snap.total_nodes == 6
    shared = next(n for n in real if n.parent == 0)
    assert shared.tokens == 40 and shared.subtree_tokens == 40 + 5 * 3
    assert shared.preview_ids == prefix[:8]
    assert shared.hits == 4, "four requests matched the prefix after the first inserted it"
    assert shared.lock_count == 0 and shared.tier == "device"
    leaves = [n for n in real if n.parent == shared.id]
    assert sorted(n.tokens for n in leaves) == [3] * 5
    assert snap.total_tokens == cache.stats().cached_tokens == 55
    assert snap.clock >= max(n.last_access for n in real)
    check_sums(snap)


def test_locked_nodes_show_their_lock_count():
    cache, _ = make()
    cache_seq(cache, list(range(20)))
    st = cache_seq(cache, list(range(20)) + [99, 98], keep=True)
    snap = cache.snapshot()
    nodes = [n for n in snap.nodes if n.id > 0]
    top = next(n for n in nodes if n.parent == 0)
    assert top.lock_count == 1
    cache.release_req(st)
    assert all(n.lock_count == 0 for n in cache.snapshot().nodes)


def test_aggregation_bounds_the_picture_and_keeps_the_totals():
    cache, _ = make(cap=20000)
    rng = random.Random(0)
    for _ in range(300):
        tail = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        cache_seq(cache, [rng.randrange(4) for _ in range(3)] + tail)
    full = cache.snapshot(max_nodes=100000)
    assert not any(n.aggregated for n in full.nodes)
    assert len(full.nodes) == full.total_nodes + 1
    check_sums(full)
    for limit in (2, 3, 10, 57):
        snap = cache.snapshot(max_nodes=limit)
        assert len(snap.nodes) <= limit
        check_sums(snap)
        assert sum(n.aggregated for n in snap.nodes) + sum(1 for n in snap.nodes if n.id > 0) == full.total_nodes
    # the largest subtrees are the ones shown
    snap = cache.snapshot(max_nodes=10)
    shown = {n.id for n in snap.nodes if n.id > 0}
    biggest = sorted((n for n in full.nodes if n.parent == 0), key=lambda n: -n.subtree_tokens)[:2]
    assert {n.id for n in biggest} <= shown


def test_min_tokens_folds_small_subtrees():
    cache, _ = make()
    cache_seq(cache, list(range(50)))
    for i in range(10):
        cache_seq(cache, [500 + i, 1])
    snap = cache.snapshot(min_tokens=10)
    real = [n for n in snap.nodes if n.id > 0]
    assert [n.tokens for n in real] == [50]
    agg = [n for n in snap.nodes if n.aggregated]
    assert len(agg) == 1 and agg[0].tokens == 20 and agg[0].aggregated == 10
    check_sums(snap)


def test_namespaces_are_separate_subtrees_without_the_salt():
    cache, _ = make()
    cache_seq(cache, list(range(10)))
    cache_seq(cache, list(range(10)), ns="secret-salt")
    snap = cache.snapshot()
    ns_nodes = [n for n in snap.nodes if n.label and n.label.startswith("namespace")]
    assert len(ns_nodes) == 1 and "secret" not in ns_nodes[0].label
    assert ns_nodes[0].subtree_tokens == 10 and ns_nodes[0].lock_count == 0
    assert snap.total_tokens == 20 and snap.total_nodes == 2
    check_sums(snap)


def test_pages_and_empty_tree():
    cache, _ = make(ps=4)
    assert cache.snapshot().to_json()["nodes"] == [
        {"id": 0, "parent": None, "tokens": 0, "subtree_tokens": 0, "hits": 0, "last_access": 0,
         "lock_count": 0, "preview_ids": [], "aggregated": 0, "label": "cache", "tier": "device"}]
    cache_seq(cache, list(range(10)))
    (node,) = [n for n in cache.snapshot().nodes if n.id > 0]
    assert node.tokens == 8, "only whole pages are cached"
    with pytest.raises(ValueError, match="max_nodes"):
        cache.snapshot(max_nodes=1)


def test_snapshot_does_not_change_the_tree():
    cache, _ = make()
    for i in range(20):
        cache_seq(cache, [i % 3] * 5 + [i] * 4)
    before = (cache.stats(), [n.node_id for n in cache.eviction_order()])
    cache.snapshot(max_nodes=5)
    cache.snapshot(max_nodes=1000, min_tokens=3)
    assert (cache.stats(), [n.node_id for n in cache.eviction_order()]) == before
    cache.check_integrity()


def test_large_tree_is_shown_within_its_node_budget():
    """10k+ nodes: the dashboard gets at most ``max_nodes`` of them, with totals that still count the whole tree.
    (What a poll costs the server is measured by benchmarks/bench_dashboard.py, not asserted here.)"""
    cache, _ = make(cap=200_000)
    rng = random.Random(1)
    for _ in range(10_000):
        cache_seq(cache, [rng.randrange(30), rng.randrange(30), rng.randrange(1000)] + [7] * 5)
    stats = cache.stats()
    assert stats.num_nodes > 10_000
    snap = cache.snapshot(max_nodes=500)
    assert len(snap.nodes) <= 500
    check_sums(snap)
    assert snap.total_nodes == stats.num_nodes
    assert snap.total_tokens == stats.cached_tokens
