"""Native CPU kernels built on first use (``torch.utils.cpp_extension``), one module per kernel set."""

from __future__ import annotations

import torch

# Activation dtypes the fastcpu kernels take and give as they are: they widen bf16 inputs and round their results
# themselves, cheaper than a torch conversion from Python per tensor.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the fastcpu kernels take it: float32 or bfloat16 as it is, any other dtype converted to float32."""
    return t if t.dtype in KERNEL_DTYPES else t.float()
