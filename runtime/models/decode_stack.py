"""Every decoder layer of a decode batch in one native call (``runtime/kernels/fastcpu_decoder.cpp``).

At batch 1 on the CPU a layer's kernels take ~0.25 ms and the Python between them (ten kernel calls, the checks that
pick each one, the views in between) took ~30 us more per layer: ~1 ms of a ~9 ms step over SmolLM2's 30 layers.
:class:`DecodeStack` hands the whole stack to one C++ loop that calls the same kernels in the same order with the
same arguments as :meth:`LlamaDecoderLayer.run` through :class:`PackedCpuOps` and the torch_native backend, so its
result is the layer-by-layer one bit for bit (tests/runtime/test_decode_stack.py).

It is built where that path would run the packed kernels for every layer: a CPU model with packed weights, the
torch_native backend reading the pool in place, no tensor parallelism, no per-head q/k norm (Qwen3), activations in
float32 or bfloat16. Per batch it takes up to the rows the packed kernels take, with a pool in the activations' dtype
or the int8 format: decode rows outside cascade groups, or all rows in groups whose shared prefix goes through the
GEMM kernel (bf16 activations, where the CPU has AVX512_BF16; the packs the backend keeps, or packed from the pool per
call, an int8 pool's rows converted as they are packed). The rows of a group may be decode rows and tokens of prefill
chunks whose own parts are short (the backend's plan then attends every row's own part in one call, which the stack
makes too): a few-shot batch decoding under its shared block, and the step that admits a new question beside it,
which under a server's staggered arrivals is about half the steps of a few-shot run. Any other batch runs layer by
layer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from runtime.attention.torch_native import TorchNativeBackend
from runtime.core.forward_batch import ForwardBatch
from runtime.kernels import KERNEL_DTYPES
from runtime.models.ops import PackedCpuOps

if TYPE_CHECKING:
    from runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class DecodeStack:
    """The model's decoder layers as one ``fastcpu.DecodeStack`` for the decode batches it takes."""

    def __init__(self, native: Any, ops: PackedCpuOps, backend: TorchNativeBackend, head_dim: int):
        self.native = native
        self.ops = ops
        self.backend = backend
        self.head_dim = head_dim

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> DecodeStack | None:
        """The stack for ``model`` (weights packed already), or None where the layers must run one by one."""
        ops, backend, arch = model.ops, model.attn_backend, model.arch
        if not isinstance(ops, PackedCpuOps) or not isinstance(backend, TorchNativeBackend) or backend.paged is None:
            return None
        if (model.tp is not None or arch.qk_norm or model.dtype not in KERNEL_DTYPES or arch.head_dim % 32
                or arch.hidden_size % 16 or arch.intermediate_size % 16):
            return None
        native = ops.k.DecodeStack(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps,
                                   backend.shape.scale)
        layers = model.decoder_layers()
        if any(norm.dtype != model.dtype for layer in layers for norm in (layer.input_norm, layer.post_norm)):
            return None
        for layer in layers:
            pairs = ((layer.qkv_weight, layer.qkv_bias), (layer.o_weight, layer.o_bias),
                     (layer.gate_up_weight, layer.gate_up_bias), (layer.down_weight, layer.down_bias))
            linears = [ops.packed_linear(w) for w, _ in pairs]
            if any(lin is None for lin in linears):
                return None
            native.add_layer(layer.input_norm, layer.post_norm, linears,
                             [b.float() if b is not None else None for _, b in pairs])
        logger.info("decode batches run the %d decoder layers in one native call", arch.num_layers)
        return cls(native, ops, backend, arch.head_dim)

    def run(self, residual: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, batch: ForwardBatch) -> bool:
        """Apply every layer to ``residual`` ``[T, hidden]`` in place, with the RoPE tables from
        ``RotaryCache.lookup``; False (nothing done) for a batch this stack does not take."""
        t = residual.shape[0]
        if not self.ops.runs_packed(t) or batch.kv.shape.dtype != residual.dtype or cos.dtype != residual.dtype:
            return False
        reads = self.backend.decode_in_place(batch)
        if reads is None:
            return False
        shared = [self.ops.k.SharedGroup(g.start, g.end, g.slots,
                                         torch.full((g.end - g.start,), g.slots.numel(), dtype=torch.int64),
                                         [p if p is not None else [] for p in g.packs]) for g in reads.shared]
        d = self.head_dim
        self.native.run(residual, cos.reshape(t, d), sin_signed.reshape(t, d), batch.out_cache_loc, reads.kv_index,
                        reads.lengths, batch.kv.k_buffer, batch.kv.v_buffer, shared, reads.row_index)
        return True

    def time_phases(self, on: bool) -> None:
        """Time each phase of the layers (norms, the four linears, rotary, KV store, own and shared attention,
        silu·mul) in the runs from now on, or stop (``radixserve bench profile``)."""
        self.native.time_phases(on)

    def take_phase_times(self) -> dict[str, float]:
        """Seconds per phase summed over the timed runs since the last call, and ``runs``: how many; then zero."""
        return dict(self.native.take_phase_times())
