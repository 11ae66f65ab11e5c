import pytest
import torch

from radix import (
    DoubleFreeError,
    KVOutOfMemoryError,
    KVShape,
    KVStorage,
    PagedAllocator,
    ReqToTokenPool,
    UnownedSlotError,
)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_alloc_is_page_aligned_and_accounted(ps):
    a = PagedAllocator(capacity_tokens=8 * ps, page_size=ps)
    assert a.capacity == 8 * ps and a.free_size == 8 * ps
    slots = a.alloc(ps + 1)
    assert slots.numel() == ps + 1
    assert int(slots[0]) % ps == 0, "a request's first token starts a page"
    assert torch.equal(slots[:ps], torch.arange(int(slots[0]), int(slots[0]) + ps))
    assert a.free_size == 6 * ps  # two whole pages taken
    assert not bool(a.is_free(slots).any())


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_alloc_extend_fills_the_last_page_first(ps):
    a = PagedAllocator(capacity_tokens=8 * ps, page_size=ps)
    first = a.alloc(1)
    more = a.alloc_extend(1, int(first[-1]), 2 * ps)
    seq = torch.cat([first, more])
    # position p of the sequence sits at offset p % ps of its page
    assert torch.equal(seq % ps, torch.arange(seq.numel()) % ps)
    assert a.free_size == 8 * ps - a.pages_for(2 * ps + 1) * ps


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_free_returns_whole_pages(ps):
    a = PagedAllocator(capacity_tokens=4 * ps, page_size=ps)
    slots = a.alloc(ps + 1)
    a.free(slots[ps:])  # a partial page frees its page
    assert a.free_size == 3 * ps
    a.free(slots[:ps])
    assert a.free_size == 4 * ps


def test_double_free_is_refused_and_changes_nothing():
    a = PagedAllocator(capacity_tokens=16, page_size=4)
    slots = a.alloc(8)
    a.free(slots[:4])
    with pytest.raises(DoubleFreeError):
        a.free(slots)  # first page already free: nothing else may be freed either
    assert a.free_size == 12
    a.free(slots[4:])
    assert a.free_size == 16


def test_unowned_slots_are_refused():
    a = PagedAllocator(capacity_tokens=16, page_size=4)
    with pytest.raises(UnownedSlotError):
        a.free(torch.tensor([0]))  # the reserved padding page
    with pytest.raises(UnownedSlotError):
        a.free(torch.tensor([10_000]))
    with pytest.raises(DoubleFreeError):
        a.free(torch.tensor([5]))  # inside the pool but never handed out


def test_over_allocation_is_refused():
    a = PagedAllocator(capacity_tokens=16, page_size=4)
    a.alloc(12)
    with pytest.raises(KVOutOfMemoryError, match="only 1 pages"):
        a.alloc(5)
    assert a.free_size == 4


def test_invalid_construction():
    with pytest.raises(ValueError):
        PagedAllocator(capacity_tokens=16, page_size=0)
    with pytest.raises(ValueError):
        PagedAllocator(capacity_tokens=3, page_size=4)


def test_req_to_token_pool():
    pool = ReqToTokenPool(max_requests=2, max_context_len=8)
    r0, r1 = pool.alloc(), pool.alloc()
    with pytest.raises(KVOutOfMemoryError):
        pool.alloc()
    pool.write(r0, 2, torch.tensor([7, 8, 9]))
    assert pool.read(r0, 2, 5).tolist() == [7, 8, 9]
    with pytest.raises(KVOutOfMemoryError):
        pool.write(r1, 6, torch.tensor([1, 2, 3]))
    pool.free(r0)
    with pytest.raises(DoubleFreeError):
        pool.free(r0)


def test_kv_storage_layout_and_budget():
    shape = KVShape(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32)
    assert shape.bytes_per_token == 2 * 2 * 3 * 4 * 4
    cap = shape.tokens_for_bytes(shape.bytes_per_token * 40, page_size=8)
    assert cap == 32  # 5 pages fit, one is the reserved padding page
    alloc = PagedAllocator(cap, page_size=8)
    kv = KVStorage(shape, alloc.total_slots, page_size=8)
    assert kv.nbytes == shape.bytes_per_token * alloc.total_slots
    slots = alloc.alloc(10)
    k = torch.randn(10, 3, 4)
    kv.set_kv(1, slots, k, -k)
    assert torch.equal(kv.k(1)[slots], k) and torch.equal(kv.v(1)[slots], -k)
    kp, _ = kv.paged_view(1)
    assert kp.shape == (5, 8, 3, 4)
    assert torch.equal(kp[int(slots[9]) // 8, int(slots[9]) % 8], k[9])
    with pytest.raises(ValueError):
        shape.tokens_for_bytes(10)
    bf = KVShape(1, 1, 2, torch.bfloat16)
    assert bf.bytes_per_token == 2 * 1 * 1 * 2 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_pool_reads_zero_and_the_gathers_match_index_select(dtype):
    """The pool's buffers come from lazily mapped memory: they must still read as zeros everywhere (the
    padding page and every never-written slot) and take writes like any tensor; and ``gather_slots`` (the
    tiers' gather) is exactly ``index_select`` over the slot dimension."""
    from radix.kv_storage import gather_slots

    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    kv = KVStorage(shape, 4096, page_size=16)
    assert kv.k_buffer.dtype == dtype and kv.k_buffer.is_contiguous() and kv.k_buffer.shape == (3, 4096, 2, 8)
    assert not kv.k_buffer.any() and not kv.v_buffer.any()
    slots = torch.tensor([17, 3000, 4095, 18])
    k = torch.randn(3, 4, 2, 8).to(dtype)
    kv.write(slots, k, -k)
    got_k, got_v = kv.read(slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert torch.equal(gather_slots(kv.k_buffer, slots), kv.k_buffer.index_select(1, slots))
    out = torch.empty(3, 4, 2, 8, dtype=dtype)
    assert gather_slots(kv.v_buffer, slots, out=out) is out and torch.equal(out, -k)
    assert int(kv.k_buffer.count_nonzero()) == int(k.count_nonzero())  # nothing else was written
