"""FlashInfer planning (index construction) on CPU: the CSR page tables equal the obvious loop, describe
exactly the KV the torch_native oracle attends over, and pad correctly for CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.kv_storage import KVShape, KVStorage
from runtime.attention.base import AttentionShape
from runtime.attention.flashinfer_plan import (
    build_paged_kv_index,
    indptr_from_lens,
    last_page_lens,
    pad_plan,
    plan_batch,
    plan_prefix,
    reference_page_indices,
)
from runtime.attention.torch_native import TorchNativeBackend
from runtime.core.forward_batch import build_forward_batch


def grow_requests(page_size: int, lens: list[int], seed: int = 0, capacity: int = 4096,
                  shared_prefix_pages: int = 0) -> tuple[PagedAllocator, ReqToTokenPool, list[int]]:
    """Requests grown a few tokens at a time, interleaved (so their pages are scattered in the pool), the
    way the scheduler allocates; the first ``shared_prefix_pages`` pages of every row after the first are
    the first row's (a cache hit)."""
    rng = random.Random(seed)
    alloc = PagedAllocator(capacity, page_size)
    table = ReqToTokenPool(len(lens) + 2, max(lens, default=1) + 16)
    rows = [table.alloc() for _ in lens]
    cur = [0] * len(lens)
    shared = shared_prefix_pages * page_size
    if shared and len(lens) > 1:
        first = alloc.alloc(shared)
        for r, n in zip(rows, lens):
            assert n >= shared
            table.write(r, 0, first)
        cur = [shared] * len(lens)
    while any(c < n for c, n in zip(cur, lens)):
        i = rng.randrange(len(lens))
        if cur[i] >= lens[i]:
            continue
        step = min(lens[i] - cur[i], rng.choice([1, 1, 3, page_size, 2 * page_size + 1]))
        last = int(table.table[rows[i], cur[i] - 1]) if cur[i] else 0
        slots = alloc.alloc_extend(cur[i], last, step)
        table.write(rows[i], cur[i], slots)
        cur[i] += step
    return alloc, table, rows


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_indices_equal_the_loop_and_positions_sit_at_their_page_offset(page_size):
    lens = [1, page_size, page_size + 1, 3 * page_size - 1, 50, 77]
    _alloc, table, rows = grow_requests(page_size, lens)
    idx = build_paged_kv_index(table.table, torch.tensor(rows), lens, page_size)
    ref = reference_page_indices(table.table, rows, lens, page_size)
    flat = [p for r in ref for p in r]
    assert idx.kv_indices.tolist() == flat
    assert idx.kv_indices.dtype == torch.int32 and idx.kv_indptr.dtype == torch.int32
    assert idx.kv_indptr.tolist() == [0, *list(torch.tensor([len(r) for r in ref]).cumsum(0).tolist())]
    for b, (row, n) in enumerate(zip(rows, lens)):
        pages = idx.kv_indices[idx.kv_indptr[b] : idx.kv_indptr[b + 1]].tolist()
        # the layout FlashInfer assumes: position p is slot pages[p // ps] * ps + p % ps
        for p in range(n):
            assert int(table.table[row, p]) == pages[p // page_size] * page_size + p % page_size
        last = int(idx.kv_last_page_len[b])
        assert 1 <= last <= page_size and (len(pages) - 1) * page_size + last == n
        assert 0 not in pages  # page 0 is reserved


def test_shared_prefix_pages_appear_in_every_request():
    ps = 16
    lens = [40, 33, 64]
    _alloc, table, rows = grow_requests(ps, lens, shared_prefix_pages=2)
    idx = build_paged_kv_index(table.table, torch.tensor(rows), lens, ps)
    per_req = [idx.kv_indices[idx.kv_indptr[b] : idx.kv_indptr[b + 1]].tolist() for b in range(3)]
    assert per_req[0][:2] == per_req[1][:2] == per_req[2][:2]


def test_lengths_helpers():
    lens = torch.tensor([0, 1, 15, 16, 17, 32])
    assert last_page_lens(lens, 16).tolist() == [0, 1, 15, 16, 1, 16]
    assert last_page_lens(lens, 1).tolist() == [0, 1, 1, 1, 1, 1]
    assert indptr_from_lens(torch.tensor([2, 0, 3])).tolist() == [0, 2, 2, 5]
    empty = build_paged_kv_index(torch.zeros(2, 8, dtype=torch.int64), torch.tensor([], dtype=torch.int64), [], 4)
    assert empty.kv_indptr.tolist() == [0] and empty.num_pages == 0


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 16]), st.lists(st.integers(1, 70), min_size=1, max_size=9), st.integers(0, 99))
def test_property_indices_match_reference(page_size, lens, seed):
    _alloc, table, rows = grow_requests(page_size, lens, seed=seed)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)  # the batch order need not be the row order
    rows_b = [rows[i] for i in order]
    lens_b = [lens[i] for i in order]
    idx = build_paged_kv_index(table.table, torch.tensor(rows_b), lens_b, page_size)
    assert idx.kv_indices.tolist() == [p for r in reference_page_indices(table.table, rows_b, lens_b, page_size)
                                       for p in r]


