"""What the flashinfer backend checks and sizes before its first kernel runs; pure, so tested on CPU.

* :func:`float_workspace_bytes` — FlashInfer's split-KV kernels keep partial results (``tmp_v``, ``tmp_s``,
  fp32) in the float workspace. Its FA2 planner (``PrefillPlan`` in FlashInfer's ``scheduler.cuh``) splits a
  batch into at most ``2 * num_SMs / num_kv_heads`` work units per KV head, each ``cta_tile_q <= 128``
  query rows of every query head, so the workspace it may use is bounded by
  ``num_qo_heads * (2 * num_SMs // num_kv_heads) * 128 * (head_dim + 1) * 4`` bytes. A fixed 128 MiB is too
  small for 64 query / 8 KV heads on a 132-SM H100 (~133 MiB); the bound, never below the old 128 MiB, is.
* :class:`PlanGuard` — ``plan()`` fills a pinned host buffer of the wrapper and queues an asynchronous copy
  of it to the device. A second ``plan()`` of the same wrapper before that copy has run overwrites the
  buffer under it (the kernels of the earlier batch then read the later batch's plan: wrong results or
  illegal memory accesses). The guard records an event after each plan and waits for it before the
  wrapper's next plan; other wrappers are not held up.
* :func:`check_flashinfer_usable` — the checks ``auto`` applies before choosing flashinfer (16-bit dtype,
  a head dim its kernels are built for), run also when flashinfer is named explicitly, so an fp32 model
  fails at start-up with a clear message instead of inside JIT compilation.
* :func:`find_nvcc` / :func:`require_nvcc` — FlashInfer compiles its kernels with ``nvcc`` at first use;
  without a CUDA toolkit the server fails at start-up, saying which packages to install.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
MIN_FLOAT_WORKSPACE = 128 * 1024 * 1024  # FlashInfer's recommended size: enough for small models
BLOCKS_PER_SM = 2  # FlashInfer's FA2 planner: CTAs per SM it plans for
MAX_CTA_TILE_Q = 128  # the largest query tile FA2 uses
WORKSPACE_ALIGN = 1024 * 1024
NVCC_PACKAGES = "nvidia-cuda-nvcc nvidia-cuda-cccl"  # pip packages with nvcc and the headers FlashInfer's JIT needs


def float_workspace_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """The float workspace FlashInfer's split-KV prefill and decode may need (see the module docstring)."""
    if min(num_qo_heads, num_kv_heads, head_dim, num_sms) < 1:
        raise ValueError("head counts, head dim and SM count must be positive")
    units = max(1, BLOCKS_PER_SM * num_sms // num_kv_heads)
    tmp_v = num_qo_heads * units * MAX_CTA_TILE_Q * head_dim * 4
    tmp_s = num_qo_heads * units * MAX_CTA_TILE_Q * 4
    need = -(-(tmp_v + tmp_s) // WORKSPACE_ALIGN) * WORKSPACE_ALIGN + WORKSPACE_ALIGN  # + alignment slack
    return max(MIN_FLOAT_WORKSPACE, need)


class PlanGuard:
    """Plan a wrapper only when its previous plan's host-to-device copy is known complete."""

    def __init__(self, new_event: Callable[[], Any]):
        self._new_event = new_event
        self._events: dict[int, Any] = {}  # id(wrapper) -> event recorded after its last plan()
        self.waits = 0

    def before_plan(self, wrapper: Any) -> None:
        event = self._events.pop(id(wrapper), None)
        if event is not None:
            event.synchronize()  # the copy queued by the previous plan() has run: its host buffer is free
            self.waits += 1

    def after_plan(self, wrapper: Any) -> None:
        event = self._new_event()
        event.record()  # on the current stream, right after the copy plan() queued there
        self._events[id(wrapper)] = event


def check_flashinfer_usable(dtype: torch.dtype | None, head_dim: int | None) -> str | None:
    """Why flashinfer cannot run a model of ``dtype`` and ``head_dim`` (None: it can; None inputs: unchecked)."""
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"flashinfer has no {dtype} kernels (use --dtype bfloat16 or float16)"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head dim {head_dim} is not one of flashinfer's {FLASHINFER_HEAD_DIMS}"
    return None


def find_nvcc(env: dict[str, str] | None = None, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Path of the nvcc FlashInfer's JIT would use, looked up as it does: $CUDA_HOME (or $CUDA_PATH), then
    PATH, then /usr/local/cuda."""
    env = dict(os.environ) if env is None else env
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            nvcc = Path(env[var]) / "bin" / "nvcc"
            return str(nvcc) if nvcc.is_file() else None  # FlashInfer uses the variable as given
    found = which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def pip_installed_nvcc() -> str | None:
    """An nvcc from the ``nvidia-cuda-nvcc`` wheel (``site-packages/nvidia/<cu>/bin/nvcc``), if any."""
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(root).glob("*/bin/nvcc")):
            return str(candidate)
    return None


def has_prebuilt_kernels() -> bool:
    """FlashInfer's ahead-of-time kernel package is installed (then nvcc is not needed)."""
    import importlib.util

    return importlib.util.find_spec("flashinfer_jit_cache") is not None


def require_nvcc(find: Callable[[], str | None] = find_nvcc,
                 prebuilt: Callable[[], bool] = has_prebuilt_kernels) -> None:
    """Raise a clear start-up error when FlashInfer would need nvcc to JIT-compile its kernels and has none."""
    if prebuilt() or find() is not None:
        return
    wheel = pip_installed_nvcc()
    if wheel is not None:
        raise RuntimeError(
            f"the flashinfer attention backend compiles its CUDA kernels with nvcc at first use; nvcc is installed "
            f"at {wheel} but FlashInfer looks in $CUDA_HOME/bin, PATH and /usr/local/cuda/bin: set "
            f"CUDA_HOME={Path(wheel).parent.parent}")
    raise RuntimeError(
        "the flashinfer attention backend compiles its CUDA kernels with nvcc at first use, and no nvcc was "
        "found ($CUDA_HOME/bin, PATH, /usr/local/cuda/bin). Install a CUDA toolkit matching your torch build, "
        f"e.g. `pip install {NVCC_PACKAGES}` (CUDA 13) and set CUDA_HOME to the folder holding bin/nvcc, or "
        "choose --attention-backend torch_native")
