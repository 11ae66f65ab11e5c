"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name.

* ``torch_native`` (``torch_native.py``): plain torch, any device; the CPU path and the correctness oracle.
* ``flashinfer`` (``flashinfer.py``): FlashInfer's paged kernels, CUDA only, from the optional ``gpu`` extra.
* ``invariant`` (``invariant.py``): batch-invariant CPU kernels, chosen by ``--enable-deterministic-inference``.
* ``auto``: flashinfer on a CUDA device when the package imports, the dtype is 16-bit (its kernels have
  no fp32 variant) and the head dim is one its kernels are built for; torch_native otherwise. Naming
  ``flashinfer`` explicitly runs the same dtype / head-dim checks and fails at start-up when they fail.
"""

from __future__ import annotations

import functools
import logging

import torch

from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.attention.flashinfer_setup import FLASHINFER_DTYPES, FLASHINFER_HEAD_DIMS, check_flashinfer_usable

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch_native", "flashinfer", "invariant")


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
    unusable = check_flashinfer_usable(dtype, shape.head_dim if shape is not None else None)
    if unusable is not None:
        logger.info("attention backend auto -> torch_native: %s", unusable)
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
        # the checks "auto" makes, as a clear error (on a non-CUDA device the backend's own error says more)
        unusable = check_flashinfer_usable(dtype, shape.head_dim) if device.type == "cuda" else None
        if unusable is not None:
            raise ValueError(f"--attention-backend flashinfer cannot run this model: {unusable}; or choose "
                             "--attention-backend torch_native")
        from runtime.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(shape, device, dtype)
    if name == "invariant":
        from runtime.attention.invariant import InvariantAttentionBackend

        return InvariantAttentionBackend(shape, device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}")


__all__ = [
    "BACKEND_NAMES",
    "FLASHINFER_DTYPES",
    "FLASHINFER_HEAD_DIMS",
    "AttentionBackend",
    "AttentionShape",
    "auto_backend_name",
    "flashinfer_import_error",
    "make_attention_backend",
]
