"""Shared-prefix ("cascade") attention in the torch_native backend.

Three layers of checks: the grouping rule (``find_shared_prefixes``) on hand-made request tables; the
backend's attention output with cascade on, off, and against a float64 reference computed position by
position, over pools where requests literally share KV slots (decode-only, mixed prefill + decode,
several groups plus singletons, page sizes 1 and 16, GQA shapes, contiguous and scattered prefixes,
bf16, the non-CPU math path); and the full model against HF logits for requests under one cached prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from model_helpers import TINY_CONFIGS, VOCAB, PoolDriver, hf_logits

from radix.kv_storage import KVShape, KVStorage
from runtime.attention import cascade
from runtime.attention.base import AttentionShape
from runtime.attention.cascade import (
    CascadePolicy,
    SharedPrefix,
    SharedPrefixFinder,
    find_shared_prefixes,
    merge_attention_,
)
from runtime.attention.torch_native import TorchNativeBackend
from runtime.attention.torch_native_plan import OWN_CHUNKS_MAX, TorchNativeMetadata
from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.models.loader import attention_shape, load_config, load_model

ALWAYS = CascadePolicy(min_prefix=1, min_saved_tokens=1)  # group whatever shares at least one slot


# ---------------------------------------------------------------------------------------------- planning
def _table(rows: Sequence[Sequence[int]], width: int = 400) -> torch.Tensor:
    table = torch.zeros(len(rows), width, dtype=torch.int64)
    for r, slots in enumerate(rows):
        table[r, : len(slots)] = torch.tensor(list(slots))
    return table


def _seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_groups_by_shared_leading_slots() -> None:
    shared = _seq(1000, 100)
    table = _table([
        shared + _seq(2000, 50),  # 0: group A
        _seq(5000, 80) + _seq(5100, 20),  # 1: group B
        shared + _seq(3000, 30),  # 2: group A
        _seq(7000, 120),  # 3: alone
        shared[:10] + _seq(4000, 90),  # 4: shares only 10 slots with A: too short for a group
        _seq(5000, 80) + _seq(6000, 40),  # 5: group B
        shared + _seq(8000, 5),  # 6: group A
    ])
    prefix_lens = [150, 100, 130, 120, 100, 120, 105]
    groups = find_shared_prefixes(table, list(range(7)), prefix_lens, CascadePolicy(32, 32))
    assert groups == [SharedPrefix((0, 2, 6), 100), SharedPrefix((1, 5), 80)]
    # req_rows maps batch index -> table row: the same requests in another order give the same groups.
    order = [6, 5, 4, 3, 2, 1, 0]
    groups = find_shared_prefixes(table, order, [prefix_lens[r] for r in order], CascadePolicy(32, 32))
    assert groups == [SharedPrefix((0, 4, 6), 100), SharedPrefix((1, 5), 80)]


def test_prefix_len_limits_the_shared_part() -> None:
    """Slots the step writes (positions >= prefix_len) are never shared, even if the table rows agree."""
    same = _seq(10, 300)
    table = _table([same, same, same])
    groups = find_shared_prefixes(table, [0, 1, 2], [200, 120, 250], CascadePolicy(32, 32))
    assert groups == [SharedPrefix((0, 1, 2), 120)]  # request 1 writes position 120 (slot 130) this step
    # A request with no cached KV (a fresh prefill) is never grouped, whatever its table row says.
    assert find_shared_prefixes(table, [0, 1, 2], [0, 0, 250], ALWAYS) == []


def test_thresholds_and_best_split() -> None:
    base = _seq(100, 1000)
    rows = [base + _seq(5000 + 10 * i, 5) for i in range(2)]  # share 1000 slots
    rows += [base[:100] + _seq(7000 + 1000 * i, 900) for i in range(8)]  # share the first 100 with all
    table = _table(rows, 1100)
    prefix = [1000] * 10
    # (2-1)*1000 saved gathers beat (10-1)*100; the other 8 then form their own group over 100 slots.
    groups = find_shared_prefixes(table, list(range(10)), prefix, CascadePolicy(64, 256))
    assert groups == [SharedPrefix((0, 1), 1000), SharedPrefix(tuple(range(2, 10)), 100)]
    # min_prefix: 100 shared slots are not enough for the eight.
    groups = find_shared_prefixes(table, list(range(10)), prefix, CascadePolicy(128, 256))
    assert groups == [SharedPrefix((0, 1), 1000)]
    # min_saved_tokens: two requests over 100 slots save 100 gathers per layer, nine save 900.
    assert find_shared_prefixes(table, [2, 3], [1000, 1000], CascadePolicy(64, 256)) == []
    assert len(find_shared_prefixes(table, list(range(2, 10)), [1000] * 8, CascadePolicy(64, 256))) == 1


def test_nested_sharing_takes_the_branch_that_pays() -> None:
    """Six questions under a 200-slot block, three of them samples of one prompt (500 shared slots)."""
    block = _seq(100, 200)
    sample = block + _seq(400, 300)
    table = _table([sample + [900], block + _seq(1000, 300), sample + [901], block + _seq(2000, 300),
                    sample + [902], block + _seq(3000, 300)], 600)
    policy = CascadePolicy(32, 32)
    # The samples alone save 2*500, and the other three still share the block: 2*200 more.
    assert find_shared_prefixes(table, list(range(6)), [501] * 6, policy) == [
        SharedPrefix((0, 2, 4), 500), SharedPrefix((1, 3, 5), 200)]
    # Two samples with 300 cached tokens: their branch (1*300) saves less than the two add to the block's
    # group (2*200), so one group of five.
    assert find_shared_prefixes(table, [0, 1, 2, 3, 5], [300, 501, 300, 501, 501], policy) == [
        SharedPrefix((0, 1, 2, 3, 4), 200)]


def _decode_step(table: torch.Tensor, rows: Sequence[int], lens: list[int], next_slot: int) -> int:
    """Each request of ``rows`` writes one private slot at position ``lens[j]`` and moves one token on."""
    for j, r in enumerate(rows):
        table[r, lens[j]] = next_slot
        lens[j] += 1
        next_slot += 1
    return next_slot


def test_finder_keeps_a_decode_waves_groups_and_gives_the_walks_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples under a question under a few-shot block, another question, and a request of its own, decoding:
    every step's groups equal a new walk's, and the walk runs only when the batch is not the last one moved on."""
    block, sample = _seq(100, 200), _seq(400, 300)
    table = _table([block + sample + [900], block + _seq(1000, 300), block + sample + [901],
                    block + _seq(2000, 300), _seq(3000, 40), block + sample + [902]], 1000)
    rows, lens = [0, 1, 2, 3, 4, 5], [501, 500, 501, 500, 40, 501]
    policy = CascadePolicy(32, 32)
    walks: list[int] = []
    walk = cascade.find_shared_prefixes
    monkeypatch.setattr(cascade, "find_shared_prefixes", lambda *a: walks.append(1) or walk(*a))
    finder, slot = SharedPrefixFinder(policy), 10_000
    expected = [SharedPrefix((0, 2, 5), 500), SharedPrefix((1, 3), 200)]
    for _ in range(6):
        got = finder.find(table, rows, lens, decode=True)
        assert got == walk(table, rows, lens, policy) == expected
        slot = _decode_step(table, rows, lens, slot)
    assert len(walks) == 1
    # A prefill step in between (not every request one token on): the next decode batch walks again.
    finder.find(table, rows, lens, decode=False)
    slot = _decode_step(table, rows, lens, slot)
    assert finder.find(table, rows, lens, decode=True) == expected and len(walks) == 3
    # A request reaching min_prefix between two steps becomes a candidate: the walk runs again (and still agrees).
    short = _table([block[:30], block[:31]], 1000)
    rows2, lens2 = [0, 1], [30, 31]
    finder2, policy2 = SharedPrefixFinder(CascadePolicy(31, 1)), CascadePolicy(31, 1)
    assert finder2.find(short, rows2, lens2, decode=True) == walk(short, rows2, lens2, policy2) == []
    _decode_step(short, rows2, lens2, 50_000)
    before = len(walks)
    assert finder2.find(short, rows2, lens2, decode=True) == walk(short, rows2, lens2, policy2)
    assert len(walks) == before + 1
    # The same lengths again (the batch did not move on): walk again.
    assert finder2.find(short, rows2, lens2, decode=True) == walk(short, rows2, lens2, policy2)
    assert len(walks) == before + 2


