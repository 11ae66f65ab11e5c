"""extend_attention (bf16 GEMM attention over a row of pool slots, AVX512_BF16): its numerics, when the backend
takes it, and a cascade group's shared prefix packed once and reused over the group's steps.

What the reuse promises: the kernel's result with a kept pack is the result of packing afresh; a pack is reused
only under the same key, and the key changes whenever the allocator frees a page under the prefix (the only way a
cached slot's KV can be rewritten), so a changed prefix is never read through a stale pack.
"""

from __future__ import annotations

import pytest
import torch

from radix.allocator import PagedAllocator
from radix.hugepages import huge_pages_mode
from radix.kv_storage import KVShape, KVStorage
from runtime.attention.base import AttentionShape
from runtime.attention.torch_native import TorchNativeBackend
from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.kernels.build import load_kernels
from tests.memory_maps import vm_flags

KERNELS = load_kernels("fastcpu")
requires_bf16_dot = pytest.mark.skipif(not KERNELS.bf16_dot(),
                                       reason="extend_attention is built only for CPUs with AVX512_BF16")
SHAPE = AttentionShape(9, 3, 64)


def extend_reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, n: int, scale: float):
    """One query head over its first ``n`` keys as extend_attention computes it: bf16 query, fp32 scores and
    softmax, the probabilities rounded to bf16 for the value sum (float64 elsewhere). Returns (out, lse)."""
    s = (keys[:n].double() @ q.bfloat16().double()) * scale
    p = torch.exp(s - s.max())
    out = (p.float().bfloat16().double() @ vals[:n].double()) / p.sum()
    return out, s.max() + torch.log(p.sum())


@requires_bf16_dot
@pytest.mark.parametrize(("tokens", "kv_heads", "group", "dim", "prefix"),
                         [(16, 3, 3, 64, 1000), (37, 3, 3, 64, 5), (20, 2, 4, 128, 300), (70, 1, 1, 64, 0)])