def test_pad_plan_for_cuda_graphs():
    ps = 16
    lens = [5, 20]
    _alloc, table, rows = grow_requests(ps, lens)
    kv = KVStorage(KVShape(1, 1, 4), 4096 + ps, ps)
    out = torch.tensor([int(table.table[r, n - 1]) for r, n in zip(rows, lens)])
    fb = build_forward_batch([[7], [8]], [n - 1 for n in lens], rows, out, kv, table.table)
    plan = plan_batch(fb)
    assert plan.is_decode and plan.qo_indptr.tolist() == [0, 1, 2]
    padded = pad_plan(plan, 5)
    assert padded.batch_size == 5 and padded.qo_indptr.tolist() == [0, 1, 2, 3, 4, 5]
    n_real = plan.kv.num_pages
    assert padded.kv.kv_indptr.tolist() == plan.kv.kv_indptr.tolist() + [n_real + 1, n_real + 2, n_real + 3]
    assert padded.kv.kv_indices.tolist()[n_real:] == [0, 0, 0]
    assert padded.kv.kv_last_page_len.tolist()[2:] == [1, 1, 1]
    assert pad_plan(plan, 2) is plan
    with pytest.raises(ValueError):
        pad_plan(plan, 1)


# ---------------------------------------------------------------------- semantics against the oracle
def paged_attention_from_plan(q, kv, layer, plan, shape: AttentionShape) -> torch.Tensor:
    """What FlashInfer computes from a plan, in plain torch: for request b, queries qo_indptr[b]:.. attend
    over the tokens of pages kv_indices[kv_indptr[b]:..] (the last one filled to kv_last_page_len), with
    a causal mask that aligns the queries to the end of the KV."""
    k_pages, v_pages = kv.paged_view(layer)
    ps = kv.page_size
    g = shape.num_heads // shape.num_kv_heads
    out = torch.empty_like(q)
    qo, ip, idx, last = plan.qo_indptr, plan.kv.kv_indptr, plan.kv.kv_indices, plan.kv.kv_last_page_len
    for b in range(plan.batch_size):
        pages = idx[ip[b] : ip[b + 1]].long()
        n = (len(pages) - 1) * ps + int(last[b])
        k = k_pages[pages].reshape(-1, shape.num_kv_heads, shape.head_dim)[:n]
        v = v_pages[pages].reshape(-1, shape.num_kv_heads, shape.head_dim)[:n]
        qb = q[qo[b] : qo[b + 1]]
        e = qb.shape[0]
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        scores = torch.einsum("ehd,hnd->hen", qb.double(), k.double()) * shape.scale
        qpos = torch.arange(n - e, n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
        out[qo[b] : qo[b + 1]] = torch.einsum("hen,hnd->ehd", scores.softmax(-1), v.double()).to(q.dtype)
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_plan_describes_the_kv_torch_native_attends(page_size):
    """Mixed prefill/decode batch over cached prefixes, GQA: attention computed from the plan equals the
    torch_native backend's — the check the GPU test repeats against FlashInfer's kernels."""
    torch.manual_seed(0)
    shape = AttentionShape(num_heads=8, num_kv_heads=2, head_dim=16)
    prefix = [0, 37, 16, 5, 64, 1]
    extend = [9, 1, 20, 1, 3, 1]
    lens = [p + e for p, e in zip(prefix, extend)]
    _alloc, table, rows = grow_requests(page_size, lens, seed=3, shared_prefix_pages=0)
    kv = KVStorage(KVShape(1, shape.num_kv_heads, shape.head_dim), 4096 + page_size, page_size)
    kv.k_buffer.normal_()
    kv.v_buffer.normal_()
    out_loc = torch.cat([table.table[r, p:n] for r, p, n in zip(rows, prefix, lens)])
    ids = [[1] * e for e in extend]
    fb = build_forward_batch(ids, prefix, rows, out_loc, kv, table.table)
    t = fb.num_tokens
    q = torch.randn(t, shape.num_heads, shape.head_dim)
    k_new = torch.randn(t, shape.num_kv_heads, shape.head_dim)
    v_new = torch.randn(t, shape.num_kv_heads, shape.head_dim)

    oracle = TorchNativeBackend(shape, cascade=None)
    oracle.plan(fb)
    expected = oracle.forward(q, k_new, v_new, 0, fb)  # writes k_new / v_new into the pool

    plan = plan_batch(fb)
    assert not plan.is_decode
    assert plan.qo_indptr.tolist() == [0, *torch.tensor(extend).cumsum(0).tolist()]
    got = paged_attention_from_plan(q, kv, 0, plan, shape)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    pre = plan_prefix(fb)
    assert pre.kv_lens == prefix
    assert pre.kv_indptr.tolist()[1] == 0  # the request with no prefix has no page