def test_finder_walks_again_when_a_row_changes_hands() -> None:
    """Request 3 finishes and a new request takes its table row, with as many cached tokens as it would have had
    and a prefix that leaves the block after 50 slots: it is not grouped under the block."""
    block = _seq(100, 200)
    table = _table([block + _seq(1000, 50), block + _seq(2000, 50), block + _seq(3000, 50),
                    block + _seq(4000, 50)], 1000)
    rows, lens = [0, 1, 2, 3], [250, 250, 250, 250]
    policy = CascadePolicy(32, 32)
    finder = SharedPrefixFinder(policy)
    assert finder.find(table, rows, lens, decode=True) == [SharedPrefix((0, 1, 2, 3), 200)]
    _decode_step(table, rows, lens, 10_000)
    table[3, :251] = torch.tensor(block[:50] + _seq(6000, 201))
    got = finder.find(table, rows, lens, decode=True)
    assert got == find_shared_prefixes(table, rows, lens, policy) == [SharedPrefix((0, 1, 2), 200)]


def test_merge_is_exact_for_extreme_magnitudes() -> None:
    """Two parts whose log-sum-exps differ hugely merge without overflow or NaN."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 10, 8, generator=g, dtype=torch.float64) * torch.tensor([1.0] * 5 + [40.0] * 5,
                                                                                    dtype=torch.float64)[:, None]
    v = torch.randn(1, 1, 10, 8, generator=g, dtype=torch.float64)
    full = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    lse = [(q @ part.transpose(-1, -2)).logsumexp(-1) for part in (k[..., :5, :], k[..., 5:, :])]
    outs = [torch.softmax(q @ kp.transpose(-1, -2), -1) @ vp
            for kp, vp in ((k[..., :5, :], v[..., :5, :]), (k[..., 5:, :], v[..., 5:, :]))]
    merged = outs[1][0].float()
    merge_attention_(merged, lse[1][0].float(), outs[0][0].float(), lse[0][0].float())
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged.double(), full[0], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- attention
class SlotPool:
    """A one-layer KV pool with random contents, a request table, and page-respecting slot assignment.

    ``share(src, dst, n)`` gives ``dst`` the same first ``n`` slots as ``src`` (what the radix cache
    does); with ``scattered`` pages are handed out in random order, so no prefix is a contiguous run.
    """

    def __init__(self, shape: AttentionShape, page_size: int, dtype: torch.dtype = torch.float32,
                 scattered: bool = False, num_pages: int = 1200, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        pages = num_pages * 16 // page_size  # the same capacity for every page size
        self.kv = KVStorage(KVShape(1, shape.num_kv_heads, shape.head_dim, dtype), (pages + 1) * page_size,
                            page_size)
        self.kv.k_buffer.copy_(torch.randn(self.kv.k_buffer.shape, generator=self.gen))
        self.kv.v_buffer.copy_(torch.randn(self.kv.v_buffer.shape, generator=self.gen))
        order = torch.randperm(pages, generator=self.gen) + 1 if scattered else torch.arange(1, pages + 1)
        self.free_pages = order.tolist()
        self.table = torch.zeros(64, 4096, dtype=torch.int64)
        self.slots: dict[str, list[int]] = {}

    def _extend(self, rid: str, n: int) -> list[int]:
        slots = self.slots.setdefault(rid, [])
        new = []
        for _ in range(n):
            if len(slots) % self.page_size:
                new.append(slots[-1] + 1)
            else:
                new.append(self.free_pages.pop(0) * self.page_size)
            slots.append(new[-1])
        row = self.row(rid)
        self.table[row, : len(slots)] = torch.tensor(slots)
        return new

    def row(self, rid: str) -> int:
        return list(self.slots).index(rid)

    def cached(self, rid: str, n: int, src: str | None = None, shared: int = 0) -> None:
        """``rid`` holds ``n`` cached tokens, the first ``shared`` in ``src``'s slots."""
        if src is not None:
            assert shared % self.page_size == 0, "the radix cache shares whole pages"
            self.slots[rid] = list(self.slots[src][:shared])
        self._extend(rid, n - len(self.slots.get(rid, [])))

    def batch(self, work: Sequence[tuple[str, int]]) -> ForwardBatch:
        prefix = [len(self.slots.get(rid, [])) for rid, _ in work]
        loc = torch.tensor([s for rid, n in work for s in self._extend(rid, n)], dtype=torch.int64)
        return build_forward_batch([[0] * n for _, n in work], prefix, [self.row(rid) for rid, _ in work], loc,
                                   self.kv, self.table)


