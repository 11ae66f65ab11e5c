"""CUDA graphs for decode: capture the model's decode step at start-up for a set of batch sizes, replay.

A decode step of a small model is hundreds of short kernels; launching them one by one from Python costs
more than running them. At start-up the runner captures ``model.forward`` (embedding, every layer,
final norm) for each batch size of :func:`capture_batch_sizes` up to ``--cuda-graph-max-bs``, largest
first, all in one memory pool (a smaller graph reuses the larger one's scratch memory). A decode batch
of ``b`` requests replays the graph of the smallest captured size ``bs >= b``:

* its token ids, positions and KV slots are copied into the graph's static input buffers, rows ``b ..
  bs - 1`` get padding (token 0, position 0, KV slot 0: the reserved page 0, which nobody owns);
* the attention backend re-plans that size's wrapper (outside the graph; page tables are data, so one
  graph serves every context length), padding rows attend over one token of page 0;
* the graph replays and the first ``b`` rows of its output are the hidden states. Logits are computed
  outside the graph, exactly as without graphs, on the real rows only.

Only backends that can plan into fixed buffers (``supports_cuda_graph``: flashinfer) are captured. The
RoPE tables are grown to the full context before capture so no replay reads a table that was replaced.
Batches larger than the biggest graph, and every prefill/mixed batch, run eagerly.

The bucket and padding bookkeeping are pure functions (tested on CPU); capture and replay need CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from runtime.core.forward_batch import ForwardBatch, ForwardMode, build_forward_batch

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8  # captured sizes above 8 go up in steps of 8: padding wastes < 8 rows
WARMUP_RUNS = 2
FLASHINFER_INT_WORKSPACE = 8 * 1024 * 1024  # each planned FlashInfer wrapper allocates this much


# ---------------------------------------------------------------------- pure bookkeeping
def capture_batch_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_bs`` (always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = {s for s in SMALL_SIZES if s <= max_bs}
    sizes.update(range(2 * SIZE_STEP, max_bs + 1, SIZE_STEP))
    sizes.add(max_bs)
    return sorted(sizes)


def bucket_for(batch_size: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``batch_size`` requests (None: too big, run eagerly)."""
    if batch_size < 1:
        return None
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def padding_rows(batch_size: int, bucket: int) -> int:
    return bucket - batch_size


def fill_static(static: torch.Tensor, values: torch.Tensor, bucket: int, pad_value: int = 0) -> None:
    """Copy ``values`` into ``static[:len(values)]`` and ``pad_value`` into the rest of ``static[:bucket]``."""
    n = values.numel()
    if n > bucket or bucket > static.numel():
        raise ValueError(f"{n} values do not fit a bucket of {bucket} in a buffer of {static.numel()}")
    static[:n].copy_(values, non_blocking=True)
    if bucket > n:
        static[n:bucket].fill_(pad_value)


def max_graph_pages(max_bs: int, context_length: int, page_size: int) -> int:
    """Index-buffer size of the decode graphs: every request at full context (shared prefixes count once per
    request, so this can exceed the pool's page count)."""
    return max_bs * (-(-context_length // page_size)) + max_bs


def graph_memory_reserve(sizes: Sequence[int], hidden_size: int, intermediate_size: int, num_heads: int,
                         num_kv_heads: int, head_dim: int, dtype: torch.dtype, context_length: int,
                         page_size: int) -> int:
    """Bytes the decode graphs will take once captured, for sizing the KV pool before capture (the graphs
    need the pool to exist, so the pool cannot be sized from a measurement taken after them).

    The shared pool holds the largest graph's transient activations (the per-layer intermediates: fused QKV,
    attention output, gate/up, residual copies) plus each graph's static output; each size also gets a
    FlashInfer wrapper with its own integer workspace; the index buffers are shared."""
    if not sizes:
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = (4 * hidden_size + (num_heads + 2 * num_kv_heads) * head_dim + 2 * num_heads * head_dim
                 + 3 * intermediate_size) * elem
    transient = max(sizes) * per_token
    outputs = sum(sizes) * hidden_size * elem
    wrappers = len(sizes) * FLASHINFER_INT_WORKSPACE
    indices = 4 * (max_graph_pages(max(sizes), context_length, page_size) + 2 * max(sizes) + 1)
    return transient + outputs + wrappers + indices


# ---------------------------------------------------------------------- capture and replay (CUDA)
class CudaGraphRunner:
    """Captured decode graphs of one model over one KV pool (see the module docstring)."""

    def __init__(self, model: Any, backend: Any, kv: Any, req_to_token: torch.Tensor, max_bs: int,
                 context_length: int, device: torch.device):
        if device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if not getattr(backend, "supports_cuda_graph", False):
            raise RuntimeError(f"the {backend.name} attention backend cannot be captured in a CUDA graph")
        self.model = model
        self.backend = backend
        self.kv = kv
        self.req_to_token = req_to_token
        self.device = device
        self.context_length = context_length
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        backend.init_cuda_graph_state(self.max_bs, max_graph_pages(self.max_bs, context_length, kv.page_size))
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def _static_batch(self, bs: int) -> ForwardBatch:
        """The batch the graph of size ``bs`` is captured with: its tensors are views of the static buffers."""
        ones = torch.ones(bs, dtype=torch.int64, device=self.device)
        zeros = torch.zeros(bs, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=zeros, seq_lens=ones, prefix_lens=zeros,
            extend_lens=ones, seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs, extend_lens_cpu=[1] * bs,
            kv=self.kv, req_to_token=self.req_to_token)

    def _empty_batch(self) -> ForwardBatch:
        return build_forward_batch([], [], [], torch.empty(0, dtype=torch.int64), self.kv, self.req_to_token,
                                   self.device)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (largest first, one shared memory pool); returns the seconds it took."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        self.model.rotary.ensure(self.context_length + 1)  # no table growth (reallocation) after capture
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        empty = self._empty_batch()
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.zero_()
        for bs in reversed(self.sizes):
            batch = self._static_batch(bs)
            batch.attn_metadata = self.backend.plan_cuda_graph(empty, bs)  # all rows padding
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):  # JIT compilation, cuBLAS handles and workspaces outside the graph
                    self.model.forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.model.forward(batch)
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.memory_bytes = max(0, free_before - free_after)
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and 0 < batch.batch_size <= self.max_bs and bool(self.graphs)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[b, hidden]`` of a decode batch of ``b <= max_bs`` requests, through its graph."""
        b = batch.batch_size
        bs = bucket_for(b, self.sizes)
        assert bs is not None, f"batch of {b} exceeds the largest graph ({self.max_bs})"
        fill_static(self.input_ids, batch.input_ids, bs)
        fill_static(self.positions, batch.positions, bs)
        fill_static(self.out_cache_loc, batch.out_cache_loc, bs)  # padding writes K/V to slot 0 (page 0)
        batch.attn_metadata = self.backend.plan_cuda_graph(batch, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