def test_extend_attention_equals_the_softmax_of_its_bf16_operands(tokens, kv_heads, group, dim, prefix):
    """A chunk of new tokens over a cached prefix (token i sees prefix + i + 1 slots, scattered in the pool):
    every query head of every token equals the reference of what the kernel promises (bf16 operands, fp32
    scores and sums, bf16 probabilities) up to fp32 rounding. Row counts not a multiple of the row block, key
    counts not a multiple of the tile, both head dims."""
    g = torch.Generator().manual_seed(tokens * dim + prefix)
    pool = 4000
    k_pool = torch.randn(pool, kv_heads * dim, generator=g).bfloat16()
    v_pool = torch.randn(pool, kv_heads * dim, generator=g).bfloat16()
    index = torch.randperm(pool, generator=g)[: prefix + tokens]
    lengths = torch.arange(prefix + 1, prefix + tokens + 1)
    q = torch.randn(tokens, kv_heads * group, dim, generator=g)
    out, lse = KERNELS.extend_attention(q, k_pool, v_pool, index, lengths, dim**-0.5, kv_heads)
    keys = k_pool[index].float().view(-1, kv_heads, dim)
    vals = v_pool[index].float().view(-1, kv_heads, dim)
    for t in range(tokens):
        for h in range(kv_heads * group):
            ref, ref_lse = extend_reference(q[t, h], keys[:, h // group], vals[:, h // group], int(lengths[t]),
                                            dim**-0.5)
            assert (out[t, h].double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max()), (t, h)
            assert abs(float(lse[t, h]) - float(ref_lse)) <= 1e-4, (t, h)


def test_gemm_kernel_is_chosen_by_chunk_length_and_pool_dtype():
    """Chunks of GEMM_EXTEND_MIN or more tokens over a bf16 pool take extend_attention where it is built;
    shorter ones (verified drafts) and fp32 pools stay on the decode kernel."""
    from runtime.attention.paged_decode import GEMM_EXTEND_MIN

    paged = TorchNativeBackend(SHAPE).paged
    assert paged is not None
    assert paged.gemm(GEMM_EXTEND_MIN, torch.bfloat16) == KERNELS.bf16_dot()
    assert not paged.gemm(GEMM_EXTEND_MIN - 1, torch.bfloat16)
    assert not paged.gemm(500, torch.float32)
    assert paged.gemm_shared(torch.bfloat16) == KERNELS.bf16_dot()
    assert not paged.gemm_shared(torch.float32)


def test_times_freed_moves_only_when_a_page_under_the_slots_is_freed():
    alloc = PagedAllocator(64, page_size=4)
    mine, other = alloc.alloc(10), alloc.alloc(6)
    start = alloc.times_freed(mine)
    alloc.alloc(3)
    assert alloc.times_freed(mine) == start  # handing out pages rewrites nothing that is in use
    alloc.free(other)
    assert alloc.times_freed(mine) == start  # other requests' pages come and go: these slots' KV stays
    alloc.free(mine[4:8])  # one of the three pages
    assert alloc.times_freed(mine) > start
    moved = alloc.times_freed(mine)
    alloc.reset()
    assert alloc.times_freed(mine) > moved


@requires_bf16_dot
def test_extend_attention_reads_its_queries_in_place_in_either_dtype():
    """The queries as a strided bf16 view (the decode stack passes its rotary output's query heads), contiguous, or
    as the same values in float32 (rounded to bf16 by the kernel, exactly): the same bits."""
    g = torch.Generator().manual_seed(5)
    hkv, d = 3, 64
    k_pool = torch.randn(600, hkv * d, generator=g).bfloat16()
    v_pool = torch.randn(600, hkv * d, generator=g).bfloat16()
    index = torch.randperm(600, generator=g)[:300]
    lengths = torch.full((8,), 300)
    wide = torch.randn(8, 9 + 2 * hkv, d, generator=g).bfloat16()  # q, k and v heads side by side
    view = wide[:, :9]
    assert not view.is_contiguous()
    results = [KERNELS.extend_attention(q, k_pool, v_pool, index, lengths, d**-0.5, hkv)
               for q in (view, view.contiguous(), view.float())]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@requires_bf16_dot
def test_extend_attention_with_a_kept_pack_equals_packing_afresh():
    g = torch.Generator().manual_seed(2)
    hkv, d = 3, 64
    k_pool = torch.randn(600, hkv * d, generator=g).bfloat16()
    v_pool = torch.randn(600, hkv * d, generator=g).bfloat16()
    index = torch.randperm(599, generator=g)[:333] + 1
    q = torch.randn(8, 9, d, generator=g).bfloat16()
    lengths = torch.full((8,), 333)
    packed = KERNELS.pack_prefix(k_pool, v_pool, index, hkv, d)
    assert [tuple(t.shape) for t in packed] == [(hkv, 352, d)] * 2  # 333 keys padded to a multiple of 32
    fresh = KERNELS.extend_attention(q, k_pool, v_pool, index, lengths, d**-0.5, hkv)
    kept = KERNELS.extend_attention(q, k_pool, v_pool, index, lengths, d**-0.5, hkv, packed)
    assert torch.equal(fresh[0], kept[0]) and torch.equal(fresh[1], kept[1])
    with pytest.raises(RuntimeError, match="pack_prefix's for these slots"):
        KERNELS.extend_attention(q, k_pool, v_pool, index[:300], torch.full((8,), 300), d**-0.5, hkv, packed)
    with pytest.raises(RuntimeError, match="slot out of range"):
        KERNELS.pack_prefix(k_pool, v_pool, torch.tensor([1, 2, 600]), hkv, d)


@requires_bf16_dot
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens", [1, 2, 8, 11])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(tokens: int, threads: int) -> None:
    """The kernel blocks a KV head's rows by 8 or 12 depending on the row and thread counts (the work split only):
    each token's attention, alone or among others, over a kept pack or packed in the call, is the same to the bit."""
    g = torch.Generator().manual_seed(tokens)
    hkv, d, prefix = 3, 64, 1050
    k_pool = torch.randn(1400, hkv * d, generator=g).bfloat16()
    v_pool = torch.randn(1400, hkv * d, generator=g).bfloat16()
    index = torch.randperm(1400, generator=g)[:prefix]
    q = torch.randn(tokens, 9, d, generator=g).bfloat16()
    lengths = torch.full((tokens,), prefix)
    packed = KERNELS.pack_prefix(k_pool, v_pool, index, hkv, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pack in (None, packed):
            out, lse = KERNELS.extend_attention(q, k_pool, v_pool, index, lengths, d**-0.5, hkv, pack)
            for t in range(tokens):
                alone = KERNELS.extend_attention(q[t : t + 1], k_pool, v_pool, index, lengths[:1], d**-0.5, hkv, pack)
                assert torch.equal(out[t], alone[0][0]) and torch.equal(lse[t], alone[1][0]), (t, pack is None)
    finally:
        torch.set_num_threads(before)


def group_batch(kv: KVStorage, prefix: torch.Tensor, own: list[int], history: PagedAllocator | None) -> ForwardBatch:
    """Decode rows of ``len(own)`` requests over one cached prefix (the slots ``prefix``), request i with
    ``own[i]`` tokens of its own after it (the last one new), in slots after the prefix's largest."""
    p = prefix.numel()
    table = torch.zeros(len(own), p + max(own) + 1, dtype=torch.int64)
    nxt = int(prefix.max()) + 1
    for i, n in enumerate(own):
        table[i, :p] = prefix
        table[i, p : p + n] = torch.arange(nxt, nxt + n)
        nxt += n
    lens = [p + n for n in own]
    out_loc = torch.stack([table[i, n - 1] for i, n in enumerate(lens)])
    return build_forward_batch([[1]] * len(own), [n - 1 for n in lens], list(range(len(own))), out_loc, kv, table,
                               kv_history=history)


@requires_bf16_dot
@pytest.mark.parametrize("scattered", [False, True])
def test_backend_reuses_the_pack_while_the_prefix_is_untouched_and_repacks_when_its_pages_are_freed(scattered):
    """The pack of a group's prefix is kept while no page under it is freed — other requests' pages may come and
    go — whether the prefix sits in consecutive slots or is scattered over the pool; freeing one of its pages
    (after which its KV may be rewritten) makes the next batch pack it afresh."""
    g = torch.Generator().manual_seed(5)
    kv = KVStorage(KVShape(2, SHAPE.num_kv_heads, SHAPE.head_dim, torch.bfloat16), 2048)
    kv.k_buffer.normal_(generator=g)
    kv.v_buffer.normal_(generator=g)
    alloc = PagedAllocator(1023, page_size=2)  # the pool's 2048 slots
    prefix = alloc.alloc(700)
    if scattered:
        prefix = prefix[torch.randperm(700, generator=g)]
    fast, gather = TorchNativeBackend(SHAPE), TorchNativeBackend(SHAPE, in_place_decode=False)
    assert fast.paged is not None
    q = torch.randn(4, 9, 64, generator=g).bfloat16()
    k_new = torch.randn(4, 3, 64, generator=g).bfloat16()
    v_new = torch.randn(4, 3, 64, generator=g).bfloat16()

    def run(backend: TorchNativeBackend, history: PagedAllocator | None, layer: int = 1):
        batch = group_batch(kv, prefix, [3, 9, 20, 5], history)
        backend.plan(batch)
        [part] = batch.attn_metadata.cascade.shared
        assert (part.kv_start is not None) == (not scattered)
        key = None if history is None else (history.times_freed(prefix), prefix.numpy().tobytes())
        assert part.reuse_key == key
        return backend.forward(q, k_new, v_new, layer, batch), key

    first, key = run(fast, alloc)
    where = (1, kv.k(1).data_ptr())
    kept = fast.paged.kept(key)
    assert list(kept) == [where]
    again, same = run(fast, alloc)
    assert same == key and fast.paged.kept(key)[where] is kept[where]  # reused, not packed again
    assert torch.equal(first, again)
    torch.testing.assert_close(first.float(), run(gather, alloc)[0].float(), rtol=2e-2, atol=2e-2)

    alloc.free(alloc.alloc(40))  # another request's pages
    _, still = run(fast, alloc)
    assert still == key and fast.paged.kept(key)[where] is kept[where]

    # one page of the prefix is freed and its KV written again: a new key, so the prefix is repacked
    alloc.free(prefix[:2].sort().values)
    kv.k_buffer[1, prefix] = -kv.k_buffer[1, prefix]
    changed, new_key = run(fast, alloc)
    assert new_key != key and fast.paged.kept_keys == {new_key}  # the old key's packs were dropped at planning
    torch.testing.assert_close(changed.float(), run(gather, alloc)[0].float(), rtol=2e-2, atol=2e-2)
    assert not torch.allclose(changed.float(), first.float(), atol=1e-2)

    # a group without a key (no history known) keeps nothing, and what was kept under other keys is dropped
    run(fast, None)
    assert fast.paged.kept_keys == set()


class OneGroup:
    """Four decode rows over one 300-slot prefix of a 3-layer bf16 pool, for a backend of their own: each call plans
    them and returns the group's packs as the native decode stack reads them (one per layer) and its reuse key."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.kv = KVStorage(KVShape(3, SHAPE.num_kv_heads, SHAPE.head_dim, torch.bfloat16), 1024)
        self.kv.k_buffer.normal_(generator=g)
        self.kv.v_buffer.normal_(generator=g)
        self.alloc = PagedAllocator(511, page_size=2)
        self.prefix = self.alloc.alloc(300)
        self.backend = TorchNativeBackend(SHAPE)
        assert self.backend.paged is not None
        self.paged = self.backend.paged

    def __call__(self) -> tuple[list, tuple]:
        batch = group_batch(self.kv, self.prefix, [2, 4, 3, 5], self.alloc)  # (4 - 1) x 300 saved rows: one group
        self.backend.plan(batch)
        read = self.backend.decode_in_place(batch)
        assert read is not None and len(read.shared) == 1
        return read.shared[0].packs, batch.attn_metadata.cascade.shared[0].reuse_key

    def free(self, start: int, end: int) -> None:
        """Free prefix slots [start, end): a page under the prefix freed, so the next plan has a new key."""
        self.alloc.free(self.prefix[start:end].sort().values)

    def assert_fresh(self, packs: list) -> None:
        """Each layer's pack holds the bits pack_prefix gives for the prefix now."""
        kv = self.kv
        for i, pack in enumerate(packs):
            fresh = KERNELS.pack_prefix(kv.k(i).view(kv.total_slots, -1), kv.v(i).view(kv.total_slots, -1),
                                        self.prefix, SHAPE.num_kv_heads, SHAPE.head_dim)
            assert all(torch.equal(a, b) for a, b in zip(pack, fresh, strict=True))


@requires_bf16_dot
def test_a_decode_batch_takes_every_layers_kept_pack_as_one_list_until_its_key_changes():
    """The native decode stack reads a group's packs of all layers as one list: the packs kept layer by layer,
    the same list on the group's later steps, and a new list of new packs once a page under the prefix was freed
    (the old key's packs, list included, are dropped at planning)."""
    case = OneGroup(6)
    first, key = case()
    kept = case.paged.kept(key)
    assert len(first) == 3 and all(first[i] is kept[(i, case.kv.k(i).data_ptr())] for i in range(3))
    # the complete list was moved onto huge pages (where the kernel has them) with the bits of a fresh pack
    case.assert_fresh(first)
    if huge_pages_mode() != "never":
        assert all("hg" in vm_flags(t.data_ptr()) for pack in first for t in pack)
    again, same = case()
    assert same == key and again is first
    case.free(0, 2)
    moved, new_key = case()
    assert new_key != key and moved is not first and case.paged.kept_keys == {new_key}
    assert all(a is not b for a, b in zip(moved, first))


@requires_bf16_dot
@pytest.mark.skipif(huge_pages_mode() == "never", reason="packs move onto huge pages only where the kernel has them")
def test_a_new_groups_packs_take_the_huge_pages_of_a_forgotten_group_once_nothing_reads_them():
    """A group's packs move into huge pages that the packs of a group forgotten before it held, once no pack of that
    group is alive (fresh huge pages cost their first touch), and hold the bits of fresh packs there; while one is
    still alive its pages are left alone."""
    case = OneGroup(8)

    def span(lists: list) -> set[int]:
        return {t.data_ptr() for pack in lists for t in pack}

    first = case()[0]
    one_group = case.paged.pack_pages_mapped
    assert one_group > 0
    held = first[0][0]  # one tensor of the first group's packs still alive: its mapping stays in use
    before = held.clone()
    first_at = span(first)
    del first
    case.free(0, 2)  # a new key: the first group forgotten
    second = case()[0]
    assert case.paged.pack_pages_mapped == 2 * one_group  # new pages: the first group's are still read
    assert not span(second) & first_at and torch.equal(held, before)
    second_at = span(second)
    del held, second
    case.free(2, 4)
    third = case()[0]
    assert case.paged.pack_pages_mapped == 2 * one_group  # nothing mapped: a forgotten group's pages reused
    assert span(third) <= first_at | second_at
    case.assert_fresh(third)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_attention_kernel_joins_two_parts_as_the_softmax_over_their_union(dtype):
    """merge_attention (one pass in place, the decode stack's and the layer path's) against the exact attention
    over both key sets: the merged rows match it to the out dtype's rounding, and they match the torch merge
    (runtime/attention/cascade.py) as closely. ``out`` is a narrowed view of a larger batch, as the stack hands it;
    rows outside the view are untouched. A part that is all of the weight (an own part with no keys: lse -inf)
    gives the other part back exactly."""
    from runtime.attention.cascade import merge_attention_

    g = torch.Generator().manual_seed(3)
    rows, heads, dim, n_own, n_shared = 6, 9, 64, 7, 40
    q = torch.randn(rows, heads, dim, generator=g, dtype=torch.float64)
    k_own, v_own = (torch.randn(rows, heads, n_own, dim, generator=g, dtype=torch.float64) for _ in range(2))
    k_sh, v_sh = (torch.randn(heads, n_shared, dim, generator=g, dtype=torch.float64) for _ in range(2))

    def part(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.einsum("rhd,rhkd->rhk", q, k) / dim**0.5
        return torch.einsum("rhk,rhkd->rhd", s.softmax(-1), v), s.logsumexp(-1)

    o_own, l_own = part(k_own, v_own)
    o_sh, l_sh = part(k_sh.expand(rows, -1, -1, -1), v_sh.expand(rows, -1, -1, -1))
    exact, _ = part(torch.cat([k_own, k_sh.expand(rows, -1, -1, -1)], 2),
                    torch.cat([v_own, v_sh.expand(rows, -1, -1, -1)], 2))
    l_own[0, 0] = -float("inf")  # row 0, head 0: no own keys, the shared part is the whole answer
    exact[0, 0] = o_sh[0, 0]
    batch = torch.zeros(rows + 2, heads, dim, dtype=dtype)
    batch[1:-1] = o_own.to(dtype)
    out = batch.narrow(0, 1, rows)
    torch_merged = o_own.to(dtype).clone()
    KERNELS.merge_attention(out, l_own.float(), o_sh.float(), l_sh.float())
    merge_attention_(torch_merged, l_own.float(), o_sh.float(), l_sh.float())
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(out.double(), exact, **tol)
    torch.testing.assert_close(out, torch_merged, **tol)
    assert torch.equal(out[0, 0], o_sh[0, 0].float().to(dtype))
    assert not batch[0].any() and not batch[-1].any()
