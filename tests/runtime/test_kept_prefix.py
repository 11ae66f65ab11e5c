"""Cascade groups over a prefix whose packed KV the in-place kernels keep from an earlier batch
(``torch_native_plan._onto_kept``): a prompt alone under it becomes a group of one that reads the kept packs, a group
whose own longest prefix is a few positions longer shares the kept one, and neither happens once the prefix's pages
were freed. A decode wave's next step takes the last plan's groups and shared parts (``plan_batch``'s ``previous``)
and equals a plan made from scratch; any other batch is planned afresh. Outputs are checked against the gather path
(SDPA over the same slots) within bf16's precision."""

from __future__ import annotations

import pytest
import torch

from radix.allocator import PagedAllocator
from radix.kv_storage import KVShape, KVStorage
from runtime.attention.base import AttentionShape
from runtime.attention.cascade import CascadePolicy, SharedPrefixFinder
from runtime.attention.torch_native import TorchNativeBackend
from runtime.attention.torch_native_plan import KeptPrefix, TorchNativeMetadata, plan_batch
from runtime.config import aten_cpu_capability, cpu_flags
from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.kernels.build import load_kernels

pytestmark = [
    pytest.mark.skipif(not load_kernels("fastcpu").bf16_dot(),
                       reason="prefixes are packed and kept only where the bf16 GEMM kernel is built"),
    # the oracle, torch's bf16 SDPA, packs its operands for AMX with a routine only its AVX-512 kernels carry
    pytest.mark.skipif("amx_bf16" in cpu_flags() and aten_cpu_capability() != "AVX512",
                       reason="torch's bf16 SDPA needs its AVX-512 kernels on a CPU with AMX"),
]

SHAPE = AttentionShape(9, 3, 64)
BLOCK = 990  # the cached block every request starts with


class Pool:
    """One bf16 KV pool and its allocator (whose free counts key the kept packs), with a block of ``BLOCK`` slots
    cached under every request of the batches made here."""

    def __init__(self, seed: int = 11):
        self.gen = torch.Generator().manual_seed(seed)
        self.alloc = PagedAllocator(8192, page_size=16)
        self.kv = KVStorage(KVShape(1, SHAPE.num_kv_heads, SHAPE.head_dim, torch.bfloat16), 8192 + 16)
        for buffer in (self.kv.k_buffer, self.kv.v_buffer):
            buffer.copy_(torch.randn(buffer.shape, generator=self.gen).to(buffer.dtype))
        self.block = self.alloc.alloc(BLOCK)

    def batch(self, owns: list[tuple[int, int]]) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Requests under the block: (cached own tokens after it, new tokens) each; their own slots fresh."""
        width = BLOCK + max(c + e for c, e in owns) + 8
        table = torch.zeros(len(owns), width, dtype=torch.int64)
        for i, (cached, new) in enumerate(owns):
            table[i, : BLOCK + cached + new] = torch.cat([self.block, self.alloc.alloc(cached + new)])
        out_loc = torch.cat([table[i, BLOCK + c : BLOCK + c + e] for i, (c, e) in enumerate(owns)])
        batch = build_forward_batch([[1] * e for _, e in owns], [BLOCK + c for c, _ in owns], list(range(len(owns))),
                                    out_loc, self.kv, table, kv_history=self.alloc)
        return self.inputs(batch)

    def inputs(self, batch: ForwardBatch) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``batch`` with random q, k and v rows for its new tokens."""
        rows = batch.num_tokens
        q = torch.randn(rows, SHAPE.num_heads, SHAPE.head_dim, generator=self.gen).to(torch.bfloat16)
        k = torch.randn(rows, SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen).to(torch.bfloat16)
        v = torch.randn(rows, SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen).to(torch.bfloat16)
        return batch, q, k, v

    def moved_on(self, batch: ForwardBatch) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode batch after ``batch``: the same requests and table, each one token further, in a fresh slot."""
        table, seq = batch.req_to_token, batch.seq_lens_cpu
        out_loc = self.alloc.alloc(len(seq))
        for i, n in enumerate(seq):
            table[i, n] = out_loc[i]
        return self.inputs(build_forward_batch([[1]] * len(seq), seq, list(range(len(seq))), out_loc, self.kv, table,
                                               kv_history=self.alloc))


def run_both(fast: TorchNativeBackend, pool: Pool,
             owns: list[tuple[int, int]] | tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]
             ) -> TorchNativeMetadata:
    """Plan and run one batch (``owns`` for ``Pool.batch``, or a batch and its inputs) in ``fast`` and, over the same
    slots, in the gather path (which plans without kept prefixes); assert they agree. Returns ``fast``'s plan."""
    batch, q, k, v = pool.batch(owns) if isinstance(owns, list) else owns
    fast.plan(batch)
    meta = batch.attn_metadata
    assert fast.decode_in_place(batch) is not None  # every batch here is the native decode stack's
    got = fast.forward(q, k, v, 0, batch).float()
    gather = TorchNativeBackend(SHAPE, in_place_decode=False)
    gather.plan(batch)
    want = gather.forward(q, k, v, 0, batch).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    return meta


