"""Cascade groups over a prefix whose packed KV the in-place kernels keep from an earlier batch
(``torch_native_plan._onto_kept``): a prompt alone under it becomes a group of one that reads the kept packs, a group
whose own longest prefix is a few positions longer shares the kept one, and neither happens once the prefix's pages
were freed. Outputs are checked against the gather path (SDPA over the same slots) within bf16's precision."""

from __future__ import annotations

import pytest
import torch

from radix.allocator import PagedAllocator
from radix.kv_storage import KVShape, KVStorage
from runtime.attention.base import AttentionShape
from runtime.attention.torch_native import TorchNativeBackend
from runtime.attention.torch_native_plan import TorchNativeMetadata
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
        rows = sum(e for _, e in owns)
        q = torch.randn(rows, SHAPE.num_heads, SHAPE.head_dim, generator=self.gen).to(torch.bfloat16)
        k = torch.randn(rows, SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen).to(torch.bfloat16)
        v = torch.randn(rows, SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen).to(torch.bfloat16)
        return batch, q, k, v


def run_both(fast: TorchNativeBackend, pool: Pool, owns: list[tuple[int, int]]) -> TorchNativeMetadata:
    """Plan and run one batch in ``fast`` and, over the same slots, in the gather path (which plans without kept
    prefixes); assert they agree. Returns ``fast``'s plan."""
    batch, q, k, v = pool.batch(owns)
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
