"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name.

* ``torch_native`` (``torch_native.py``): plain torch, any device; the CPU path and the correctness oracle.
* ``flashinfer`` (``flashinfer.py``): FlashInfer's paged kernels, CUDA only, from the optional ``gpu`` extra.
* ``invariant`` (``invariant.py``): batch-invariant CPU kernels, chosen by ``--enable-deterministic-inference``.
* ``auto``: flashinfer on a CUDA device when the package imports, the dtype is 16-bit (its kernels have
  no fp32 variant) and the head dim is one its kernels are built for; torch_native otherwise.
"""

from __future__ import annotations

import functools
import logging

import torch

from runtime.attention.base import AttentionBackend, AttentionShape

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch_native", "flashinfer", "invariant")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


@functools.cache
def flashinfer_import_error() -> str | None:
    """Why ``import flashinfer`` fails here, or None when it works (checked once per process)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/TVM-FFI load error raised at import
        return f"{type(exc).__name__}: {exc}"
    return None


def auto_backend_name(device: torch.device | str, dtype: torch.dtype | None = None,
                      shape: AttentionShape | None = None) -> str:
    """The backend ``"auto"`` stands for on ``device`` for a model of ``dtype`` and attention ``shape``
    (None: not checked)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "torch_native"
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        logger.info("attention backend auto -> torch_native: flashinfer has no %s kernels", dtype)
        return "torch_native"
    if shape is not None and shape.head_dim not in FLASHINFER_HEAD_DIMS:
        logger.info("attention backend auto -> torch_native: head dim %d is not one of flashinfer's %s",
                    shape.head_dim, FLASHINFER_HEAD_DIMS)
        return "torch_native"
    error = flashinfer_import_error()
    if error is not None:
        logger.warning("attention backend auto -> torch_native: flashinfer is not usable (%s); install the "
                       "'gpu' extra (pip install 'radixserve[gpu]') for the fast CUDA kernels", error)
        return "torch_native"
    return "flashinfer"


def make_attention_backend(name: str, shape: AttentionShape, device: torch.device | str = "cpu",
                           dtype: torch.dtype | None = None) -> AttentionBackend:
    """Build the backend called ``name`` for a model's attention ``shape`` on ``device``.

    ``"auto"`` picks by :func:`auto_backend_name`. ``dtype`` (the KV/model dtype) only informs that choice.
    """
    device = torch.device(device)
    if name == "auto":
        name = auto_backend_name(device, dtype, shape)
    if name == "torch_native":
        from runtime.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend(shape, device)
    if name == "flashinfer":
        from runtime.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(shape, device)
    if name == "invariant":
        from runtime.attention.invariant import InvariantAttentionBackend

        return InvariantAttentionBackend(shape, device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionShape",
    "auto_backend_name",
    "flashinfer_import_error",
    "make_attention_backend",
]
