"""Helpers for the model tests: tiny random HF checkpoints and a minimal KV-pool driver.

They live in a uniquely named module, not in ``conftest``, so imports cannot pick up another test
directory's conftest. ``PoolDriver`` plays the scheduler's part in the smallest honest way: it owns a
PagedAllocator, a ReqToTokenPool and a KVStorage, gives each request slots with ``alloc_extend`` (so with
page_size > 1 a position always sits at its page offset), writes the request-to-token rows and builds
the ForwardBatch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.kv_storage import KVShape, KVStorage
from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.models.llama import LlamaForCausalLM

VOCAB = 512

# Tiny configs, one per architecture; each exercises a different switch of the family.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama with llama3 RoPE scaling and tied embeddings (like SmolLM2).
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], rope_theta=1e6),
    # Qwen2: bias on q/k/v.
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    # Qwen3: per-head q/k RMSNorm and a head_dim that is not hidden / heads.
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(TINY_CONFIGS[arch])
    kw.update(overrides)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A random HF model whose norms and biases are random too (so a swapped weight cannot hide)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.float().eval()


class PoolDriver:
    """Allocates KV for requests and runs batches through a model (the scheduler's job, minimally)."""

    def __init__(self, model: LlamaForCausalLM, page_size: int = 1, capacity: int = 2048,
                 max_requests: int = 16, kv_dtype: torch.dtype | None = None):
        arch = model.arch
        self.model = model
        self.device = model.device
        self.alloc = PagedAllocator(capacity, page_size)
        self.table = ReqToTokenPool(max_requests, arch.max_positions, device=self.device)
        shape = KVShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, kv_dtype or model.dtype)
        self.kv = KVStorage(shape, self.alloc.total_slots, page_size, device=self.device)
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def _slots_for(self, rid: str, n: int) -> torch.Tensor:
        if rid not in self.rows:
            self.rows[rid], self.lens[rid], self.tokens[rid] = self.table.alloc(), 0, []
        cur = self.lens[rid]
        last = int(self.table.table[self.rows[rid], cur - 1]) if cur else -1
        slots = self.alloc.alloc_extend(cur, last, n)
        self.table.write(self.rows[rid], cur, slots)
        return slots

    def batch(self, work: Sequence[tuple[str, Sequence[int]]]) -> ForwardBatch:
        """Build (and account) a batch where request ``rid`` adds tokens ``ids`` after what it has."""
        slots, prefix = [], []
        for rid, ids in work:
            slots.append(self._slots_for(rid, len(ids)))
            prefix.append(self.lens[rid])
            self.lens[rid] += len(ids)
            self.tokens[rid].extend(ids)
        return build_forward_batch([list(ids) for _, ids in work], prefix, [self.rows[r] for r, _ in work],
                                   torch.cat(slots), self.kv, self.table.table, device=self.device)

    def run(self, work: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """Logits ``[extend_len, vocab]`` of every new token, per request, in ``work`` order."""
        fb = self.batch(work)
        logits = self.model.compute_logits(self.model.forward(fb)).cpu()
        return list(torch.split(logits, fb.extend_lens_cpu))


def hf_logits(hf_model: Any, ids: Sequence[int]) -> torch.Tensor:
    """HF's logits ``[len, vocab]`` (fp32) for a whole sequence."""
    with torch.no_grad():
        out = hf_model(torch.tensor([list(ids)]))
    return out.logits[0].float()