def shared_parts(meta: TorchNativeMetadata) -> list[tuple[int, int]]:
    """(rows, prefix length) of each cascade group of a plan."""
    casc = meta.cascade
    return [] if casc is None else [(p.end - p.start, p.prefix_len) for p in casc.shared]


def test_a_prompt_alone_under_a_kept_block_reads_its_packs_as_a_group_of_one() -> None:
    fast = TorchNativeBackend(SHAPE)
    assert fast.paged is not None
    wave = run_both(fast, pool := Pool(), [(10, 1), (12, 1), (15, 1), (20, 1)])  # four decode rows under the block
    assert shared_parts(wave) == [(4, BLOCK)]
    assert wave.cascade is not None
    key = wave.cascade.shared[0].reuse_key
    packs = fast.paged.kept(key)
    assert packs
    lone = run_both(fast, pool, [(0, 22)])  # the next question, alone
    assert shared_parts(lone) == [(22, BLOCK)]
    assert lone.cascade is not None and lone.cascade.shared[0].reuse_key == key
    after = fast.paged.kept(key)
    assert after.keys() == packs.keys() and all(after[w][0] is packs[w][0] for w in packs)  # read, not packed again


def test_a_group_whose_prefix_is_a_few_tokens_longer_shares_the_kept_one() -> None:
    fast = TorchNativeBackend(SHAPE)
    pool = Pool()
    run_both(fast, pool, [(10, 1), (12, 1), (15, 1), (20, 1)])
    # two questions whose first 3 tokens after the block are cached and shared: alone they would group at BLOCK + 3
    batch, q, k, v = pool.batch([(3, 20), (3, 25)])
    batch.req_to_token[1, BLOCK : BLOCK + 3] = batch.req_to_token[0, BLOCK : BLOCK + 3]
    fast.plan(batch)
    assert shared_parts(batch.attn_metadata) == [(45, BLOCK)]
    got = fast.forward(q, k, v, 0, batch).float()
    gather = TorchNativeBackend(SHAPE, in_place_decode=False)
    gather.plan(batch)
    assert shared_parts(batch.attn_metadata) == [(45, BLOCK + 3)]  # what the walk alone finds
    torch.testing.assert_close(got, gather.forward(q, k, v, 0, batch).float(), rtol=2e-2, atol=2e-2)


def test_nothing_is_grouped_over_a_block_whose_pages_were_freed_since() -> None:
    fast = TorchNativeBackend(SHAPE)
    pool = Pool()
    run_both(fast, pool, [(10, 1), (12, 1), (15, 1), (20, 1)])
    pool.alloc.free(pool.block)  # evicted, and its slots then hold whatever was cached there next
    batch, *_ = pool.batch([(0, 22)])
    fast.plan(batch)
    assert shared_parts(batch.attn_metadata) == []


def test_a_decode_waves_next_step_takes_the_last_plans_groups_and_plans_its_own_parts() -> None:
    fast = TorchNativeBackend(SHAPE)
    pool = Pool()
    run_both(fast, pool, [(10, 1), (12, 1), (15, 1), (20, 1)])  # the wave's packs, kept from here on
    batch, q, k, v = pool.batch([(11, 1), (13, 1), (16, 1), (21, 1)])
    steps = [run_both(fast, pool, (batch, q, k, v))]
    for _ in range(2):
        batch, q, k, v = pool.moved_on(batch)
        steps.append(run_both(fast, pool, (batch, q, k, v)))  # the same outputs as the gather path's
    before, now = steps[-2].cascade, steps[-1].cascade
    assert before is not None and now is not None
    assert now.shared is before.shared and now.groups == before.groups  # taken over, not planned again
    assert now.decode is not None and before.decode is not None and now.decode.max_len == before.decode.max_len + 1
    # what planning the step from scratch (a fresh finder, the same kept prefixes) gives
    kept = [KeptPrefix(p.prefix_len, p.reuse_key) for p in now.shared if p.reuse_key is not None]
    plan_batch(batch, SharedPrefixFinder(CascadePolicy()), kept)
    fresh = batch.attn_metadata.cascade
    assert fresh is not None and fresh.groups == now.groups and fresh.decode is not None
    assert [(p.start, p.end, p.prefix_len, p.kv_start, p.reuse_key) for p in fresh.shared] == [
        (p.start, p.end, p.prefix_len, p.kv_start, p.reuse_key) for p in now.shared]
    assert all(torch.equal(a.slots, b.slots) for a, b in zip(fresh.shared, now.shared))
    for name in ("kv_index", "lengths"):
        assert torch.equal(getattr(fresh.decode, name), getattr(now.decode, name))


def test_a_batch_that_is_not_the_last_one_moved_on_is_planned_afresh() -> None:
    fast = TorchNativeBackend(SHAPE)
    pool = Pool()
    run_both(fast, pool, [(10, 1), (12, 1), (15, 1), (20, 1)])
    last = run_both(fast, pool, [(11, 1), (13, 1), (16, 1), (21, 1)]).cascade  # planned with the same packs kept
    other = run_both(fast, pool, [(30, 1), (40, 1)])  # two other requests under the block
    assert other.cascade is not None and last is not None and other.cascade.shared is not last.shared
    assert shared_parts(other) == [(2, BLOCK)]
