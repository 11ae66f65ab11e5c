"""Building one rank's model: where the weights come from, the attention backend for its heads, the ops.

Shared by the :class:`~runtime.executor.model_runner.ModelRunner` (rank 0, or the only rank) and the other
tensor-parallel ranks (``tp_ranks``), so every rank builds its shard the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radix.kv_storage import KVShape
from runtime.attention import make_attention_backend
from runtime.attention.base import AttentionBackend
from runtime.config import ServerArgs
from runtime.models.decode_stack import DecodeStack
from runtime.models.folders import is_random_model, resolve_model_path
from runtime.models.llama import LlamaForCausalLM
from runtime.models.loader import load_config, load_model
from runtime.models.ops import cpu_weight_format, make_ops
from runtime.models.random_model import build_random_model, random_model_config
from runtime.models.registry import get_model_class
from runtime.models.tp_plan import Shard, TPContext, plan_shards


@dataclass
class ModelSource:
    model_path: Path  # the HF folder (the default model's, for its tokenizer, when the weights are random)
    hf_config: Any
    random_weights: bool


def model_source(args: ServerArgs) -> ModelSource:
    return source_of(args.model)


def source_of(model: str) -> ModelSource:
    """Where the model named ``model`` (any ``--model`` value) comes from."""
    if is_random_model(model):
        # No files: the config is a preset, the weights are drawn on the device; the tokenizer (and so the
        # generation config read next to it) is the default model's.
        return ModelSource(resolve_model_path("default"), random_model_config(model), True)
    path = resolve_model_path(model)
    return ModelSource(path, load_config(path), False)


def tp_shards(hf_config: Any, tp_size: int) -> list[Shard]:
    """Every rank's shard of this model at ``tp_size`` (TPConfigError when the shape does not split)."""
    arch = get_model_class(hf_config).arch_from_config(hf_config)
    return plan_shards(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, arch.vocab_size, tp_size)


def build_model(args: ServerArgs, source: ModelSource, device: torch.device,
                tp: TPContext | None) -> tuple[LlamaForCausalLM, AttentionBackend]:
    """This rank's model (weights loaded or drawn, ops prepared) and its attention backend."""
    cfg = source.hf_config
    arch = get_model_class(cfg).arch_from_config(cfg)
    backend = make_attention_backend(args.attention_backend, LlamaForCausalLM.local_attention_shape(arch, tp),
                                     device, args.torch_dtype)
    ops = make_ops(args.enable_deterministic_inference, cpu_weight_format(args, device))
    if source.random_weights:
        model = build_random_model(cfg, backend, args.torch_dtype, device, args.random_seed, ops, tp)
    else:
        model, _ = load_model(source.model_path, args.torch_dtype, device, backend, ops, tp)
    model.ops.prepare(model)
    model.decode_stack = DecodeStack.build(model)
    return model, backend


def kv_shape(args: ServerArgs, model: LlamaForCausalLM) -> KVShape:
    """The KV pool shape of this rank: every layer, the KV heads its query heads read."""
    arch = model.arch
    kv_heads = arch.num_kv_heads if model.tp is None else model.tp.shard.num_kv_heads
    return KVShape(arch.num_layers, kv_heads, arch.head_dim, args.torch_dtype, int8=args.kv_cache_dtype == "int8")
