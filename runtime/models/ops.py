"""The model's arithmetic behind one interface: the fast default, and a batch-invariant variant.

A decoder layer calls these operations and nothing else for its dense math (attention is the attention backend's),
and the model's output projection is ``logits``. :class:`TorchOps` is plain torch (MKL GEMMs, fused residual adds):
fastest, but a GEMM's float result for one row depends on how many rows share the call (M=1 takes a GEMV path, and
on AVX2 even the row's place inside a register tile matters), so a request's logits change in the last bits with
the batch around it. :class:`InvariantOps` (``--enable-deterministic-inference``) runs every operation through
``runtime/kernels/invariant.cpp``, whose per-element arithmetic is fixed by the row's own shape, so each row's
result is the same in any batch."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from radix.hugepages import huge_pages_mode, weight_arena
from runtime.config import cpu_flags
from runtime.kernels import KERNEL_DTYPES, kernel_input
from runtime.models.layers import apply_rotary, rms_norm
from runtime.models.packed import PackedWeight, pack_weight, unpack_weight

logger = logging.getLogger(__name__)


class ModelOps(Protocol):
    name: str

    def prepare(self, model: Any) -> None:
        """Called once after the weights are loaded (e.g. to repack them)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def add_linear_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
        """``residual += x @ weight.T (+ bias)`` in place."""

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[T, 2I]`` → ``[T, I]``."""

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The output projection ``x @ weight.T`` as a float32 tensor, whatever x's dtype (summed in fp32 and not
        rounded to x's dtype where the implementation's kernel allows: PackedCpuOps)."""


class TorchOps:
    """Plain torch: the residual add rides inside the GEMM (``addmm_``), SiLU·mul runs in place."""

    name = "torch"

    def prepare(self, model: Any) -> None:
        pass

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

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight, None).float()


class InvariantOps:
    """Batch-invariant fp32 CPU kernels (see ``runtime/kernels/invariant.cpp``), compiled on first use."""

    name = "invariant"

    def __init__(self) -> None:
        from runtime.kernels.build import load_kernels

        self.k: Any = load_kernels("invariant")

    def prepare(self, model: Any) -> None:
        pass

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

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight, None).float()


# Rows up to which the packed kernel beats the GEMM libraries, per format (all linear layers of SmolLM2-135M in
# sequence, 2 threads, AVX-512 + AMX host; docs/benchmarks.md): fp32 vs MKL even at 16 rows; bf16 vs oneDNN,
# whose AMX kernels win from 4 rows; int8 (weight-only, kernels without integer dot products) vs MKL over a
# dequantised copy. Above it the library runs, over the unpacked weight (int8: over a dequantised copy made per
# call). linear_int8 (VNNI or AVX2) has no limit: with VNNI it beat the dequantised GEMM at every size measured
# (1..512 rows; dequantising alone costs more), and it keeps a row's bits independent of its batch.
SMALL_M = {"float32": 16, "bfloat16": 3, "int8": 32}
# bf16 with bf16 dot products (linear_bf16, CPUs with AVX512_BF16) on a CPU without AMX: oneDNN's bf16 GEMMs there
# use the same dot products, and linear_bf16 beat them at every size measured up to 32 rows (one core of an
# AVX-512 AMD host: 14.4 vs 37 ms for all of SmolLM2's linear layers at 4 rows, 18 vs 41 at 8, 52 vs 70 at 32).
# Up to 256 rows it is as fast or faster (a Zen 4 host, 2 threads, a layer's four linears: 0.80x oneDNN's time at 33
# rows, 0.84x at 64, 0.95x at 96, 1.00-1.02x at 160-256; 1.04-1.08x at 512-1024), and oneDNN compiles a kernel for
# each new row count the first time it sees it (+1.8 ms per weight shape at ~160 rows): the questions of a
# few-shot batch, prefilled together, come in a new row count almost every step.
BF16_DOT_SMALL_M = 256
# bf16 on a CPU with AMX, where linear_bf16 runs batches of 2+ rows on the tiles (amx_tiles()): against oneDNN's AMX
# GEMMs, all of SmolLM2's linear layers in sequence, weights from memory (an Emerald Rapids host, 2 threads):
# 0.45-0.59x oneDNN's time at 1-32 rows, 0.75x at 64, 0.98x at 128, 1.04x at 175, 1.12x at 256, 1.66x at 512.
# Without the tile kernel (a compiler or kernel that does not offer AMX), oneDNN wins from 4 rows (SMALL_M).
BF16_AMX_SMALL_M = 128
# Activation block of linear_int8: one int8 scale per 32 k values of a row (a multiple of 16; 0 = one per row).
# `radixserve bench quality` on SmolLM2-135M (perplexity vs fp32 / greedy tokens agreeing): one scale per row
# +6.0% / 23% (an outlier coarsens its whole row); blocks of 64 +0.6% / 48%; blocks of 32 +1.2% / 57%
# (weight-only int8: +0.6% / 61%). Blocks of 32 cost ~1% more time than whole rows at 1 row, ~8% at 8.
# On AMX hosts a layer whose K is a multiple of 64 takes two-part activations with one scale per row instead
# (fastcpu_int8_split.h), which the block does not change.
INT8_ACT_BLOCK = 32
INT8_KERNELS = ("dot", "float")


