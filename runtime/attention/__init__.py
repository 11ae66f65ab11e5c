"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name."""

from __future__ import annotations

import torch

from runtime.attention.base import AttentionBackend, AttentionShape

BACKEND_NAMES = ("auto", "torch_native")


def make_attention_backend(name: str, shape: AttentionShape,
                           device: torch.device | str = "cpu") -> AttentionBackend:
    """Build the backend called ``name`` for a model's attention ``shape`` on ``device``.

    ``"auto"`` picks the best backend available for the device; today that is ``torch_native`` everywhere
    (a CUDA backend will take over CUDA devices when it lands).
    """
    device = torch.device(device)
    if name == "auto":
        name = "torch_native"
    if name == "torch_native":
        from runtime.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend(shape, device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")


__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionShape", "make_attention_backend"]
