"""Weights repacked for the fast CPU linear kernel (``runtime/kernels/fastcpu.cpp``: ``linear_packed``).

A weight ``W [N, K]`` becomes panels of 64 output columns stored k-major, ``[ceil(N/64), K, 64]`` (rows past
N are zero), so the kernel streams each panel once and keeps one output column per vector lane. Formats:
float32 and bfloat16 (a cast), and int8: symmetric weight-only quantization with one fp32 scale per output
row (``scale = max|W[n]| / 127``, ``q = round(W / scale)``), a quarter of fp32's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 64
WEIGHT_FORMATS = ("float32", "bfloat16", "int8")


@dataclass
class PackedWeight:
    data: torch.Tensor  # [ceil(N/64), K, 64] float32 | bfloat16 | int8
    scale: torch.Tensor | None  # [N] float32 for int8
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: ``(q [N, K] int8, scale [N] fp32)`` with ``weight ≈ q * scale[:, None]``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_weight(weight: torch.Tensor, fmt: str) -> PackedWeight:
    """Repack ``weight [N, K]`` in format ``fmt`` (one of :data:`WEIGHT_FORMATS`)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    n, k = weight.shape
    scale = None
    if fmt == "int8":
        values, scale = quantize_int8(weight)
    else:
        values = weight.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[fmt])
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        values = torch.cat([values, values.new_zeros(padded - n, k)])
    data = values.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()
    return PackedWeight(data, scale, n)