class PackedCpuOps(TorchOps):
    """Linear layers of decode-sized batches through the fastcpu kernels over weights repacked once at load
    time (``packed.py``) in ``weight_format``: float32, bfloat16 or int8.

    int8 runs ``linear_int8`` (activations quantised per row block, integer dot products: AVX512-VNNI, or AVX2
    where the CPU lacks it) at every batch size; with ``int8_kernel="float"`` (or kernels built for a CPU with
    neither) weight-only int8 through ``linear_packed``, which converts each weight to fp32. bfloat16 runs
    ``linear_bf16`` (bf16 dot products, two k values per instruction) where the kernels were built for
    AVX512_BF16, else ``linear_packed`` (each weight widened to fp32); above ``small_m`` rows oneDNN's GEMMs run.
    The packed copies are keyed by the identity of the model's weight parameters, so the model code stays the
    same for every format. With int8 the model's own copy of each packed weight is released after packing (only
    the int8 panels stay in memory).
    """

    name = "packed"

    def __init__(self, weight_format: str, int8_kernel: str | None = None,
                 act_block: int = INT8_ACT_BLOCK) -> None:
        from runtime.kernels.build import load_kernels

        self.k: Any = load_kernels("fastcpu")
        self.weight_format = weight_format
        self.small_m = SMALL_M[weight_format]
        if int8_kernel is None:
            int8_kernel = "dot" if self.k.int8_dot() else "float"
        if int8_kernel not in INT8_KERNELS or (int8_kernel == "dot" and not self.k.int8_dot()):
            raise ValueError(f"int8 kernel {int8_kernel!r} is not available here (choose from {INT8_KERNELS}; "
                             "dot needs a CPU with AVX2 or AVX512-VNNI)")
        self.int8_dot = weight_format == "int8" and int8_kernel == "dot"
        self.bf16_dot = weight_format == "bfloat16" and self.k.bf16_dot()
        if self.bf16_dot and self.k.amx_tiles():
            self.small_m = BF16_AMX_SMALL_M
        elif self.bf16_dot and "amx_bf16" not in cpu_flags():
            self.small_m = BF16_DOT_SMALL_M
        self.act_block = act_block
        self.packed: dict[int, PackedWeight] = {}
        self.linears: dict[int, Any] = {}  # id(weight) -> fastcpu.PackedLinear over packed[id(weight)]

    def prepare(self, model: Any) -> None:
        """Pack the model's linear weights, and its output projection (kept unpacked too when it is the
        embedding table, which lookups still read), all on huge pages where the kernel has them."""
        out = model.output_weight()
        self.pack([*model.linear_weights(), out], release=lambda w: self.weight_format == "int8"
                  and w is not model.embed_tokens)

    def pack(self, weights: list[torch.Tensor], release: Callable[[torch.Tensor], bool]) -> None:
        """Pack each ``[N, K]`` weight; ``release(w)`` says whether to free the model's own copy (the panels stand
        for it). Every decode step streams the panels: they go onto huge pages where the kernel has them
        (hugepages.py)."""
        layout = "vnni" if self.int8_dot else "bf16pair" if self.bf16_dot else "kmajor"
        arena = weight_arena()
        for w in weights:
            pw = pack_weight(w.detach(), self.weight_format, layout)
            if arena is not None:
                pw = dataclasses.replace(pw, data=arena.place(pw.data))
            self.packed[id(w)] = pw
            self.linears[id(w)] = self.k.PackedLinear(pw.layout, pw.data, pw.out_features, pw.scale, self.act_block)
            if release(w):
                w.data = w.data.new_empty(0)
        if arena is not None:
            logger.info("%d packed weights on transparent huge pages (%.0f MB; mode %s)", len(weights),
                        arena.used / 1e6, huge_pages_mode())

    def runs_packed(self, rows: int) -> bool:
        """Whether a linear layer over ``rows`` activation rows runs the packed kernel (not a library GEMM)."""
        return self.int8_dot or rows <= self.small_m

    def packed_linear(self, weight: torch.Tensor) -> Any:
        """``weight``'s ``fastcpu.PackedLinear`` (its packed copy and the kernel for its layout), as the native
        decode stack takes it; None where it has no packed copy."""
        return self.linears.get(id(weight))

    @property
    def packed_bytes(self) -> int:
        return sum(p.nbytes for p in self.packed.values())

    def _run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor | None) -> torch.Tensor | None:
        """The packed product (None: not this kernel's case: no packed copy, or a large float batch). The
        kernels take x in float32 or bfloat16 and return the product in x's dtype, or add it into ``out``
        (either dtype) in place; converting in the kernel saves a torch call per tensor."""
        lin = self.linears.get(id(weight))
        if lin is None:
            return None
        b = bias.float() if bias is not None else None
        if self.runs_packed(x.shape[0]):  # the kernel for the weight's layout: PackedLinear's choice
            return lin.run(kernel_input(x), b, out)
        if self.weight_format != "int8":
            return None
        # weight-only int8 (no integer dot products), large batch: a GEMM over the dequantised weight
        y = F.linear(x.float(), dequantize(self.packed[id(weight)]), b)
        return y if out is None else out.add_(y.to(out.dtype))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self._run(x, weight, bias, None)
        if y is None:
            return super().linear(x, weight, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # One fused pass each instead of 3-6 ATen ops (the per-op overhead decides a small decode step).
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 16 == 0 and x.dtype == weight.dtype:
            return self.k.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        t, _h, d = x.shape
        if x.stride(2) == 1 and x.stride(1) == d and d % 32 == 0 and cos.dtype == x.dtype:
            return self.k.rotary(x, cos.reshape(t, d), sin_signed.reshape(t, d))
        return super().rotary(x, cos, sin_signed)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.stride(1) == 1 and gate_up.shape[1] % 32 == 0:
            return self.k.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The packed kernels sum in fp32 and return the product in their input's dtype: given the fp32 copy of bf16
        rows (exact), they hand back those sums as they are. A bf16 product rounded each logit to 8 bits, which tied
        or swapped near-equal tokens: greedy continuations agreed with fp32's for 70.5% of tokens in bf16 and 51.8%
        in int8 + int8 cache, 85.8% and 57.0% with these (`radixserve bench quality`, 64 prompts); and its fp32 copy
        of all the logits is gone (~0.1 ms of a batch-8 step). Rounded to bf16 these logits are the bf16 product's
        bits (tests/runtime/test_fastcpu_dtypes.py). Int8 weights take fp32 rows at any count (the packed kernel, or
        the GEMM over their dequantised copy, which sums in fp32 too); bf16 weights beyond the packed kernel's rows
        (a prompt's logprob rows: ``small_m``, 128 with AMX) go to the library's bf16 GEMM and are rounded as before."""
        if x.dtype != torch.float32 and self.packed_linear(weight) is not None and (
                self.weight_format == "int8" or self.runs_packed(x.shape[0])):
            return self.linear(x.float(), weight, None)
        return super().logits(x, weight)

    def add_linear_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> None:
        if residual.dtype in KERNEL_DTYPES and residual.stride(1) == 1:
            if self._run(x, weight, bias, residual) is not None:
                return
        else:
            y = self._run(x, weight, bias, None)
            if y is not None:
                residual.add_(y.to(residual.dtype))
                return
        super().add_linear_(residual, x, weight, bias)


def dequantize(pw: PackedWeight) -> torch.Tensor:
    """The ``[N, K]`` fp32 weight a packed one stands for."""
    return unpack_weight(pw)


def cpu_weight_format(args: Any, device: torch.device) -> str | None:
    """The packed-weight format of the CPU fast path for these server args (None: plain torch). The packed
    kernels need a C++ compiler; without one the plain torch path runs (int8 cannot, and says why)."""
    if device.type != "cpu" or args.enable_deterministic_inference:
        return None
    fmt = "int8" if args.quantization == "int8" else args.dtype
    if fmt not in ("float32", "bfloat16", "int8"):
        return None
    from runtime.kernels.build import KernelBuildError, load_kernels

    try:
        load_kernels("fastcpu")
    except KernelBuildError as exc:
        if fmt == "int8":
            raise
        logger.warning("decode-sized linear layers run through torch (slower): %s", exc)
        return None
    return fmt


def make_ops(deterministic: bool, weight_format: str | None = None) -> ModelOps:
    """Deterministic mode's invariant kernels; else the packed kernels for ``weight_format``; else torch."""
    if deterministic:
        return InvariantOps()
    if weight_format is not None:
        return PackedCpuOps(weight_format)
    return TorchOps()
