"""Attention in plain torch: gather each request's KV from the pool, run ``scaled_dot_product_attention``.

Works on any device, and is the correctness oracle for the fused GPU backends. Two shapes of work:

* **Decode rows** (requests adding one token) are batched into ONE SDPA call per layer: their KV slots
  form a padded ``[B, L]`` index matrix; padding points at slot 0 (the reserved page, always readable) and
  is hidden by an additive key mask.
* **Prefill chunks** (requests adding several tokens over a possibly cached prefix) get one SDPA call
  each: new token ``i`` sees KV positions ``<= prefix_len + i`` (plain ``is_causal`` when there is no
  prefix, an explicit ``[E, S]`` mask otherwise).

GQA never materialises repeated KV. For decode the ``G = H / Hkv`` query heads of a KV head become the
query *length* (q ``[B, Hkv, G, D]`` against k ``[B, Hkv, L, D]``); for prefill k/v get a stride-0 group
dimension (``expand``), which the CPU SDPA kernel reads in place. Both measured fastest on the 2-core
development machine, as was gathering from a 2-D ``[slots, Hkv*D]`` view (3-D ``index_select`` with
scattered indices is ~9x slower there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.executor.forward_batch import ForwardBatch, ForwardMode

# Additive float masks measured ~15% faster than bool ones in the CPU SDPA kernel; above this many
# entries (a long chunk over a long prefix) memory wins and the mask is bool.
_FLOAT_MASK_LIMIT = 1 << 24


@dataclass
class DecodeGroup:
    """Requests that add one token each, attended together."""

    kv_index: torch.Tensor  # [B * L] pool slots, request-major; padding -> slot 0
    batch_size: int
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, L] additive (0 / -inf); None when all lengths are equal
    token_rows: torch.Tensor | None  # rows of these tokens in the batch; None = all rows, in order


@dataclass
class PrefillChunk:
    """One request adding ``end - start`` tokens after ``prefix_len`` cached ones."""

    start: int  # first row of its new tokens in the batch
    end: int
    kv_index: torch.Tensor  # [S] pool slots of positions 0 .. S-1 (S = prefix + new)
    mask: torch.Tensor | None  # [E, S] causal-with-prefix mask (additive, or bool when huge); None = causal


@dataclass
class TorchNativeMetadata:
    decode: DecodeGroup | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchNativeBackend(AttentionBackend):
    """SDPA over KV gathered through ``batch.req_to_token`` (see the module docstring)."""

    name = "torch_native"

    def __init__(self, shape: AttentionShape, device: torch.device | str = "cpu"):
        super().__init__(shape)
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"{shape.num_heads} query heads is not a multiple of "
                             f"{shape.num_kv_heads} kv heads")
        self.device = torch.device(device)
        self.group = shape.num_heads // shape.num_kv_heads
        # Gather buffers reused by every layer and step. Fresh multi-MB tensors per layer cost page faults
        # (the allocator hands big blocks back to the OS): on the dev VM that doubled batch-32 decode time.
        self._workspace: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ planning
    def plan(self, batch: ForwardBatch) -> None:
        """Build the slot-index tensors and masks once per batch (Python work per request, not per layer)."""
        dtype = batch.kv.shape.dtype
        if batch.batch_size == 0:
            batch.attn_metadata = TorchNativeMetadata()
            return
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = TorchNativeMetadata(
                decode=self._decode_group(batch, None, batch.req_pool_indices, batch.seq_lens, dtype))
            return
        meta = TorchNativeMetadata()
        single: list[int] = []
        single_rows: list[int] = []
        start = 0
        for i, (pre, ext) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
            if ext == 1:
                single.append(i)
                single_rows.append(start)
            elif ext > 1:
                meta.prefills.append(self._prefill_chunk(batch, i, start, pre, ext, dtype))
            start += ext
        if single:
            device = batch.seq_lens.device
            sel = torch.tensor(single, dtype=torch.int64, device=device)
            rows = torch.tensor(single_rows, dtype=torch.int64, device=device)
            meta.decode = self._decode_group(batch, [batch.seq_lens_cpu[i] for i in single],
                                             batch.req_pool_indices[sel], batch.seq_lens[sel], dtype, rows)
        batch.attn_metadata = meta

    @staticmethod
    def _decode_group(batch: ForwardBatch, lens_cpu: list[int] | None, req_rows: torch.Tensor,
                      seq_lens: torch.Tensor, dtype: torch.dtype,
                      token_rows: torch.Tensor | None = None) -> DecodeGroup:
        lens = batch.seq_lens_cpu if lens_cpu is None else lens_cpu
        max_len = max(lens)
        index = batch.req_to_token[req_rows, :max_len]
        mask = None
        if min(lens) != max_len:
            pad = torch.arange(max_len, device=index.device)[None, :] >= seq_lens[:, None]
            # Table entries past a request's length are stale; point them at the reserved slot 0.
            index = index.masked_fill(pad, 0)
            mask = torch.zeros(pad.shape, dtype=dtype, device=index.device).masked_fill_(pad, float("-inf"))
            mask = mask[:, None, None, :]
        return DecodeGroup(index.reshape(-1), len(lens), max_len, mask, token_rows)

    @staticmethod
    def _prefill_chunk(batch: ForwardBatch, i: int, start: int, prefix: int, ext: int,
                       dtype: torch.dtype) -> PrefillChunk:
        seq = prefix + ext
        index = batch.req_to_token[int(batch.req_pool_indices[i]), :seq]
        mask = None
        if prefix:
            device = index.device
            # New token j (position prefix + j) may see key positions 0 .. prefix + j.
            hidden = (torch.arange(seq, device=device)[None, :]
                      > torch.arange(prefix, seq, device=device)[:, None])
            if hidden.numel() > _FLOAT_MASK_LIMIT:
                mask = ~hidden  # bool (True = attend): 4x smaller than additive fp32, slightly slower
            else:
                mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
                mask.masked_fill_(hidden, float("-inf"))
        return PrefillChunk(start, start + ext, index, mask)

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        kv = batch.kv
        kv.set_kv(layer_id, batch.out_cache_loc, k, v)
        meta: TorchNativeMetadata = batch.attn_metadata
        in_dtype = q.dtype
        if q.dtype != kv.shape.dtype:
            q = q.to(kv.shape.dtype)
        # 2-D views of this layer's pool: row gathers of [Hkv*D] are memcpy-fast.
        k_pool = kv.k(layer_id).view(kv.total_slots, -1)
        v_pool = kv.v(layer_id).view(kv.total_slots, -1)

        dec = meta.decode
        if dec is not None and dec.token_rows is None:  # pure decode batch: the whole output at once
            return self._decode(q, k_pool, v_pool, dec).to(in_dtype)
        out = q.new_empty(q.shape[0], self.shape.num_heads, self.shape.head_dim)
        if dec is not None and dec.token_rows is not None:
            out.index_copy_(0, dec.token_rows, self._decode(q.index_select(0, dec.token_rows),
                                                            k_pool, v_pool, dec))
        for chunk in meta.prefills:
            self._prefill(q[chunk.start : chunk.end], k_pool, v_pool, chunk, out[chunk.start : chunk.end])
        return out.to(in_dtype)

    def _gather(self, pool: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
        """Rows ``index`` of a 2-D pool view, copied into the reusable workspace ``name``."""
        rows, cols = index.numel(), pool.shape[1]
        size = rows * cols
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < size or buf.dtype != pool.dtype or buf.device != pool.device:
            # Headroom so contexts growing by a token per step do not reallocate every step.
            buf = torch.empty(size + size // 4 + cols * 64, dtype=pool.dtype, device=pool.device)
            self._workspace[name] = buf
        out = buf[:size].view(rows, cols)
        return torch.index_select(pool, 0, index, out=out)

    def release_workspace(self) -> None:
        """Drop the gather buffers (they grow to the largest batch seen); they are rebuilt on demand."""
        self._workspace.clear()

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                dec: DecodeGroup) -> torch.Tensor:
        """q ``[B, H, D]`` -> ``[B, H, D]``, one SDPA call with the G query heads of a KV head as rows."""
        b, hkv, d = dec.batch_size, self.shape.num_kv_heads, self.shape.head_dim
        k = self._gather(k_pool, dec.kv_index, "k").view(b, dec.max_len, hkv, d).transpose(1, 2)
        v = self._gather(v_pool, dec.kv_index, "v").view(b, dec.max_len, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.reshape(b, hkv, self.group, d), k, v, attn_mask=dec.mask,
                                           scale=self.shape.scale)
        return o.reshape(b, self.shape.num_heads, d)  # SDPA may return a transposed layout

    def _prefill(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, chunk: PrefillChunk,
                 out: torch.Tensor) -> None:
        """q ``[E, H, D]`` of one request; writes ``[E, H, D]`` into ``out``."""
        e, s = q.shape[0], chunk.kv_index.numel()
        hkv, g, d = self.shape.num_kv_heads, self.group, self.shape.head_dim
        k = self._gather(k_pool, chunk.kv_index, "k").view(s, hkv, d).transpose(0, 1)
        v = self._gather(v_pool, chunk.kv_index, "v").view(s, hkv, d).transpose(0, 1)
        # [Hkv, G, E, D] queries against [Hkv, G(stride 0), S, D] keys/values.
        q4 = q.reshape(e, hkv, g, d).permute(1, 2, 0, 3)
        k4 = k.unsqueeze(1).expand(hkv, g, s, d)
        v4 = v.unsqueeze(1).expand(hkv, g, s, d)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                           scale=self.shape.scale)
        out.view(e, hkv, g, d).copy_(o.permute(2, 0, 1, 3))
