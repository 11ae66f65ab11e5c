"""The model's arithmetic behind one interface: the fast default, and a batch-invariant variant.

A decoder layer calls these six operations and nothing else for its dense math (attention is the
attention backend's). :class:`TorchOps` is plain torch (MKL GEMMs, fused residual adds): fastest, but a
GEMM's float result for one row depends on how many rows share the call (M=1 takes a GEMV path, and on
AVX2 even the row's place inside a register tile matters), so a request's logits change in the last bits
with the batch around it. :class:`InvariantOps` (``--enable-deterministic-inference``) runs every
operation through ``runtime/kernels/invariant.cpp``, whose per-element arithmetic is fixed by the row's
own shape, so each row's result is the same in any batch.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from runtime.models.layers import apply_rotary, rms_norm


class ModelOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def add_linear_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
        """``residual += x @ weight.T (+ bias)`` in place."""

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[T, 2I]`` → ``[T, I]``."""


class TorchOps:
    """Plain torch: the residual add rides inside the GEMM (``addmm_``), SiLU·mul runs in place."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def add_linear_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
        residual.addmm_(x, weight.t())
        if bias is not None:
            residual.add_(bias)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin_signed)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        gate = F.silu(gate_up[:, :inter], inplace=True)  # in place on a view of gate_up
        return gate.mul_(gate_up[:, inter:])


class InvariantOps:
    """Batch-invariant fp32 CPU kernels (see ``runtime/kernels/invariant.cpp``), compiled on first use."""

    name = "invariant"

    def __init__(self) -> None:
        from runtime.kernels.build import load_kernels

        self.k: Any = load_kernels("invariant")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 3:  # per-head norms (Qwen3 q/k): every head vector is a row
            t, h, d = x.shape
            return self.k.rms_norm(x.reshape(t * h, d), weight, eps).view(t, h, d)
        return self.k.rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.k.linear(x, weight, bias, None)

    def add_linear_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
        self.k.linear(x, weight, bias, residual)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            x = x.contiguous()
        return self.k.rotary(x, cos.reshape(cos.shape[0], -1).contiguous(),
                             sin_signed.reshape(sin_signed.shape[0], -1).contiguous())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up)


def make_ops(deterministic: bool) -> ModelOps:
    return InvariantOps() if deterministic else TorchOps()
