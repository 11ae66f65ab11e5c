"""Attention in plain torch: gather each request's KV from the pool, run ``scaled_dot_product_attention``.

Works on any device, and is the correctness oracle for the fused GPU backends. On the CPU, decode rows and
short prefill chunks read the pool in place through ``paged_decode.py`` when its kernels build; the gather
paths below are the fallback there and the path on other devices. Two shapes of work:

* **Decode rows** (requests adding one token) are batched into ONE SDPA call per layer: their KV slots
  form a padded ``[B, L]`` index matrix; padding points at slot 0 (the reserved page, always readable) and
  is hidden by an additive key mask.
* **Prefill chunks** (requests adding several tokens over a possibly cached prefix) get one SDPA call
  each: new token ``i`` sees KV positions ``<= prefix_len + i`` (plain ``is_causal`` when there is no
  prefix, an explicit ``[E, S]`` mask otherwise).

Requests whose KV starts with the same slots (one cached prefix under many requests) are instead planned
as **cascade groups** (``cascade.py``): the shared prefix is gathered once per layer and attended by all
the group's new tokens in one call; each request then attends only its own KV positions ``P ..`` with the
same decode / prefill batching as above, and the two parts are merged by log-sum-exp.

GQA never materialises repeated KV. For decode the ``G = H / Hkv`` query heads of a KV head become the
query *length* (q ``[B, Hkv, G, D]`` against k ``[B, Hkv, L, D]``); for prefill k/v get a stride-0 group
dimension (``expand``), which the CPU SDPA kernel reads in place; for a shared prefix the KV head is the
batch and all query heads of all the group's tokens are rows. All measured fastest on the 2-core
development machine, as was gathering from a 2-D ``[slots, Hkv*D]`` view (3-D ``index_select`` with
scattered indices is ~9x slower there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radix.kv_int8 import dequantize_slots
from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.attention.cascade import (
    CascadePolicy,
    SharedPrefixFinder,
    attention_with_lse,
    merge_attention_,
)
from runtime.attention.paged_decode import paged_decode_kernel
from runtime.attention.torch_native_plan import (
    CascadePlan,
    DecodeGroup,
    KeptPrefix,
    PrefillChunk,
    TorchNativeMetadata,
    plan_batch,
)
from runtime.core.forward_batch import ForwardBatch, ForwardMode

# Prefill chunks of up to this many tokens read the pool in place (paged_decode.py) instead of gathering it:
# the gather costs the whole prefix once per layer, which a short chunk cannot amortise. Chunks of any length
# do where the pool is bf16 and the GEMM kernel is built (``PagedDecodeKernel.gemm``).
IN_PLACE_EXTEND_MAX = 64


@dataclass(frozen=True)
class SharedRead:
    """A cascade group's shared prefix as a decode batch reads it in place: the group's rows ``start .. end - 1``,
    the prefix's slots, and per layer the packed prefix kept for it (None: packed per call)."""

    start: int
    end: int
    slots: torch.Tensor
    packs: list[list[torch.Tensor] | None]


@dataclass(frozen=True)
class InPlaceDecode:
    """What every layer's attention reads for a batch the native decode stack takes
    (:meth:`TorchNativeBackend.decode_in_place`): row t's own KV slots ``kv_index[row_index[t]]`` (row_index None:
    row t) up to ``lengths[t]`` (after its group's shared prefix, for rows in a group), and the shared prefixes."""

    kv_index: torch.Tensor
    lengths: torch.Tensor
    row_index: torch.Tensor | None
    shared: list[SharedRead]


