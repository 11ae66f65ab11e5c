"""Decode attention that reads the paged KV pool in place (``runtime/kernels/fastcpu.cpp``).

The gather path of ``torch_native`` copies every decoding request's KV into a padded batch before SDPA; at
batch 32 over 1k-token contexts that copy cost more than the attention. This kernel walks each request's
slot indices instead, so the KV is read once, where it lives. Used by ``torch_native`` on the CPU for decode
rows and for short prefill chunks over a long cached prefix (a few-shot question after its shared block:
gathering the whole prefix for a handful of new tokens cost more than attending it), whenever the kernels
build (a C++ compiler is present); otherwise the gather path runs and the reason is logged once.

Chunks of many new tokens over a bf16 pool (a prefill, over a cached prefix or not) go to
``extend_attention`` instead where the CPU has AVX512_BF16 (``fastcpu_extend.cpp``): it packs the prefix once
per KV head and runs the scores and the value sum as bf16 GEMMs, where the decode kernel passes over the prefix
once per few query heads and SDPA needs a gathered copy; and the tokens of a cascade group against their shared
prefix (``gemm_shared``). A 130-token chunk over a 1k-token prefix measured 1.5 ms per layer against 3.2 (SDPA)
and 3.7-4.3 (the decode kernel) (``benchmarks/bench_extend.py``); its error against float64 on the default model's
own activations equals SDPA's once both are rounded to bf16. Below ``GEMM_EXTEND_MIN`` tokens (verified drafts
among them) the decode kernel runs, whose result per token does not depend on the tokens beside it. A cascade
group's packed prefix is kept across batches under the planner's reuse key (:meth:`PagedDecodeKernel.shared`),
so a group's decode steps pack it once.

An int8 pool (``--kv-cache-dtype int8``, ``radix/kv_int8.py``) is read by the decode kernel as stored (each row's
scale applied to its score and its weight) and written by ``store_kv``, which quantises. For a bf16 model the GEMM
kernel reads it too, converting each row to bf16 (the bits torch's dequantisation gives) as it packs the rows: a long
chunk's prefix per call, a cascade group's shared prefix once into the pack kept for the group, so its decode steps
read the pack as a bf16 pool's group does. An fp32 model's long chunks and shared prefixes take the gather path,
which dequantises what it gathers.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Hashable
from typing import Any

import torch

from radix.hugepages import ALIGN, HugePageArena, MappingPool, huge_pages_mode
from radix.kv_storage import KVStorage
from runtime.attention.base import AttentionShape
from runtime.kernels import kernel_input

logger = logging.getLogger(__name__)

# Chunks of at least this many new tokens over a bf16 pool take the GEMM kernel where it is built: at 8 tokens
# the two kernels were even, at 16 the GEMM one was ~2x faster alone and 0.98-1.14x in whole prefill steps
# (SmolLM2's 3 x 3 heads, 1k-token prefix). Shorter chunks are verified drafts more often than prompts.
GEMM_EXTEND_MIN = 16
# Packed shared prefixes kept across steps (:meth:`PagedDecodeKernel.shared`), at most this many bytes: SmolLM2's
# 1,000-token few-shot block takes ~24 MB over its 30 layers. Beyond it prefixes are packed per call, as before.
PACKED_PREFIX_BYTES = 64 * 2**20


class PagedDecodeKernel:
    def __init__(self, shape: AttentionShape, kernels: Any):
        self.shape = shape
        self.kernels = kernels
        self.bf16_gemm = bool(kernels.bf16_dot()) and shape.head_dim in (64, 128)
        # reuse key -> (layer, pool address) -> pack_prefix's (K, V); see shared()
        self._packed: dict[Hashable, dict[tuple[int, int], list[torch.Tensor]]] = {}
        self._packed_bytes = 0
        # reuse key -> (the pool's layer-0 K and V addresses, every layer's pack): see layer_packs()
        self._stacks: dict[Hashable, tuple[tuple[int, int], list[list[torch.Tensor] | None]]] = {}
        # huge pages of forgotten groups' packs, reused for the next group's (see _on_huge_pages): at most the
        # budget's worth kept idle
        self._pack_memory = MappingPool(keep_bytes=PACKED_PREFIX_BYTES)

    @property
    def kept_keys(self) -> set[Hashable]:
        """The reuse keys under which packed prefixes are kept now (layer by layer, or as a stack's list)."""
        return set(self._packed) | set(self._stacks)

    @property
    def pack_pages_mapped(self) -> int:
        """Bytes of huge pages mapped for kept packs over this kernel's life (pages handed out again not counted)."""
        return self._pack_memory.mapped

    def kept(self, reuse: Hashable) -> dict[tuple[int, int], list[torch.Tensor]]:
        """The packs kept under ``reuse``: (layer, pool address) -> pack_prefix's (K, V); empty when none."""
        return dict(self._packed.get(reuse, {}))

    def keep_packed(self, keys: Collection[Hashable]) -> None:
        """Forget the packed prefixes whose reuse key is not in ``keys`` (those of the batch about to run)."""
        for key in [k for k in self._packed if k not in keys]:
            self._packed_bytes -= sum(t.nbytes for pair in self._packed.pop(key).values() for t in pair)
            self._stacks.pop(key, None)

    def gemm(self, tokens: int, dtype: torch.dtype) -> bool:
        """Whether a prefill chunk of ``tokens`` tokens whose KV rows reach the kernel in ``dtype``
        (:meth:`rows_dtype`) takes the GEMM kernel."""
        return self.gemm_shared(dtype) and tokens >= GEMM_EXTEND_MIN

    @staticmethod
    def rows_dtype(pool: torch.Tensor, q: torch.Tensor) -> torch.dtype:
        """The dtype a pool's rows reach the GEMM kernel in: their own, or for an int8 pool the queries' (the kernel
        converts an int8 pool's rows to bf16 as it packs them, so bf16 queries take it: 1,024-token prefills ran at
        0.57-0.67x the speed through the gather path)."""
        return q.dtype if pool.dtype == torch.int8 else pool.dtype


    def gemm_shared(self, dtype: torch.dtype) -> bool:
        """Whether a cascade group's tokens attend their shared prefix through the GEMM kernel when its rows reach
        the kernel in ``dtype`` (:meth:`rows_dtype`): at any group size (2 decode rows over a 1k prefix: 0.07 ms per
        layer against SDPA's 0.13, 8 rows 0.13-0.16 against 0.23-0.27), since a group's results depend on its
        members anyway."""
        return self.bf16_gemm and dtype == torch.bfloat16

    @staticmethod
    def takes_slots(slots: torch.Tensor) -> bool:
        """Whether ``store_kv`` takes these slot numbers as they are (contiguous int64)."""
        return slots.dtype == torch.int64 and slots.is_contiguous()

    def store(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> bool:
        """Write new tokens' K and V ``[T, Hkv, D]`` into ``slots`` of one layer's 2-D pools in one kernel call
        (quantised there for an int8 pool); False (nothing written) where the kernel does not take them (another
        float dtype than the pool's, a layout other than contiguous heads), for the caller's general path."""
        if k.dtype != v.dtype or (k_pool.dtype != torch.int8 and k.dtype != k_pool.dtype):
            return False
        if not self.takes_slots(slots):
            return False
        if k.stride(2) != 1 or v.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2]:
            return False
        self.kernels.store_kv(k_pool, v_pool, slots, k, v)
        return True

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
            lengths: torch.Tensor, row_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``; pools ``[slots, Hkv * D]``; token t attends ``kv_index[row_index[t], :lengths[t]]``
        (``row_index`` None: row t; entries past a length are never read). Returns ``(out [T, H, D] in q's
        dtype, lse [T, H] fp32)``."""
        out, lse = self.kernels.decode_attention(kernel_input(q), k_pool, v_pool, kv_index, row_index, lengths,
                                                 self.shape.scale, self.shape.num_kv_heads)
        return out, lse

    def extend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
               prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A short chunk of E new tokens after ``prefix`` KV positions of one request (``kv_index [prefix + E]``):
        new token i attends positions ``0 .. prefix + i``, read in place."""
        e = q.shape[0]
        lengths = torch.arange(prefix + 1, prefix + e + 1, dtype=torch.int64)
        if self.gemm(e, self.rows_dtype(k_pool, q)):
            return self._gemm(q, k_pool, v_pool, kv_index, lengths)
        return self.run(q, k_pool, v_pool, kv_index.view(1, -1), lengths, torch.zeros(e, dtype=torch.int64))

    def shared(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
               layer: int = 0, reuse: Hashable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of q ``[T, H, D]`` attends all the slots ``kv_index [P]`` (a cascade group's shared
        prefix), through the GEMM kernel (only where :meth:`gemm_shared` holds). Returns ``(out [T, H, D] fp32,
        lse [T, H] fp32)``.

        ``reuse``: a key under which this layer's packed prefix is kept for later calls with the same key — the
        caller vouches that the slots and their KV are the same while the key is (the planner's key is the slots
        and how often their pages were freed, see ``torch_native_plan``). Packing was half the kernel's time for a
        batch of decode rows under a 1,000-token prefix; the group's next decode steps then skip it."""
        lengths = torch.full((q.shape[0],), kv_index.numel(), dtype=torch.int64)
        packed = self.prefix_pack(k_pool, v_pool, kv_index, layer, reuse, q.dtype)
        return self._gemm(q, k_pool, v_pool, kv_index, lengths, packed)

    def prefix_pack(self, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor, layer: int,
                    reuse: Hashable | None, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The packed prefix (pack_prefix's (K, V), in ``dtype``: the rows' :meth:`rows_dtype`) of one layer's slots
        ``kv_index`` kept under ``reuse``, packed now if it is not yet and the budget allows (an int8 pool's rows
        converted to bf16 by the kernel as it packs them); None where nothing is kept (no key, or over the budget)."""
        if reuse is None:
            return None
        layers = self._packed.setdefault(reuse, {})
        where = (layer, k_pool.data_ptr())
        packed = layers.get(where)
        if packed is None:
            padded = -(-kv_index.numel() // 32) * 32
            need = 2 * self.shape.num_kv_heads * padded * self.shape.head_dim * dtype.itemsize
            if self._packed_bytes + need <= PACKED_PREFIX_BYTES:
                packed = self.kernels.pack_prefix(k_pool, v_pool, kv_index, self.shape.num_kv_heads,
                                                  self.shape.head_dim)
                layers[where] = packed
                self._packed_bytes += need
        return packed

    def layer_packs(self, kv: KVStorage, slots: torch.Tensor,
                    reuse: Hashable | None) -> list[list[torch.Tensor] | None]:
        """Every layer's :meth:`prefix_pack` of the prefix ``slots`` of the pool ``kv`` (the native decode stack's
        input). Once every layer has its pack, the list is kept beside them: a cascade group's later decode steps
        take it in one lookup instead of thirty (0.12 ms of each batch-8 step went to those)."""
        pool = (kv.k(0).data_ptr(), kv.v(0).data_ptr())
        kept = self._stacks.get(reuse) if reuse is not None else None
        if kept is not None and kept[0] == pool:
            return kept[1]
        packs = [self.prefix_pack(kv.k(i).view(kv.total_slots, -1), kv.v(i).view(kv.total_slots, -1), slots, i, reuse,
                                  kv.shape.dtype) for i in range(kv.shape.num_layers)]
        if reuse is not None and all(pack is not None for pack in packs):
            packs = self._on_huge_pages(reuse, packs)
            self._stacks[reuse] = (pool, packs)
        return packs

    def _on_huge_pages(self, reuse: Hashable,
                       packs: list[list[torch.Tensor] | None]) -> list[list[torch.Tensor] | None]:
        """A group's complete packs copied into one huge-page arena, in place of the ones kept per layer. Every
        later step of the group reads all of them again, after the weights streamed in between have evicted
        them (24 MB for a 1,050-token block): on 4 KB pages that read misses the TLB on every page. The arena's
        memory comes from the pages of groups forgotten before it where it can: first touches of fresh huge pages
        cost this step ~1.2 ms per MB under the development VM."""
        if huge_pages_mode() == "never":
            return packs
        arena = HugePageArena(chunk=sum(t.nbytes + ALIGN for pack in packs if pack for t in pack),
                              pool=self._pack_memory)
        moved = {id(pack): [arena.place(t) for t in pack] for pack in packs if pack is not None}
        layers = self._packed[reuse]
        for where, pack in layers.items():
            layers[where] = moved.get(id(pack), pack)
        return [moved[id(pack)] if pack is not None else None for pack in packs]

    def merge(self, out: torch.Tensor, lse: torch.Tensor, o_shared: torch.Tensor, lse_shared: torch.Tensor) -> None:
        """A cascade group's rows: ``out`` ``[n, H, D]`` over their own KV (log-sum-exp ``lse`` ``[n, H]``) merged in
        place with :meth:`shared`'s result, in the kernel the native decode stack merges with (the same bits)."""
        self.kernels.merge_attention(out, lse, o_shared, lse_shared)

    def _gemm(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
              lengths: torch.Tensor, packed: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self.kernels.extend_attention(kernel_input(q), k_pool, v_pool, kv_index.reshape(-1), lengths,
                                                 self.shape.scale, self.shape.num_kv_heads, packed)
        return out, lse


def supported(shape: AttentionShape, dtype: torch.dtype | None = None) -> bool:
    return (shape.head_dim % 16 == 0 and shape.head_dim <= 256 and shape.num_heads // shape.num_kv_heads <= 16
            and dtype in (None, torch.float32, torch.bfloat16))


def paged_decode_kernel(shape: AttentionShape, device: torch.device) -> PagedDecodeKernel | None:
    """The in-place decode kernel for ``shape`` on ``device``, or None where it cannot run."""
    if device.type != "cpu" or not supported(shape):
        return None
    from runtime.kernels.build import optional_kernels

    kernels = optional_kernels("fastcpu")
    if kernels is None:
        logger.warning("decode attention gathers each request's KV into a padded copy (slower)")
        return None
    return PagedDecodeKernel(shape, kernels)
