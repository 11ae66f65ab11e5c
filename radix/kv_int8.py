"""The int8 KV format (``--kv-cache-dtype int8``): each (token, KV head) row of K or V stored as ``head_dim`` int8
values followed by its float32 scale, ``head_dim + 4`` bytes in all (68 for a 64-dim head, against 128 in bf16).

Why a scale per (token, KV head): a token's K row over one head spans a range set by that token and head alone
(RoPE rotates it, the outlier channels differ by head), so one scale per row loses the least. Measured before it was
built (``benchmarks/bench_kv_quant_quality.py``): over bf16 weights it changed perplexity by +0.06% where fp8 e4m3
without scales cost +1.36%. Keeping the scale inside the row keeps the pool one tensor per layer and K/V, so the host
and disk tiers copy whole rows without knowing the format.

The rounding is fixed, so that every writer stores the same bytes (this module for the torch paths, ``store_kv`` in
``runtime/kernels/fastcpu.cpp`` for the CPU kernels): ``amax`` = the row's largest magnitude in float32, value =
round-half-even(x * (127 / amax)), scale = amax / 127; an all-zero row stores zeros and scale 0.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the float32 scale after each row's values


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) as int8 rows ``[..., head_dim + 4]`` (values, then scale)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # tensor by tensor: torch divides a scalar by a tensor through a reciprocal, which is not the rounded quotient
    limit = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    values = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)
    scale = (amax / limit).contiguous().view(torch.int8)  # [..., 4]: the float's bytes
    return torch.cat((values, scale), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Int8 rows ``[..., head_dim + 4]`` back to ``[..., head_dim]`` in ``dtype`` (value x scale in float32)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)


def dequantize_slots(rows: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Slots' rows of a 2-D int8 pool view ``[n, heads * (head_dim + 4)]`` as ``[n, heads * head_dim]`` in ``dtype``."""
    n = rows.shape[0]
    return dequantize(rows.view(n, num_kv_heads, -1), dtype).view(n, -1)
