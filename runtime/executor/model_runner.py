"""ModelRunner: the model, its KV memory and its attention backend on one device.

It sizes the KV pool (from ``--max-total-tokens`` or a memory fraction), owns the allocator and the
request-to-token table, and runs one forward pass per batch, returning logits only for the rows the
scheduler asks for (each request's last token, plus prompt positions whose logprobs are wanted).

On CUDA the start-up order is: weights (or a ``random:NAME`` model drawn on the device), then the KV pool
sized from the free memory left after the weights minus a reserve for the decode CUDA graphs (they need
the pool to exist before they can be captured), then graph capture (``cuda_graph``), whose time and
memory are logged. Decode batches that fit a captured size replay a graph; everything else runs eagerly.
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
from runtime.core.forward_batch import ForwardBatch
from runtime.executor.cuda_graph import CudaGraphRunner, capture_batch_sizes, graph_memory_reserve
from runtime.models.loader import attention_shape, kv_layout, load_config, load_model, resolve_model_path
from runtime.models.ops import cpu_weight_format, make_ops
from runtime.models.random_model import build_random_model, is_random_model, random_model_config

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
        self.random_weights = is_random_model(args.model)
        if self.random_weights:
            # No files: the config is a preset, the weights are drawn on the device; the tokenizer (and so
            # the generation config read next to it) is the default model's.
            self.model_path = resolve_model_path("default")
            self.hf_config = random_model_config(args.model)
        else:
            self.model_path = resolve_model_path(args.model)
            self.hf_config = load_config(self.model_path)
        backend = make_attention_backend(args.attention_backend, attention_shape(self.hf_config), self.device,
                                         args.torch_dtype)
        self.attn_backend = backend
        ops = make_ops(args.enable_deterministic_inference, cpu_weight_format(args, self.device))
        if self.random_weights:
            self.model = build_random_model(self.hf_config, backend, args.torch_dtype, self.device,
                                            args.random_seed, ops)
        else:
            self.model, _ = load_model(self.model_path, args.torch_dtype, self.device, backend, ops)
        self.model.ops.prepare(self.model)
        ctx: Any = args.context_length or getattr(self.hf_config, "max_position_embeddings", 4096)
        self.context_length = int(ctx)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.graph_runner: CudaGraphRunner | None = None
        graph_sizes = self._graph_sizes()
        self._init_memory(self._graph_reserve(graph_sizes))
        if graph_sizes:
            self._capture_graphs()
        name = args.model if self.random_weights else self.model_path.name
        logger.info("model %s loaded in %.1fs; KV pool %d tokens (%.0f MiB, page size %d) on %s", name,
                    time.perf_counter() - t0, self.allocator.capacity, self.kv.nbytes / 2**20, args.page_size,
                    self.device)

    # ------------------------------------------------------------------ memory
    def _init_memory(self, reserve_bytes: int = 0) -> None:
        """Allocator, request table and KV pool; ``reserve_bytes`` (CUDA graphs) is kept out of the budget."""
        args = self.args
        layers, kv_heads, head_dim = kv_layout(self.hf_config)
        shape = KVShape(layers, kv_heads, head_dim, args.torch_dtype)
        if args.max_total_tokens:
            capacity = args.max_total_tokens
        else:
            free = max(0, self._memory_available() - reserve_bytes)
            budget = int(free * (args.mem_fraction_static or 0.2))
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

    @property
    def max_requests(self) -> int:
        """Rows of the request-to-token table (requests that can hold KV at once)."""
        return int(self.req_to_token.table.shape[0])

    # ------------------------------------------------------------------ CUDA graphs
    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture; empty when graphs are off (CPU, the flag, or the backend)."""
        args = self.args
        if self.device.type != "cuda" or args.disable_cuda_graph:
            return []
        if not getattr(self.attn_backend, "supports_cuda_graph", False):
            logger.info("CUDA graphs are off: the %s attention backend cannot be captured (use flashinfer)",
                        self.attn_backend.name)
            return []
        return capture_batch_sizes(min(args.cuda_graph_max_bs or 256, args.max_running_requests))

    def _graph_reserve(self, sizes: list[int]) -> int:
        if not sizes:
            return 0
        arch = self.model.arch
        return graph_memory_reserve(sizes, arch.hidden_size, arch.intermediate_size, arch.num_heads,
                                    arch.num_kv_heads, arch.head_dim, self.args.torch_dtype, self.context_length,
                                    self.args.page_size)

    def _capture_graphs(self) -> None:
        runner = CudaGraphRunner(self.model, self.attn_backend, self.kv, self.req_to_token.table,
                                 min(self.args.cuda_graph_max_bs or 256, self.args.max_running_requests),
                                 self.context_length, self.device)
        seconds = runner.capture()
        self.graph_runner = runner
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1fs using %.0f MiB",
                    len(runner.sizes), runner.sizes[0], runner.max_bs, seconds, runner.memory_bytes / 2**20)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the batch; returns float32 logits (on the CPU) for ``logit_rows`` (indices into the batch's
        tokens)."""
        if logit_rows.numel() == 0:
            self.hidden_states(batch)
            return torch.empty(0, self.vocab_size)
        return self.forward_device(batch, logit_rows).cpu()

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states of every new token: a graph replay for decode batches that fit one."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        self.attn_backend.plan(batch)
        return self.model.forward(batch)

    @torch.inference_mode()
    def forward_device(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Like :meth:`forward`, leaving the float32 logits on the model's device (for on-device sampling)."""
        hidden = self.hidden_states(batch)
        return self.model.compute_logits(hidden.index_select(0, logit_rows.to(hidden.device))).float()

    def info(self) -> ModelInfo:
        archs: Any = getattr(self.hf_config, "architectures", None) or ["?"]
        path = self.args.model if self.random_weights else str(self.model_path)
        return ModelInfo(path, archs[0], self.context_length, self.vocab_size, self.args.dtype, str(self.device))
