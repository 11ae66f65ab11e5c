"""Our Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3), one implementation for all.

The variants differ only in a few switches read from the HF config (:class:`LlamaArch`): bias on the
QKV projection (Qwen2), per-head RMSNorm on q and k (Qwen3), tied embeddings, RoPE base and llama3
scaling, an explicit ``head_dim``. Each variant is a tiny subclass that says how to read its switches.

Layout choices, all for the CPU decode hot path (time outside GEMM decides speed there):
- q/k/v are one fused weight (one GEMM), so are gate/up; the HF names are split into them at load time.
- o_proj and down_proj are ``residual.addmm_(x, W.T)``: the residual add rides inside the GEMM.
- RoPE tables are precomputed once and indexed by ``batch.positions`` once per forward, not per layer.
- Layers are called as plain methods (no ``Module.__call__`` hooks); there is no per-token Python loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.core.forward_batch import ForwardBatch
from runtime.models.errors import ModelLoadError
from runtime.models.layers import RotaryCache, rope_parameters
from runtime.models.ops import ModelOps, TorchOps
from runtime.models.tp_plan import TPContext, fused_pieces, hf_pieces, take

if TYPE_CHECKING:
    from runtime.models.decode_stack import DecodeStack

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaArch:
    """The shape and switches of one checkpoint, read from its HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    rope: dict[str, Any]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @property
    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim)


