"""Packed weights on transparent huge pages (runtime/models/hugepages.py): the mappings are aligned and advised for
huge pages, the copies hold the same bits, and the packed kernels give the same products from them."""

from __future__ import annotations

import pytest
import torch

from radix import hugepages
from radix.hugepages import ALIGN, HUGE_PAGE, HugePageArena, MappingPool, anonymous, huge_pages_mode
from runtime.models.ops import PackedCpuOps
from tests.memory_maps import vm_flags


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"),
                                           ("[always] madvise never", "always"),
                                           ("always madvise [never]", "never"), ("", "never")])
def test_the_mode_is_the_bracketed_word(tmp_path, monkeypatch, text, mode):
    setting = tmp_path / "enabled"
    setting.write_text(text)
    monkeypatch.setattr(hugepages, "_THP_MODE", setting)
    assert huge_pages_mode() == mode


def test_no_setting_means_no_huge_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(hugepages, "_THP_MODE", tmp_path / "missing")
    assert huge_pages_mode() == "never"


def test_an_anonymous_mapping_is_zeroed_aligned_and_advised_for_huge_pages():
    t = anonymous(3 * HUGE_PAGE + 12345)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 12345
    assert t.data_ptr() % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t[-1] = 7  # writable to its last byte
    assert int(t[-1]) == 7
    assert "hg" in vm_flags(t.data_ptr())  # MADV_HUGEPAGE: the kernel backs it with huge pages when it can
    assert "hg" in vm_flags(t.data_ptr() + t.numel() - 1)


def test_the_arena_copies_tensors_bit_for_bit_one_after_another_on_cache_lines():
    g = torch.Generator().manual_seed(0)
    arena = HugePageArena(chunk=HUGE_PAGE)
    tensors = [torch.randn(37, 5, generator=g), torch.randint(-128, 127, (1000,), dtype=torch.int8, generator=g),
               torch.randn(3, 64, generator=g).bfloat16()]
    placed = [arena.place(t) for t in tensors]
    for t, p in zip(tensors, placed):
        assert p.dtype == t.dtype and p.shape == t.shape and torch.equal(p, t)
        assert p.data_ptr() % ALIGN == 0 and p.data_ptr() != t.data_ptr()
    assert placed[1].data_ptr() == placed[0].data_ptr() + (tensors[0].nbytes + ALIGN - 1) // ALIGN * ALIGN
    assert arena.used == sum(t.nbytes for t in tensors) and arena.mapped == HUGE_PAGE
    tensors[0].zero_()  # a copy, not a view
    assert not torch.equal(placed[0], tensors[0])