class TorchNativeBackend(AttentionBackend):
    """SDPA over KV gathered through ``batch.req_to_token`` (see the module docstring).

    ``cascade`` sets when requests sharing a cached prefix are attended as a group; ``None`` turns
    grouping off (every request gathers its whole KV).
    """

    name = "torch_native"

    def __init__(self, shape: AttentionShape, device: torch.device | str = "cpu",
                 cascade: CascadePolicy | None = CascadePolicy(),  # noqa: B008 (frozen, shared)
                 in_place_decode: bool = True):
        super().__init__(shape)
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"{shape.num_heads} query heads is not a multiple of "
                             f"{shape.num_kv_heads} kv heads")
        self.device = torch.device(device)
        self.group = shape.num_heads // shape.num_kv_heads
        # one finder per backend: it carries a decode wave's groups from one step to the next
        self._groups = SharedPrefixFinder(cascade) if cascade is not None else None
        # Decode rows read the paged pool in place when the CPU kernels build (paged_decode.py).
        self.paged = paged_decode_kernel(shape, self.device) if in_place_decode else None
        # Gather buffers reused by every layer and step. Fresh multi-MB tensors per layer cost page faults
        # (the allocator hands big blocks back to the OS): on the dev VM that doubled batch-32 decode time.
        self._workspace: dict[str, torch.Tensor] = {}
        # the last plan, and the kept prefixes it was made with (see plan)
        self._last_plan: tuple[list[KeptPrefix], TorchNativeMetadata] | None = None

    # ------------------------------------------------------------------ planning
    def plan(self, batch: ForwardBatch) -> None:
        paged, last = self.paged, self._last_plan
        # the last batch's shared prefixes still packed: a prompt alone under one becomes a group of one over them
        before = last[1].cascade if last is not None else None
        kept = [KeptPrefix(p.prefix_len, p.reuse_key) for p in (before.shared if before is not None else [])
                if paged is not None and p.reuse_key is not None and paged.kept(p.reuse_key)]
        finder = self._groups if self.groups_pay(batch) else None
        plan_batch(batch, finder, kept, last[1] if last is not None and last[0] == kept else None)
        self._last_plan = (kept, batch.attn_metadata)
        if paged is not None:  # packed prefixes this batch does not share are dropped
            casc = batch.attn_metadata.cascade
            paged.keep_packed({p.reuse_key for p in casc.shared} if casc is not None else set())

    def groups_pay(self, batch: ForwardBatch) -> bool:
        """Whether this batch's requests that share a cached prefix are worth grouping (the policy then says which).

        Not a decode batch whose shared parts would go through SDPA (no GEMM kernel for its pool: an fp32 or int8
        pool, or any pool on a CPU without AVX512_BF16). There grouped rows stay out of the native decode stack, and
        an int8 pool's prefix is dequantised in every layer, while the in-place kernel attends rows that hold the
        same slots over a range in one call, fetching the range once for all of them. `radixserve bench profile`
        on a 2-core Zen 3 host, grouping alternated: over an int8 pool the batch-8 few-shot decode step took 59-70
        ms grouped, 40 ms not; over an fp32 pool, before the kernel shared ranges, 45-50 ms grouped and 41-44 not.
        Mixed steps, whose prompts attend the shared block together, keep their groups (int8: 500-550 ms grouped,
        560-650 not)."""
        paged = self.paged
        return paged is None or batch.mode is not ForwardMode.DECODE or paged.gemm_shared(batch.kv.shape.dtype)

    def decode_in_place(self, batch: ForwardBatch) -> InPlaceDecode | None:
        """For a planned batch whose rows read the pool in place and whose new K/V rows the store kernel takes: decode
        rows all outside cascade groups, or all rows inside groups whose shared prefixes go through the GEMM kernel
        (decode rows, and prefill chunks where the plan attends every row's own part in one call: a question admitted
        beside the decode rows of its few-shot block): what :meth:`forward` reads for them, in every layer; else
        None."""
        meta = batch.attn_metadata
        if self.paged is None or not isinstance(meta, TorchNativeMetadata) or meta.prefills:
            return None
        if not self.paged.takes_slots(batch.out_cache_loc):
            return None
        casc = meta.cascade
        if casc is None:
            alone = self._decode_rows(meta.decode)
            return InPlaceDecode(alone[0], alone[1], None, []) if alone is not None else None
        # every row in a group, in order (then meta.decode is None): see forward. kv.shape.dtype: the dtype the rows
        # reach the kernel in (an int8 pool's converted as they are packed)
        if meta.decode is not None or casc.rows is not None or not self.paged.gemm_shared(batch.kv.shape.dtype):
            return None
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None
        if casc.prefills:  # the rows' own parts as _cascade_own attends them: one call over the plan's table
            rows = (casc.own.table, casc.own.lengths, casc.own.member) if casc.own is not None else None
        else:
            rows = self._decode_rows(casc.decode)
        if rows is None:  # declined before the packs are looked up (or made)
            return None
        # where nothing is kept (over the budget) the stack's kernel packs the prefix from the pool, int8 or bf16
        shared = [SharedRead(p.start, p.end, p.slots, self.paged.layer_packs(batch.kv, p.slots, p.reuse_key))
                  for p in casc.shared]
        kv_index, lengths, row_index = rows
        return InPlaceDecode(kv_index, lengths, row_index, shared)

    @staticmethod
    def _decode_rows(dec: DecodeGroup | None) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """A decode group's own reads as the stack takes them (``kv_index [B, L]``, ``lengths``, no row index), where
        its rows are the batch's in order and their lengths are known; else None."""
        if dec is None or dec.token_rows is not None or dec.lengths is None:
            return None
        return dec.kv_index.view(dec.batch_size, -1), dec.lengths, None

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        kv = batch.kv
        # 2-D views of this layer's pool: row gathers of [Hkv*D] are memcpy-fast.
        k_pool = kv.k(layer_id).view(kv.total_slots, -1)
        v_pool = kv.v(layer_id).view(kv.total_slots, -1)
        if self.paged is None or not self.paged.store(k_pool, v_pool, batch.out_cache_loc, k, v):
            kv.set_kv(layer_id, batch.out_cache_loc, k, v)
        meta: TorchNativeMetadata = batch.attn_metadata
        in_dtype = q.dtype
        if q.dtype != kv.shape.dtype:
            q = q.to(kv.shape.dtype)

        dec, casc = meta.decode, meta.cascade
        if casc is None and dec is not None and dec.token_rows is None:  # pure decode: the whole output at once
            return self._decode(q, k_pool, v_pool, dec).to(in_dtype)
        if casc is not None and casc.rows is None:  # every row is in a cascade group, in order
            return self._cascade(q, k_pool, v_pool, casc, layer_id).to(in_dtype)
        out = q.new_empty(q.shape[0], self.shape.num_heads, self.shape.head_dim)
        if dec is not None and dec.token_rows is not None:
            out.index_copy_(0, dec.token_rows, self._decode(q.index_select(0, dec.token_rows),
                                                            k_pool, v_pool, dec))
        for chunk in meta.prefills:
            self._prefill(q[chunk.start : chunk.end], k_pool, v_pool, chunk, out[chunk.start : chunk.end])
        if casc is not None and casc.rows is not None:
            out.index_copy_(0, casc.rows, self._cascade(q.index_select(0, casc.rows), k_pool, v_pool, casc, layer_id))
        return out.to(in_dtype)

    def _gather(self, pool: torch.Tensor, index: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` of a 2-D pool view as ``[n, Hkv * D]`` in ``dtype``: copied into the reusable workspace
        ``name``, then, from an int8 pool, dequantised (:meth:`_plain`)."""
        return self._plain(self._gather_stored(pool, index, name), dtype)

    def _plain(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pool rows ``[n, Hkv * row_dim]`` as ``[n, Hkv * D]`` in ``dtype``: the same tensor unless they are int8."""
        return dequantize_slots(rows, self.shape.num_kv_heads, dtype) if rows.dtype == torch.int8 else rows

    def _gather_stored(self, pool: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
        """Rows ``index`` of a 2-D pool view, copied as stored into the reusable workspace ``name``."""
        rows, cols = index.numel(), pool.shape[1]
        size = rows * cols
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < size or buf.dtype != pool.dtype or buf.device != pool.device:
            # Headroom so contexts growing by a token per step do not reallocate every step.
            buf = torch.empty(size + size // 4 + cols * 64, dtype=pool.dtype, device=pool.device)
            self._workspace[name] = buf
        out = buf[:size].view(rows, cols)
        return torch.index_select(pool, 0, index, out=out)

    def _decode_kv(self, k_pool: torch.Tensor, v_pool: torch.Tensor, dec: DecodeGroup,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode group's padded K and V in ``dtype`` as ``[B, Hkv, L, D]`` views (of the workspace, unless
        dequantised)."""
        b, hkv, d = dec.batch_size, self.shape.num_kv_heads, self.shape.head_dim
        k = self._gather(k_pool, dec.kv_index, "k", dtype).view(b, dec.max_len, hkv, d).transpose(1, 2)
        v = self._gather(v_pool, dec.kv_index, "v", dtype).view(b, dec.max_len, hkv, d).transpose(1, 2)
        return k, v

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                dec: DecodeGroup) -> torch.Tensor:
        """q ``[B, H, D]`` -> ``[B, H, D]``, one SDPA call with the G query heads of a KV head as rows."""
        b, hkv, d = dec.batch_size, self.shape.num_kv_heads, self.shape.head_dim
        if self.paged is not None and dec.lengths is not None:
            out, _lse = self.paged.run(q, k_pool, v_pool, dec.kv_index.view(b, -1), dec.lengths)
            return out.to(q.dtype)
        k, v = self._decode_kv(k_pool, v_pool, dec, q.dtype)
        o = F.scaled_dot_product_attention(q.reshape(b, hkv, self.group, d), k, v, attn_mask=dec.mask,
                                           scale=self.shape.scale)
        return o.reshape(b, self.shape.num_heads, d)  # SDPA may return a transposed layout

    def _prefill_qkv(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[Hkv, G, E, D]`` queries against ``[Hkv, G (stride 0), S, D]`` keys/values of one chunk."""
        e, s = q.shape[0], chunk.kv_index.numel()
        hkv, g, d = self.shape.num_kv_heads, self.group, self.shape.head_dim
        k = self._gather(k_pool, chunk.kv_index, "k", q.dtype).view(s, hkv, d).transpose(0, 1)
        v = self._gather(v_pool, chunk.kv_index, "v", q.dtype).view(s, hkv, d).transpose(0, 1)
        q4 = q.reshape(e, hkv, g, d).permute(1, 2, 0, 3)
        return q4, k.unsqueeze(1).expand(hkv, g, s, d), v.unsqueeze(1).expand(hkv, g, s, d)

    def _extend_in_place(self, q: torch.Tensor, pool: torch.Tensor) -> bool:
        """Whether a prefill chunk of new tokens ``q`` reads the pool in place (``paged.extend``)."""
        tokens = q.shape[0]
        return self.paged is not None and (tokens <= IN_PLACE_EXTEND_MAX
                                           or self.paged.gemm(tokens, self.paged.rows_dtype(pool, q)))

    def _prefill(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, chunk: PrefillChunk,
                 out: torch.Tensor) -> None:
        """q ``[E, H, D]`` of one request; writes ``[E, H, D]`` into ``out``."""
        e, hkv, g, d = q.shape[0], self.shape.num_kv_heads, self.group, self.shape.head_dim
        if self._extend_in_place(q, k_pool):
            assert self.paged is not None
            o_rows, _lse = self.paged.extend(q, k_pool, v_pool, chunk.kv_index, chunk.kv_index.numel() - e)
            out.copy_(o_rows)
            return
        q4, k4, v4 = self._prefill_qkv(q, k_pool, v_pool, chunk)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                           scale=self.shape.scale)
        out.view(e, hkv, g, d).copy_(o.permute(2, 0, 1, 3))

    # ------------------------------------------------------------------ cascade groups
    def _cascade(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 casc: CascadePlan, layer_id: int) -> torch.Tensor:
        """q ``[R, H, D]`` (the cascade rows) -> ``[R, H, D]``: own parts, then each group's shared part
        merged into its rows in place."""
        out, lse = self._cascade_own(q, k_pool, v_pool, casc)
        hkv, g, d = self.shape.num_kv_heads, self.group, self.shape.head_dim
        for part in casc.shared:
            p, n = part.prefix_len, part.end - part.start
            if self.paged is not None and self.paged.gemm_shared(self.paged.rows_dtype(k_pool, q)):  # bf16 GEMMs
                o_sh, lse_sh = self.paged.shared(q[part.start : part.end], k_pool, v_pool, part.slots, layer_id,
                                                 part.reuse_key)
                self.paged.merge(out[part.start : part.end], lse[part.start : part.end], o_sh, lse_sh)
                continue
            if part.kv_start is not None:
                k = self._plain(k_pool.narrow(0, part.kv_start, p), q.dtype)
                v = self._plain(v_pool.narrow(0, part.kv_start, p), q.dtype)
            else:
                k, v = self._gather(k_pool, part.slots, "k", q.dtype), self._gather(v_pool, part.slots, "v", q.dtype)
            # KV head = batch; the G heads of all n tokens are the rows: [1, Hkv, n*G, D] vs [1, Hkv, P, D].
            q4 = q[part.start : part.end].reshape(n, hkv, g, d).transpose(0, 1).reshape(1, hkv, n * g, d)
            o_sh, lse_sh = attention_with_lse(q4, k.view(1, p, hkv, d).transpose(1, 2),
                                              v.view(1, p, hkv, d).transpose(1, 2), None, False, self.shape.scale)
            # Merge in the [n, Hkv, G] layout: views on both sides, no copies.
            merge_attention_(out[part.start : part.end].view(n, hkv, g, d), lse[part.start : part.end].view(n, hkv, g),
                             o_sh.view(hkv, n, g, d).transpose(0, 1), lse_sh.view(hkv, n, g).transpose(0, 1))
        return out

    def _cascade_own(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     casc: CascadePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Each cascade row's attention over its request's own KV (positions P ..) and its log-sum-exp:
        ``[R, H, D]`` and ``[R, H]`` fp32, both contiguous (the merge writes into them)."""
        r, h, d = casc.num_rows, self.shape.num_heads, self.shape.head_dim
        if casc.own is not None and self.paged is not None:  # decode rows and short chunks: one call for all rows
            o, lse = self.paged.run(q, k_pool, v_pool, casc.own.table, casc.own.lengths, casc.own.member)
            return o.contiguous(), lse.contiguous()
        dec = casc.decode
        if dec is not None and dec.token_rows is None and not casc.prefills:  # all rows decode, in order
            o, lse = self._decode_lse(q, k_pool, v_pool, dec)
            return o.contiguous(), lse.contiguous()
        out = q.new_empty(r, h, d)
        lse_out = torch.empty(r, h, dtype=torch.float32, device=q.device)
        if dec is not None:
            rows = dec.token_rows
            o, lse = self._decode_lse(q if rows is None else q.index_select(0, rows), k_pool, v_pool, dec)
            if rows is None:
                out.copy_(o)
                lse_out.copy_(lse)
            else:
                out.index_copy_(0, rows, o)
                lse_out.index_copy_(0, rows, lse)
        hkv, g = self.shape.num_kv_heads, self.group
        for chunk in casc.prefills:
            e = chunk.end - chunk.start
            if self._extend_in_place(q[chunk.start : chunk.end], k_pool):  # a question after its shared few-shot block
                assert self.paged is not None
                o_rows, lse_rows = self.paged.extend(q[chunk.start : chunk.end], k_pool, v_pool, chunk.kv_index,
                                                     chunk.kv_index.numel() - e)
                out[chunk.start : chunk.end].copy_(o_rows)
                lse_out[chunk.start : chunk.end].copy_(lse_rows)
                continue
            q4, k4, v4 = self._prefill_qkv(q[chunk.start : chunk.end], k_pool, v_pool, chunk)
            o, lse = attention_with_lse(q4, k4, v4, chunk.mask, chunk.mask is None, self.shape.scale)
            out[chunk.start : chunk.end].view(e, hkv, g, d).copy_(o.permute(2, 0, 1, 3))
            lse_out[chunk.start : chunk.end].view(e, hkv, g).copy_(lse.permute(2, 0, 1))
        return out, lse_out

    def _decode_lse(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    dec: DecodeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Like ``_decode``, also returning the log-sum-exp ``[B, H]`` (fp32) for the cascade merge."""
        b, hkv, d = dec.batch_size, self.shape.num_kv_heads, self.shape.head_dim
        if self.paged is not None and dec.lengths is not None:
            out, lse = self.paged.run(q, k_pool, v_pool, dec.kv_index.view(b, -1), dec.lengths)
            return out.to(q.dtype), lse
        k, v = self._decode_kv(k_pool, v_pool, dec, q.dtype)
        o, lse = attention_with_lse(q.reshape(b, hkv, self.group, d), k, v, dec.mask, False, self.shape.scale)
        return o.reshape(b, self.shape.num_heads, d), lse.reshape(b, self.shape.num_heads)
