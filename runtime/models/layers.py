"""Small building blocks of the Llama-family model: RMSNorm and rotary position embeddings.

These are plain functions and one cache object rather than ``nn.Module`` sub-modules: on a 2-core CPU a
decode step is dominated by per-op overhead outside the GEMMs, so the model calls them directly instead of
going through ``Module.__call__`` and its hook machinery for every layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from runtime.models.errors import ModelLoadError

# RoPE variants we implement; anything else is refused when the model is built, never silently wrong.
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed like HF: in fp32, cast back, then times the weight.

    Written out rather than ``F.rms_norm``: on the 2-core CPU the ATen op is as fast for decode-sized
    inputs but ~10x slower for prefill-sized ones (740 vs 65 us for 512 x 576), and HF's bf16 rounding
    order (normalise in fp32, cast, then scale) is matched exactly this way.
    """
    xf = x if x.dtype == torch.float32 else x.float()
    inv_rms = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if xf is x:
        return (x * inv_rms).mul_(weight)
    return (xf * inv_rms).to(x.dtype).mul_(weight)


def rope_inv_freq(head_dim: int, rope: Mapping[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) for the RoPE parameters of a config.

    ``rope`` is the normalised dict (``rope_theta``, ``rope_type`` and the type's own fields) that
    :func:`rope_parameters` returns. Computed exactly the way Hugging Face does, so cos/sin match it bit
    for bit in fp32.
    """
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    base = float(rope["rope_theta"])
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponent)
    if rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by ``factor``, short ones kept, and the
    band in between interpolated smoothly (so the model extends past its original context)."""
    factor = float(rope["factor"])
    low = float(rope["low_freq_factor"])
    high = float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of an HF config as one dict, for both config styles.

    transformers >= 5 normalises everything into ``config.rope_parameters`` (which holds ``rope_theta``);
    older versions keep ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    # Older configs spell the type "type"; treat a missing type as plain RoPE.
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    if out["rope_type"] == "llama3":
        out.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return out


class RotaryCache:
    """Precomputed RoPE tables, indexed by ``batch.positions`` once per forward.

    Rotation uses the "rotate half" convention of HF checkpoints: with ``x = [x1, x2]``,
    ``rot(x) = [x1*cos - x2*sin, x2*cos + x1*sin]``. We store ``cos`` duplicated to the full head dim and
    ``sin`` with the sign folded in (``[-sin, sin]``), so one rotation is ``x*cos + roll(x, D/2)*sin_signed``:
    three ops for q and k of all heads together.

    The tables start at ``min(max_positions, initial)`` rows and grow (doubling) when a batch needs more,
    so a 128k-context config does not pin ~100 MB of tables a short-context server never reads. The caller
    passes the batch's largest sequence length from host data, so growing never syncs a device.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: Mapping[str, Any],
                 dtype: torch.dtype, device: torch.device | str, initial: int = 4096):
        self.inv_freq = rope_inv_freq(head_dim, rope)
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.dtype = dtype
        self.device = torch.device(device)
        self.cos = torch.empty(0, head_dim, dtype=dtype, device=self.device)
        self.sin_signed = torch.empty(0, head_dim, dtype=dtype, device=self.device)
        self.ensure(min(max_positions, initial))

    def ensure(self, length: int) -> None:
        """Make the tables cover positions ``0 .. length-1``."""
        if length <= self.cos.shape[0]:
            return
        rows = max(length, 2 * self.cos.shape[0])
        # Same op order as HF (fp32 positions times fp32 inverse frequencies), then cast once.
        freqs = torch.arange(rows, dtype=torch.int64).to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat([cos, cos], dim=-1).to(device=self.device, dtype=self.dtype)
        self.sin_signed = torch.cat([-sin, sin], dim=-1).to(device=self.device, dtype=self.dtype)

    def lookup(self, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` for a batch, each ``[T, 1, head_dim]`` (broadcasts over heads);
        ``max_len`` bounds ``positions`` (the batch's largest sequence length)."""
        self.ensure(max_len)
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (any strides) by the tables from :meth:`RotaryCache.lookup`.

    Returns a new contiguous tensor; ``x`` (often a view into the fused QKV output) is left untouched.
    """
    out = x * cos
    out.addcmul_(x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
    return out