def reference(batch: ForwardBatch, q: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """Float64 attention of each new token over its request's KV positions 0 .. its own position."""
    g = shape.num_heads // shape.num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for row, pre, ext in zip(batch.req_pool_indices.tolist(), batch.prefix_lens_cpu, batch.extend_lens_cpu):
        slots = batch.req_to_token[row, : pre + ext]
        k = batch.kv.k(0)[slots].double().repeat_interleave(g, dim=1)  # [S, H, D]
        v = batch.kv.v(0)[slots].double().repeat_interleave(g, dim=1)
        qi = q[start : start + ext].double()
        scores = torch.einsum("ehd,shd->hes", qi, k) * shape.scale
        future = torch.arange(pre + ext)[None, :] > torch.arange(pre, pre + ext)[:, None]
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
        out[start : start + ext] = torch.einsum("hes,shd->ehd", probs, v)
        start += ext
    return out


def run_both(pool: SlotPool, work: Sequence[tuple[str, int]], shape: AttentionShape,
             policy: CascadePolicy = ALWAYS,
             in_place: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TorchNativeMetadata]:
    """(cascade on, cascade off, float64 reference) outputs for one batch, and the cascade plan (``in_place``: the
    cascade-on backend reads the pool with the in-place kernels, else it gathers)."""
    batch = pool.batch(work)
    t = batch.num_tokens
    dtype = pool.kv.shape.dtype
    q = torch.randn(t, shape.num_heads, shape.head_dim, generator=pool.gen).to(dtype)
    k = torch.randn(t, shape.num_kv_heads, shape.head_dim, generator=pool.gen).to(dtype)
    v = torch.randn(t, shape.num_kv_heads, shape.head_dim, generator=pool.gen).to(dtype)
    outs, metas = [], []
    for backend in (TorchNativeBackend(shape, cascade=policy, in_place_decode=in_place),
                    TorchNativeBackend(shape, cascade=None)):
        batch.attn_metadata = None
        backend.plan(batch)
        metas.append(batch.attn_metadata)
        outs.append(backend.forward(q, k, v, 0, batch))
    assert metas[1].cascade is None
    return outs[0], outs[1], reference(batch, q, shape), metas[0]


def _groups(meta: TorchNativeMetadata) -> list[tuple[int, int]]:
    """(query rows, P) of each planned group."""
    assert meta.cascade is not None, "cascade was not planned"
    return [(p.end - p.start, p.prefix_len) for p in meta.cascade.shared]


SHAPES = [AttentionShape(9, 3, 64), AttentionShape(4, 1, 32), AttentionShape(4, 4, 16)]


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gather"])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.num_heads}h{s.num_kv_heads}kv{s.head_dim}d")
def test_decode_groups_match(shape: AttentionShape, page_size: int, scattered: bool, in_place: bool) -> None:
    """Decode rows under shared prefixes. The gather path groups them; the in-place kernel, which attends the rows
    that hold the same slots over a range in one call, takes them ungrouped over an fp32 pool (no GEMM kernel for
    the shared part: TorchNativeBackend.groups_pay). Either way each row's result is the reference's."""
    grouped = not in_place or TorchNativeBackend(shape).paged is None
    pool = SlotPool(shape, page_size, scattered=scattered)
    pool.cached("a0", 300)
    for i in range(1, 5):  # a: 5 requests under a 288-token prefix, private tails of different lengths
        pool.cached(f"a{i}", 288 + 7 * i + 1, "a0", 288)
    pool.cached("b0", 64)
    pool.cached("b1", 100, "b0", 48)  # b: 2 requests over 48 slots
    pool.cached("s", 500)  # alone, longest context
    pool.cached("t", 33, "a0", 32)  # shares 32 slots with a: below min_prefix, stays alone
    work = [("a3", 1), ("s", 1), ("b1", 1), ("a0", 1), ("a1", 1), ("t", 1), ("b0", 1), ("a2", 1), ("a4", 1)]
    on, off, ref, meta = run_both(pool, work, shape, CascadePolicy(min_prefix=40, min_saved_tokens=40), in_place)
    assert _groups(meta) == [(5, 288), (2, 48)] if grouped else meta.cascade is None
    torch.testing.assert_close(on.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(off.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(on, off, atol=1e-5, rtol=0)
    # All requests in one group, in batch order: the path without any row shuffling.
    on, off, ref, meta = run_both(pool, [(f"a{i}", 1) for i in range(5)], shape, in_place=in_place)
    if grouped:
        assert _groups(meta) == [(5, 288)] and meta.cascade is not None and meta.cascade.rows is None
    torch.testing.assert_close(on.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: f"{s.num_heads}h{s.num_kv_heads}kv{s.head_dim}d")
def test_mixed_prefill_and_decode_groups_match(shape: AttentionShape, page_size: int) -> None:
    pool = SlotPool(shape, page_size, scattered=True, seed=1)
    pool.cached("sys", 160)  # a cached system prompt, itself still decoding
    pool.cached("q1", 176, "sys", 160)  # a question already past its first chunk
    pool.cached("q5", 161, "sys", 160)  # one own cached token: the smallest non-causal own mask
    for rid in ("q2", "q3", "q4"):
        pool.cached(rid, 160, "sys", 160)  # new questions: the cache matched the whole system prompt
    pool.cached("d0", 96)
    pool.cached("d1", 97, "d0", 96)
    pool.cached("lone", 40)
    work = [("q2", 30), ("sys", 1), ("lone", 12), ("q3", 1), ("d1", 1), ("q1", 9), ("fresh", 17), ("q4", 5),
            ("d0", 1), ("q5", 4)]
    on, off, ref, meta = run_both(pool, work, shape)
    assert _groups(meta) == [(30 + 1 + 1 + 9 + 5 + 4, 160), (2, 96)]
    # every row's own part, the four chunks' (5 to 30 positions) and the four decode rows', in one call of the
    # in-place kernel: a table row per member of either group
    assert meta.cascade is not None and meta.cascade.own is not None and len(meta.cascade.own.table) == 8
    torch.testing.assert_close(on.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(on, off, atol=1e-5, rtol=0)
    # Prefill chunks only (many short suffixes over one cached prefix), the benchmark's shape.
    pool.cached("root", 128)
    for i in range(6):
        pool.cached(f"u{i}", 128, "root", 128)
    on, off, ref, meta = run_both(pool, [(f"u{i}", 5 + i) for i in range(6)], shape)
    assert _groups(meta) == [(sum(5 + i for i in range(6)), 128)]
    assert meta.cascade is not None and meta.cascade.own is not None
    torch.testing.assert_close(on.double(), ref, atol=1e-5, rtol=0)
    # own parts longer than OWN_CHUNKS_MAX: one call per chunk, the same answer
    for i in range(2):
        pool.cached(f"w{i}", 128, "root", 128)
    on, off, ref, meta = run_both(pool, [("w0", OWN_CHUNKS_MAX + 1), ("w1", 3)], shape)
    assert meta.cascade is not None and meta.cascade.own is None
    torch.testing.assert_close(on.double(), ref, atol=1e-5, rtol=0)


def test_bf16_pool_and_generic_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 KV (fp32 merge) is as close to the reference as the plain path; the explicit-math path that
    non-CPU devices use gives the same numbers as the CPU kernel."""
    shape = SHAPES[0]
    pool = SlotPool(shape, 16, dtype=torch.bfloat16, scattered=True, seed=2)
    pool.cached("p", 256)
    for i in range(4):
        pool.cached(f"r{i}", 256 + 16 * i + 3, "p", 256)
    work = [("r0", 7), ("p", 1), ("r1", 1), ("r2", 1), ("r3", 1)]
    on, off, ref, meta = run_both(pool, work, shape)
    assert on.dtype == torch.bfloat16 and _groups(meta) == [(11, 256)]
    err_on, err_off = (on.double() - ref).abs().max().item(), (off.double() - ref).abs().max().item()
    assert err_on <= max(2 * err_off, 1e-2), (err_on, err_off)

    monkeypatch.setattr(cascade, "_CPU_FLASH", None)
    pool = SlotPool(shape, 1, seed=3)
    pool.cached("p", 200)
    pool.cached("r", 230, "p", 200)
    on, _, ref, meta = run_both(pool, [("p", 1), ("r", 6), ("x", 4)], shape)
    assert _groups(meta) == [(7, 200)]
    torch.testing.assert_close(on.double(), ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- full model
def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _share(driver: PoolDriver, src: str, dst: str, n: int) -> None:
    """``dst`` starts with ``src``'s first ``n`` tokens, in the same KV slots (a radix cache hit)."""
    row = driver.table.alloc()
    driver.table.write(row, 0, driver.table.table[driver.rows[src], :n].clone())
    driver.rows[dst], driver.lens[dst], driver.tokens[dst] = row, n, driver.tokens[src][:n]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_model_over_shared_prefix_matches_hf(hf_checkpoints, arch: str, page_size: int) -> None:
    hf, folder = hf_checkpoints[arch]
    backend = TorchNativeBackend(attention_shape(load_config(folder)), cascade=CascadePolicy(8, 8))
    model, _ = load_model(folder, dtype=torch.float32, attn_backend=backend)
    driver = PoolDriver(model, page_size=page_size)
    shared = 48 if page_size == 16 else 45
    driver.run([("sys", _ids(1, 48))])
    for rid in ("a", "b", "c"):
        _share(driver, "sys", rid, shared)
    work = [("a", _ids(2, 7)), ("sys", _ids(3, 1)), ("x", _ids(4, 9)), ("b", _ids(5, 1)), ("c", _ids(6, 12))]
    ours: dict[str, list[tuple[int, torch.Tensor]]] = {rid: [] for rid, _ in work}  # (first position, logits)
    for step in range(4):  # one mixed batch (suffix prefills + decodes under the prefix), then decodes
        fb = driver.batch(work)
        logits = torch.split(model.compute_logits(model.forward(fb)), fb.extend_lens_cpu)
        meta = fb.attn_metadata
        # decode batches group where the backend's rule says they pay (else the in-place kernel shares the ranges)
        if step == 0 or backend.groups_pay(fb):
            assert meta.cascade is not None and [p.prefix_len for p in meta.cascade.shared] == [shared]
        else:
            assert meta.cascade is None
        for (rid, _), got, pre in zip(work, logits, fb.prefix_lens_cpu):
            ours[rid].append((pre, got))
        work = [(rid, [int(got[-1].argmax())]) for (rid, _), got in zip(work, logits)]
    for rid, steps in ours.items():
        ref = hf_logits(hf, driver.tokens[rid])
        for pre, got in steps:
            torch.testing.assert_close(got, ref[pre : pre + len(got)], atol=1e-4, rtol=0,
                                       msg=f"{arch} {rid} positions {pre}..")
