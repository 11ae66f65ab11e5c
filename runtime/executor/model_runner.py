"""ModelRunner: the model, its KV memory and its attention backend on one device.

It sizes the KV pool (from ``--max-total-tokens`` or a memory fraction), owns the allocator and the
request-to-token table, and runs one forward pass per batch, returning logits only for the rows the
scheduler asks for (each request's last token, plus prompt positions whose logprobs are wanted).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.kv_storage import KVShape, KVStorage
from runtime.attention import make_attention_backend
from runtime.config import ServerArgs, default_num_threads
from runtime.executor.forward_batch import ForwardBatch
from runtime.models.loader import attention_shape, kv_layout, load_config, load_model, resolve_model_path

logger = logging.getLogger(__name__)

RESERVED_ROWS = 8  # request-table rows beyond max_running_requests (prefilling requests, chunked one)


@dataclass
class ModelInfo:
    path: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    device: str


class ModelRunner:
    def __init__(self, args: ServerArgs):
        args = args.resolve() if args.device == "auto" or args.dtype == "auto" else args
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or default_num_threads())
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(args.model)
        self.hf_config = load_config(self.model_path)
        backend = make_attention_backend(args.attention_backend, attention_shape(self.hf_config), self.device)
        self.attn_backend = backend
        self.model, _ = load_model(self.model_path, args.torch_dtype, self.device, backend)
        ctx: Any = args.context_length or getattr(self.hf_config, "max_position_embeddings", 4096)
        self.context_length = int(ctx)
        self.vocab_size = int(self.hf_config.vocab_size)
        self._init_memory()
        logger.info("model %s loaded in %.1fs; KV pool %d tokens (%.0f MiB, page size %d) on %s",
                    self.model_path.name, time.perf_counter() - t0, self.allocator.capacity,
                    self.kv.nbytes / 2**20, args.page_size, self.device)

    # ------------------------------------------------------------------ memory
    def _init_memory(self) -> None:
        args = self.args
        layers, kv_heads, head_dim = kv_layout(self.hf_config)
        shape = KVShape(layers, kv_heads, head_dim, args.torch_dtype)
        if args.max_total_tokens:
            capacity = args.max_total_tokens
        else:
            budget = int(self._memory_available() * (args.mem_fraction_static or 0.2))
            capacity = shape.tokens_for_bytes(budget, args.page_size)
        capacity = max(args.page_size, capacity // args.page_size * args.page_size)
        self.allocator = PagedAllocator(capacity, args.page_size, self.device)
        self.req_to_token = ReqToTokenPool(args.max_running_requests + RESERVED_ROWS, self.context_length + 8,
                                           self.device)
        self.kv = KVStorage(shape, self.allocator.total_slots, args.page_size, self.device)

    def _memory_available(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free)
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the batch; returns float32 logits for ``logit_rows`` (indices into the batch's tokens)."""
        self.attn_backend.plan(batch)
        hidden = self.model.forward(batch)
        if logit_rows.numel() == 0:
            return torch.empty(0, self.vocab_size)
        return self.model.compute_logits(hidden.index_select(0, logit_rows.to(hidden.device))).float().cpu()

    def info(self) -> ModelInfo:
        archs: Any = getattr(self.hf_config, "architectures", None) or ["?"]
        return ModelInfo(str(self.model_path), archs[0], self.context_length, self.vocab_size,
                         self.args.dtype, str(self.device))
