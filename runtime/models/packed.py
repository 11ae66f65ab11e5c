"""Weights repacked for the fast CPU linear kernels (``runtime/kernels/``: ``linear_packed``, ``linear_int8``).

Layout ``"kmajor"`` (``linear_packed``): a weight ``W [N, K]`` becomes panels of 64 output columns stored
k-major, ``[ceil(N/64), K, 64]`` (rows past N are zero), so the kernel streams each panel once and keeps one
output column per vector lane. Formats: float32 and bfloat16 (a cast), and int8: symmetric weight-only
quantization with one fp32 scale per output row (``scale = max|W[n]| / 127``, ``q = round(W / scale)``).

Layout ``"vnni"`` (``linear_int8``, int8 on CPUs with AVX512-VNNI or AVX2): the same int8 values and scales, stored
as uint8 ``q + 128`` in ``[ceil(N/64), ceil(K/4), 256]``: per panel and group of 4 consecutive k, the 64
columns' 4 values side by side, so one 64-byte vector is 16 columns x 4 k, the operand of ``vpdpbusd``
(unsigned x signed bytes; the +128 is undone per activation row in the kernel). The AVX2 kernel reads the same
layout 32 bytes (8 columns x 4 k) at a time. Padding holds 128 (weight 0).

Layout ``"bf16pair"`` (``linear_bf16``, bfloat16 on CPUs with AVX512_BF16): ``[ceil(N/64), ceil(K/2), 128]``
bfloat16: per panel and pair of consecutive k, the 64 columns' two values side by side, so one 64-byte vector
is 16 columns x 2 k, the operand of ``vdpbf16ps``. Padding holds zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 64
WEIGHT_FORMATS = ("float32", "bfloat16", "int8")
LAYOUTS = ("kmajor", "vnni", "bf16pair")


@dataclass
class PackedWeight:
    # kmajor: [ceil(N/64), K, 64] float32 | bfloat16 | int8; vnni: [ceil(N/64), ceil(K/4), 256] uint8;
    # bf16pair: [ceil(N/64), ceil(K/2), 128] bfloat16
    data: torch.Tensor
    scale: torch.Tensor | None  # [N] float32 for int8
    out_features: int
    in_features: int
    layout: str = "kmajor"

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: ``(q [N, K] int8, scale [N] fp32)`` with ``weight ≈ q * scale[:, None]``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_weight(weight: torch.Tensor, fmt: str, layout: str = "kmajor") -> PackedWeight:
    """Repack ``weight [N, K]`` in format ``fmt`` (one of :data:`WEIGHT_FORMATS`) and ``layout`` (``"vnni"``:
    int8 only)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if layout not in LAYOUTS or (layout == "vnni" and fmt != "int8") or (layout == "bf16pair" and fmt != "bfloat16"):
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS} for {fmt} (vnni is int8 only, bf16pair "
                         "bfloat16 only)")
    n, k = weight.shape
    scale = None
    if fmt == "int8":
        values, scale = quantize_int8(weight)
    else:
        values = weight.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[fmt])
    padded = -(-n // PANEL) * PANEL
    if layout == "vnni":
        groups = -(-k // 4)
        offset = torch.full((padded, groups * 4), 128, dtype=torch.uint8)
        offset[:n, :k] = (values.to(torch.int16) + 128).to(torch.uint8)
        panels = padded // PANEL
        data = offset.view(panels, PANEL, groups, 4).transpose(1, 2).reshape(panels, groups, 4 * PANEL)
        return PackedWeight(data.contiguous(), scale, n, k, layout)
    if layout == "bf16pair":
        pairs = -(-k // 2)
        padded_values = values.new_zeros(padded, pairs * 2)
        padded_values[:n, :k] = values
        panels = padded // PANEL
        data = padded_values.view(panels, PANEL, pairs, 2).transpose(1, 2).reshape(panels, pairs, 2 * PANEL)
        return PackedWeight(data.contiguous(), None, n, k, layout)
    if padded != n:
        values = torch.cat([values, values.new_zeros(padded - n, k)])
    data = values.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()
    return PackedWeight(data, scale, n, k, layout)


def unpack_weight(pw: PackedWeight) -> torch.Tensor:
    """The ``[N, K]`` fp32 weight a packed one stands for (int8: dequantised)."""
    if pw.layout == "vnni":
        panels, groups, width = pw.data.shape
        q = pw.data.view(panels, groups, PANEL, 4).transpose(1, 2).reshape(panels * PANEL, groups * 4)
        w = q[: pw.out_features, : pw.in_features].float() - 128.0
    elif pw.layout == "bf16pair":
        panels, pairs, width = pw.data.shape
        v = pw.data.view(panels, pairs, PANEL, 2).transpose(1, 2).reshape(panels * PANEL, pairs * 2)
        w = v[: pw.out_features, : pw.in_features].float()
    else:
        panels, k, width = pw.data.shape
        w = pw.data.float().transpose(1, 2).reshape(panels * width, k)[: pw.out_features]
    return w * pw.scale[:, None] if pw.scale is not None else w