def _common_arch(config: Any, *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> LlamaArch:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported activation {act!r} (only silu / SwiGLU is implemented)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return LlamaArch(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.rms_norm_eps),
        max_positions=int(config.max_position_embeddings),
        rope=rope_parameters(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=qk_norm,
    )


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: ``r += o_proj(attn(norm(r)))``; ``r += down(silu(gate) * up)(norm(r))``.

    Under tensor parallelism (``tp``) the layer holds its rank's query/KV heads and MLP columns: QKV and
    gate/up are column-parallel (no communication), o_proj and down are row-parallel, each followed by one
    all-reduce of the ``[T, hidden]`` partial sums (see :meth:`_row_parallel_add`)."""

    def __init__(self, arch: LlamaArch, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TPContext | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.eps = arch.rms_norm_eps
        self.tp = tp
        heads, kv_heads, inter = arch.num_heads, arch.num_kv_heads, arch.intermediate_size
        if tp is not None:
            heads, kv_heads, inter = tp.shard.num_heads, tp.shard.num_kv_heads, tp.shard.inter_size
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, arch.head_dim
        self.q_size = heads * arch.head_dim
        self.kv_size = kv_heads * arch.head_dim
        self.inter = inter
        hidden, qkv_rows = arch.hidden_size, self.q_size + 2 * self.kv_size

        def opt(shape: tuple[int, ...], present: bool) -> nn.Parameter | None:
            return _param(shape, dtype, device) if present else None

        self.input_norm = _param((hidden,), dtype, device)
        self.qkv_weight = _param((qkv_rows, hidden), dtype, device)
        self.qkv_bias = opt((qkv_rows,), arch.qkv_bias)
        self.q_norm = opt((arch.head_dim,), arch.qk_norm)
        self.k_norm = opt((arch.head_dim,), arch.qk_norm)
        self.o_weight = _param((hidden, self.q_size), dtype, device)
        self.o_bias = opt((hidden,), arch.o_bias)
        self.post_norm = _param((hidden,), dtype, device)
        self.gate_up_weight = _param((2 * inter, hidden), dtype, device)
        self.gate_up_bias = opt((2 * inter,), arch.mlp_bias)
        self.down_weight = _param((hidden, inter), dtype, device)
        self.down_bias = opt((hidden,), arch.mlp_bias)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF checkpoint name → the tensor (or row block of a fused tensor) it is copied into."""
        q, kv, inter = self.q_size, self.kv_size, self.inter
        named: list[tuple[str, torch.Tensor | None, int, int]] = [
            ("input_layernorm.weight", self.input_norm, 0, 0),
            ("post_attention_layernorm.weight", self.post_norm, 0, 0),
            ("self_attn.q_proj.weight", self.qkv_weight, 0, q),
            ("self_attn.k_proj.weight", self.qkv_weight, q, kv),
            ("self_attn.v_proj.weight", self.qkv_weight, q + kv, kv),
            ("self_attn.q_proj.bias", self.qkv_bias, 0, q),
            ("self_attn.k_proj.bias", self.qkv_bias, q, kv),
            ("self_attn.v_proj.bias", self.qkv_bias, q + kv, kv),
            ("self_attn.q_norm.weight", self.q_norm, 0, 0),
            ("self_attn.k_norm.weight", self.k_norm, 0, 0),
            ("self_attn.o_proj.weight", self.o_weight, 0, 0),
            ("self_attn.o_proj.bias", self.o_bias, 0, 0),
            ("mlp.gate_proj.weight", self.gate_up_weight, 0, inter),
            ("mlp.up_proj.weight", self.gate_up_weight, inter, inter),
            ("mlp.gate_proj.bias", self.gate_up_bias, 0, inter),
            ("mlp.up_proj.bias", self.gate_up_bias, inter, inter),
            ("mlp.down_proj.weight", self.down_weight, 0, 0),
            ("mlp.down_proj.bias", self.down_bias, 0, 0),
        ]
        # rows == 0: the whole tensor; otherwise a row block of a fused weight (a view, so copy_ fills it).
        return {prefix + name: (t if rows == 0 else t.narrow(0, row, rows))
                for name, t, row, rows in named if t is not None}

    def run(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
            backend: AttentionBackend, ops: ModelOps) -> None:
        """Apply the block to ``residual`` ``[T, hidden]`` in place."""
        t = residual.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_end = self.q_size + self.kv_size

        x = ops.rms_norm(residual, self.input_norm, self.eps)
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3: RMSNorm over each head's vector, before RoPE.
            q = ops.rotary(ops.rms_norm(qkv[:, : self.q_size].view(t, h, d), self.q_norm, self.eps), cos, sin)
            k = ops.rotary(ops.rms_norm(qkv[:, self.q_size : k_end].view(t, hkv, d), self.k_norm, self.eps),
                           cos, sin)
        else:
            # q and k heads side by side: one rotation for both.
            qk = ops.rotary(qkv[:, :k_end].view(t, h + hkv, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, k_end:].view(t, hkv, d)
        attn = backend.forward(q, k, v, self.layer_id, batch)
        self._row_parallel_add(ops, residual, attn.reshape(t, self.q_size), self.o_weight, self.o_bias)

        x = ops.rms_norm(residual, self.post_norm, self.eps)
        gate_up = ops.linear(x, self.gate_up_weight, self.gate_up_bias)
        self._row_parallel_add(ops, residual, ops.silu_mul(gate_up), self.down_weight, self.down_bias)

    def _row_parallel_add(self, ops: ModelOps, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> None:
        """``residual += x @ W.T + bias`` with ``x``/``W`` split by columns across the ranks.

        Rank 0 adds its partial product (and the bias, once) into the residual itself, the others into
        zeros; one all-reduce then leaves ``residual + sum(partials)`` on every rank, so the fused
        residual-add GEMM stays and no extra add is needed."""
        if self.tp is None:
            ops.add_linear_(residual, x, weight, bias)
            return
        first = self.tp.comm.is_first
        partial = residual if first else torch.zeros_like(residual)
        ops.add_linear_(partial, x, weight, bias if first else None)
        self.tp.comm.all_reduce_(partial)
        if not first:
            residual.copy_(partial)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over the paged KV pool; subclasses only change :meth:`arch_from_config`."""

    def __init__(self, config: Any, attn_backend: AttentionBackend, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", ops: ModelOps | None = None, tp: TPContext | None = None):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ModelLoadError(f"unsupported model dtype {dtype}")
        arch = self.arch_from_config(config)
        self.tp = tp
        if attn_backend.shape != self.local_attention_shape(arch, tp):
            raise ValueError(f"attention backend shape {attn_backend.shape} does not match the model's "
                             f"{self.local_attention_shape(arch, tp)}")
        sliding = getattr(config, "sliding_window", None)
        if sliding and getattr(config, "use_sliding_window", True) and sliding < arch.max_positions:
            logger.warning("sliding_window=%d is not implemented: attention is full, so outputs match the "
                           "reference only for sequences up to %d tokens", sliding, sliding)
        device = torch.device(device)
        self.arch = arch
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attn_backend = attn_backend
        self.ops: ModelOps = ops or TorchOps()
        vocab = arch.vocab_size if tp is None else tp.shard.vocab_size  # vocab-parallel: this rank's rows
        self.embed_tokens = _param((vocab, arch.hidden_size), dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, dtype, device, tp) for i in range(arch.num_layers))
        self.norm = _param((arch.hidden_size,), dtype, device)
        self.lm_head = None if arch.tie_word_embeddings else _param((vocab, arch.hidden_size), dtype, device)
        self.rotary = RotaryCache(arch.head_dim, arch.max_positions, arch.rope, dtype, device)
        # Plain list for the hot loop: iterating a ModuleList goes through __getitem__/__iter__ machinery.
        self._layer_list: list[LlamaDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        # The layers of the decode batches it takes in one native call (decode_stack.py; set once the weights are
        # packed); the others run layer by layer.
        self.decode_stack: DecodeStack | None = None

    @classmethod
    def arch_from_config(cls, config: Any) -> LlamaArch:
        """Llama/SmolLM2: ``attention_bias`` puts a bias on q, k, v and o alike."""
        bias = bool(getattr(config, "attention_bias", False))
        return _common_arch(config, qkv_bias=bias, o_bias=bias, qk_norm=False)

    @staticmethod
    def local_attention_shape(arch: LlamaArch, tp: TPContext | None) -> AttentionShape:
        """The heads this rank attends with (all of them without tensor parallelism)."""
        if tp is None:
            return arch.attention_shape
        return AttentionShape(tp.shard.num_heads, tp.shard.num_kv_heads, arch.head_dim)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm for every new token of the batch, ``[T, hidden]``.

        Plans the attention backend for the batch unless the caller already did (``attn_metadata``).
        """
        if batch.attn_metadata is None:
            self.attn_backend.plan(batch)
        cos, sin = self.rotary.lookup(batch.positions, max(batch.seq_lens_cpu, default=0))
        residual = self._embed(batch.input_ids)
        if self.decode_stack is None or not self.decode_stack.run(residual, cos, sin, batch):
            for layer in self._layer_list:
                layer.run(residual, cos, sin, batch, self.attn_backend, self.ops)
        return self.ops.rms_norm(residual, self.norm, self.arch.rms_norm_eps)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; vocab-parallel under TP: each rank looks up the ids in its range, zeros elsewhere,
        and one all-reduce assembles the rows (adding zeros is exact, so the result equals a full lookup)."""
        if self.tp is None:
            return F.embedding(ids, self.embed_tokens)
        v0, v1 = self.tp.shard.vocab
        outside = (ids < v0) | (ids >= v1)
        rows = F.embedding((ids - v0).clamp_(0, v1 - v0 - 1), self.embed_tokens)
        rows.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.tp.comm.all_reduce_(rows)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """The decoder layers in order (a copy of the list; the layers themselves are the model's)."""
        return list(self._layer_list)

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights of every linear layer of the decoder (not the output projection)."""
        return [w for layer in self._layer_list
                for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)]

    def output_weight(self) -> torch.Tensor:
        """The output projection: the embedding table when they are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[N, vocab]`` in fp32 for hidden rows ``[N, hidden]``.

        Runs under ``no_grad`` rather than ``inference_mode`` so the sampler may edit the logits in place
        (penalties, masks) outside inference mode.
        """
        logits = self.ops.logits(hidden, self.output_weight())
        if self.tp is None:
            return logits
        # vocab-parallel output projection: rank 0 gathers every rank's columns; the others keep their own
        return self.tp.comm.gather_columns(logits, self.tp.vocab_widths)

    # ------------------------------------------------------------------ weights
    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Every HF weight name this model expects → the tensor (view) it is copied into."""
        targets: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens,
            "model.norm.weight": self.norm,
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self._layer_list):
            targets.update(layer.weight_targets(f"model.layers.{i}."))
        return targets

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full-size (tp 1) value of our parameter ``name`` (itself without TP)."""
        if self.tp is None:
            return full
        a = self.arch
        return take(full, fused_pieces(name, self.tp.shard, a.num_heads, a.num_kv_heads, a.head_dim,
                                       a.intermediate_size))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (casting to the model dtype), splicing q/k/v and gate/up into the
        fused weights. Raises :class:`ModelLoadError` on a shape mismatch or a missing weight."""
        targets = self.weight_targets()
        loaded: set[str] = set()
        ignored: list[str] = []
        for name, tensor in weights:
            dst = targets.get(name)
            if dst is None:
                # Rotary buffers of old checkpoints; lm_head of tied checkpoints (it equals the embedding).
                ignored.append(name)
                continue
            if self.tp is not None:
                tensor = take(tensor, hf_pieces(name, self.tp.shard, self.arch.num_heads, self.arch.num_kv_heads,
                                                self.arch.head_dim))
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
        unexpected = [n for n in ignored if "rotary_emb" not in n and n != "lm_head.weight"]
        if unexpected:
            logger.warning("ignored %d unexpected weights, e.g. %s", len(unexpected), unexpected[:5])


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layout (sliding window not implemented, see the warning at build time)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/2.5: q, k, v carry a bias; o_proj does not."""

    @classmethod
    def arch_from_config(cls, config: Any) -> LlamaArch:
        return _common_arch(config, qkv_bias=True, o_bias=False, qk_norm=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before RoPE; ``attention_bias`` as in Llama."""

    @classmethod
    def arch_from_config(cls, config: Any) -> LlamaArch:
        bias = bool(getattr(config, "attention_bias", False))
        return _common_arch(config, qkv_bias=bias, o_bias=bias, qk_norm=True)