def test_a_tensor_that_does_not_fit_opens_a_mapping_of_its_own():
    arena = HugePageArena(chunk=HUGE_PAGE)
    small = arena.place(torch.ones(1000))
    big = arena.place(torch.full((HUGE_PAGE // 4 + 10,), 2.0))  # 2 MB + 40 bytes: larger than a chunk
    after = arena.place(torch.full((10,), 3.0))
    assert arena.mapped == HUGE_PAGE + 2 * HUGE_PAGE
    assert big.data_ptr() % HUGE_PAGE == 0 and bool((big == 2).all()) and bool((small == 1).all())
    assert after.data_ptr() == big.data_ptr() + big.nbytes + (-big.nbytes % ALIGN)


def test_only_contiguous_cpu_tensors_are_placed():
    with pytest.raises(ValueError, match="contiguous"):
        HugePageArena().place(torch.ones(4, 4).t())


def test_the_pool_hands_a_mapping_out_again_only_once_nothing_over_it_is_alive():
    pool = MappingPool(keep_bytes=64 * HUGE_PAGE)
    first = pool.take(3 * HUGE_PAGE)
    assert first.numel() == 3 * HUGE_PAGE and first.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(first.data_ptr())
    address = first.data_ptr()
    view = first[10:20].view(torch.int16)  # a view of it keeps the mapping in use
    del first
    second = pool.take(3 * HUGE_PAGE)
    assert second.data_ptr() != address and pool.held == 2 * 3 * HUGE_PAGE
    view.fill_(7)
    del view
    third = pool.take(2 * HUGE_PAGE)  # fits the idle one
    assert third.data_ptr() == address and pool.mapped == pool.held == 6 * HUGE_PAGE
    assert bool((second[:20] == 0).all())  # the other mapping was not written
    big = pool.take(9 * HUGE_PAGE + 1)  # a size between powers of two: rounded up to an eighth of the next one
    assert pool.held == 6 * HUGE_PAGE + 10 * HUGE_PAGE
    del second, third
    assert big.numel() == 9 * HUGE_PAGE + 1
    assert pool.take(HUGE_PAGE).data_ptr() == address  # the smallest idle one that fits, the oldest of equals


def test_the_pool_unmaps_idle_mappings_beyond_what_it_keeps_and_never_those_in_use():
    pool = MappingPool(keep_bytes=4 * HUGE_PAGE)
    kept = [pool.take(4 * HUGE_PAGE) for _ in range(3)]  # 12 pages in use: none idle, none unmapped
    assert pool.held == 12 * HUGE_PAGE
    del kept[:2]  # two idle mappings (8 pages): one is over the budget, dropped when the pool next maps
    fresh = pool.take(5 * HUGE_PAGE)  # fits no idle one: a new mapping of 5 pages, and the oldest idle one goes
    assert pool.held == (4 + 4 + 5) * HUGE_PAGE and fresh.numel() == 5 * HUGE_PAGE
    mapped = pool.mapped
    pool.take(4 * HUGE_PAGE)  # the idle one kept is handed out: nothing new mapped
    assert pool.mapped == mapped and pool.held == (4 + 4 + 5) * HUGE_PAGE
    assert bool((kept[0] == 0).all())  # the one in use is still mapped and readable


def test_an_arena_over_a_pool_places_the_same_bits_in_reused_pages():
    g = torch.Generator().manual_seed(1)
    pool = MappingPool(keep_bytes=16 * HUGE_PAGE)
    tensors = [torch.randn(1000, 300, generator=g), torch.randn(77, generator=g).bfloat16()]
    first = [HugePageArena(chunk=HUGE_PAGE, pool=pool).place(t) for t in tensors]
    address = first[0].data_ptr()
    del first
    again = HugePageArena(chunk=HUGE_PAGE, pool=pool)
    placed = [again.place(t.flip(0).contiguous()) for t in tensors]
    assert placed[0].data_ptr() == address  # the first arena's mapping, reused
    assert all(torch.equal(p, t.flip(0)) for p, t in zip(placed, tensors))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_packed_weights_on_huge_pages_give_the_products_of_packed_weights_elsewhere(monkeypatch, fmt):
    g = torch.Generator().manual_seed(3)
    weights = [torch.nn.Parameter(torch.randn(n, k, generator=g) * 0.1, requires_grad=False)
               for n, k in ((192, 64), (64, 160), (130, 64))]
    x = {k: torch.randn(3, k, generator=g).bfloat16() for k in (64, 160)}

    def products(mode: str) -> list[torch.Tensor]:
        monkeypatch.setattr(hugepages, "huge_pages_mode", lambda: mode)
        ops = PackedCpuOps(fmt)
        ops.pack(weights, release=lambda _: False)
        packed = [ops.packed[id(w)].data for w in weights]
        if mode != "never":  # one arena: the first panel at a huge page boundary, the others after it
            assert packed[0].data_ptr() % HUGE_PAGE == 0
            assert all("hg" in vm_flags(p.data_ptr()) for p in packed)
        return [ops.linear(x[w.shape[1]], w, None) for w in weights]

    for on_huge, elsewhere in zip(products("madvise"), products("never")):
        assert torch.equal(on_huge, elsewhere)
