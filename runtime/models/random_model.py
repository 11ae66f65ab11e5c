"""Random-weight models of known shapes, built directly on the target device: ``--model random:NAME``.

For throughput figures that do not depend on weight values (a decode step reads every weight once
whatever they are), and for tests that need a real model shape without files. Nothing is read from disk
or downloaded: the config comes from the table below and the weights are drawn on the device, in the
serving dtype, from a seeded generator (the same seed gives the same model on the same device).

The tokenizer of a random model is the default model's (SmolLM2-135M-Instruct, see ``loader``): prompts
tokenize as usual; ids the random model emits beyond that tokenizer's vocabulary (the 8B shape has
128,256 rows) decode to empty text. Benchmarks drive these models with token ids and ``ignore_eos``.

Names: ``llama3-8b`` (Llama-3-8B: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336,
vocab 128256), ``smollm2-135m`` (SmolLM2-135M: 30 layers, hidden 576, 9 / 3 heads of 64), ``tiny`` (2
layers, hidden 64, 4 / 2 heads of 16, the tests' model). Weights are N(0, 0.02²) (embeddings too), norms
1, biases 0 — the scale HF initialises Llama with, which keeps activations finite through 32 layers.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import torch

from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.models.errors import ModelLoadError
from runtime.models.folders import RANDOM_MODEL_PREFIX
from runtime.models.llama import LlamaForCausalLM
from runtime.models.ops import ModelOps
from runtime.models.tp_plan import TPContext

logger = logging.getLogger(__name__)

INIT_STD = 0.02

# HF LlamaConfig fields of each preset.
RANDOM_MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=128000, eos_token_id=128001),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2),
}


def random_model_name(model: str) -> str:
    name = model[len(RANDOM_MODEL_PREFIX):].lower()
    if name not in RANDOM_MODEL_SHAPES:
        raise ModelLoadError(f"unknown random model {model!r}; choose one of: "
                             + ", ".join(RANDOM_MODEL_PREFIX + n for n in RANDOM_MODEL_SHAPES))
    return name


def random_model_config(model: str) -> Any:
    """The HF ``LlamaConfig`` of a ``random:NAME`` model (no file involved)."""
    from transformers import LlamaConfig

    name = random_model_name(model)
    cfg = LlamaConfig(**RANDOM_MODEL_SHAPES[name], hidden_act="silu")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.name_or_path = RANDOM_MODEL_PREFIX + name
    return cfg


def weight_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes of the model's weights (what one decode step reads), from the config alone."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i + 2 * h
    total = config.num_hidden_layers * per_layer + v * h + h
    if not getattr(config, "tie_word_embeddings", False):
        total += v * h
    return total * torch.empty((), dtype=dtype).element_size()


@torch.no_grad()
def build_random_model(config: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                       device: torch.device | str, seed: int = 0,
                       ops: ModelOps | None = None, tp: TPContext | None = None) -> LlamaForCausalLM:
    """A Llama model for ``config`` with seeded random weights, allocated and drawn on ``device``.

    Under tensor parallelism (``tp``) every rank draws the full-size tensors in the same order as tp 1 and
    keeps its shard, so the ranks together hold exactly the tp-1 model of the same seed."""
    device = torch.device(device)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(config, attn_backend, dtype=dtype, device=device, ops=ops, tp=tp)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    targets: list[tuple[str, torch.Tensor, torch.Tensor]]
    if tp is None:
        targets = [(name, param, param) for name, param in model.named_parameters()]
    else:
        # a tp-1 twin on the meta device: the parameters' names, full shapes and order, and no memory
        twin = LlamaForCausalLM(config, cast(Any, _ShapeOnly(model.arch.attention_shape)), dtype=dtype,
                                device="meta")
        local = dict(model.named_parameters())
        targets = [(name, torch.empty(p.shape, dtype=dtype, device=device), local[name])
                   for name, p in twin.named_parameters()]
    for name, full, param in targets:
        if name.endswith("norm"):
            full.fill_(1.0)
        elif name.endswith("bias"):
            full.zero_()
        else:
            full.normal_(0.0, INIT_STD, generator=gen)
        if full is not param:
            param.copy_(model.shard_of(name, full))
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("built %s with random weights (%.2f GB, %s) on %s in %.1fs", config.name_or_path,
                weight_bytes(config, dtype) / 1e9, dtype, device, time.perf_counter() - t0)
    return model


class _ShapeOnly:
    """Stands in for an attention backend where only its shape is read (the meta-device twin above)."""

    def __init__(self, shape: AttentionShape):
        self.shape = shape
