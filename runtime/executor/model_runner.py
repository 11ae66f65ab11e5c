"""ModelRunner: the model, its KV memory and its attention backend on one device.

It sizes the KV pool (from ``--max-total-tokens`` or a memory fraction), owns the allocator and the
request-to-token table, and runs one forward pass per batch, returning logits only for the rows the
scheduler asks for (each request's last token, plus prompt positions whose logprobs are wanted).

On CUDA the start-up order is: weights (or a ``random:NAME`` model drawn on the device), then the KV pool
sized from the free memory left after the weights minus a reserve for the decode CUDA graphs (they need
the pool to exist before they can be captured), then graph capture (``cuda_graph``), whose time and
memory are logged. Decode batches that fit a captured size replay a graph; everything else runs eagerly.

With ``--tp-size N > 1`` this runner is rank 0 of N (``tp_ranks``): it starts ranks 1..N-1 as processes,
splits the CPU threads between them, holds its own shard of the weights and of every KV page, and each step
broadcasts the batch before running its shard; the logits come back whole to rank 0 only. The allocator,
the request table and the radix tree stay here, so the scheduler never knows that the model is split;
``kv_pages`` is the pool as the host and disk tiers copy it, every KV head of a slot (``tp_kv``).

With ``--speculative-algorithm draft`` it also holds the draft model (``draft_model``), loaded first (a draft
whose vocabulary differs fails before the served weights load), with KV for every slot of the pool: the pool is
sized so that both storages fit the budget, and every forward here runs through the draft model too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.kv_storage import KVPages, KVShape, KVStorage
from runtime.config import ServerArgs, default_num_threads
from runtime.core.forward_batch import ForwardBatch
from runtime.distributed.comm import TPComm
from runtime.executor.cuda_graph import CudaGraphRunner, capture_batch_sizes, graph_memory_reserve
from runtime.executor.draft_model import DraftModel, load_draft
from runtime.executor.model_build import build_model, kv_shape, model_source, tp_shards
from runtime.executor.tp_kv import HeadLayout, ShardedKV
from runtime.executor.tp_ranks import MemorySpec, RankFailure, RankGroup, rank_device
from runtime.executor.tp_step import send_step, send_stop
from runtime.models.tp_plan import TPContext

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
        # resolve() is idempotent: args with a concrete device and dtype still get their other defaults and
        # validate()'s checks (a runner built in-process from hand-made args otherwise skipped both)
        args = args.resolve()
        self.args = args
        self.tp_size = args.tp_size
        self.device = rank_device(torch.device(args.device), 0) if args.tp_size > 1 else torch.device(args.device)
        threads = max(1, (args.num_threads or default_num_threads()) // args.tp_size)  # each rank its share
        if self.device.type == "cpu":
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        source = model_source(args)
        self.random_weights = source.random_weights
        self.model_path, self.hf_config = source.model_path, source.hf_config
        self.tp: TPContext | None = None
        self.ranks: RankGroup | None = None
        if args.tp_size > 1:
            shards = tp_shards(self.hf_config, args.tp_size)  # a shape that does not split fails before any spawn
            self.tp = TPContext.for_rank(shards, TPComm(0, args.tp_size, args.enable_deterministic_inference))
            self.ranks = RankGroup(args, args.tp_size, torch.device(args.device), threads)
            self._tp_lock = threading.Lock()  # one step's collectives at a time (overlap runs on a thread)
            weakref.finalize(self, _stop_ranks, self.ranks, self.tp.comm, self.device, self._tp_lock)
        self.draft: DraftModel | None = None
        try:
            self.draft = load_draft(args, self.hf_config, self.device)
            self.model, self.attn_backend = build_model(args, source, self.device, self.tp)
            ctx: Any = args.context_length or getattr(self.hf_config, "max_position_embeddings", 4096)
            self.context_length = int(ctx)
            self.vocab_size = int(self.hf_config.vocab_size)
            self.graph_runner: CudaGraphRunner | None = None
            graph_sizes = self._graph_sizes()
            self._init_memory(self._graph_reserve(graph_sizes))
            # what the host and disk tiers copy: every KV head, gathered from the ranks under TP
            self.kv_pages: KVPages = self.kv
            if self.ranks is not None and self.tp is not None:
                self.ranks.publish_memory(MemorySpec(self.kv.total_slots, args.page_size,
                                                     *self.req_to_token.table.shape))
                self.ranks.wait_ready()
                self.ranks.connect(self.tp.comm, self.device)
                self.kv_pages = ShardedKV(self.kv, HeadLayout.from_shards(self.tp.shards), self.tp.comm,
                                          self._tp_exclusive)
            if graph_sizes:
                self._capture_graphs()
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(timeout=0)
            raise
        name = args.model if self.random_weights else self.model_path.name
        tp = f", tensor parallel over {args.tp_size} ranks ({threads} threads each)" if args.tp_size > 1 else ""
        logger.info("model %s loaded in %.1fs; KV pool %d tokens (%.0f MiB, page size %d) on %s%s", name,
                    time.perf_counter() - t0, self.allocator.capacity, self.kv.nbytes / 2**20, args.page_size,
                    self.device, tp)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing without TP). Also runs when the runner is collected
        or the interpreter exits; the ranks die with this process in any case."""
        if self.ranks is not None and self.tp is not None:
            _stop_ranks(self.ranks, self.tp.comm, self.device, self._tp_lock)

    def release_memory(self) -> None:
        """Give back the KV pool, the CUDA graphs and the weights now; the runner runs nothing afterwards.

        An in-process Engine calls it once its scheduler has stopped. Without it they would go only when the
        collector breaks the reference cycles between the Engine's parts, and an Engine started meanwhile in the
        same process would size its pool from the memory still held (on a GPU: 85% of what the last one left)."""
        self.graph_runner = None
        self.kv.release()
        self.model.to("meta")
        if self.draft is not None:
            self.draft.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ memory
    def _init_memory(self, reserve_bytes: int = 0) -> None:
        """Allocator, request table and KV pool; ``reserve_bytes`` (CUDA graphs) is kept out of the budget."""
        args = self.args
        shape = kv_shape(args, self.model)
        if args.max_total_tokens:
            capacity = args.max_total_tokens
        else:
            free = max(0, self._memory_available() - reserve_bytes)
            budget = int(free * (args.mem_fraction_static or 0.2) * self._kv_budget_share(shape))
            if self.draft is not None:  # the draft's KV has a slot for each of ours: the budget pays for both
                per_token = shape.bytes_per_token
                budget = budget * per_token // (per_token + self.draft.kv_shape.bytes_per_token)
            capacity = shape.tokens_for_bytes(budget, args.page_size)
        capacity = max(args.page_size, capacity // args.page_size * args.page_size)
        self.allocator = PagedAllocator(capacity, args.page_size, self.device)
        self.req_to_token = ReqToTokenPool(args.max_running_requests + RESERVED_ROWS, self.context_length + 8,
                                           self.device)
        self.kv = KVStorage(shape, self.allocator.total_slots, args.page_size, self.device)
        if self.draft is not None:
            self.draft.attach(self.allocator.total_slots, args.page_size, self.req_to_token.table)

    def _kv_budget_share(self, shape: KVShape) -> float:
        """The part of the KV budget this rank's shard may use: on CPU every rank's shard lives in the same
        RAM (shares by KV heads held), on CUDA each rank has its own GPU (the fullest rank decides)."""
        if self.tp is None:
            return 1.0
        heads = [s.num_kv_heads for s in self.tp.shards]
        return shape.num_kv_heads / (sum(heads) if self.device.type == "cpu" else max(heads))

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
        if self.tp is not None:
            logger.info("CUDA graphs are off under tensor parallelism (the collectives are not captured yet)")
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
        if self.tp is not None:
            with self._tp_step(batch, torch.empty(0, dtype=torch.int64)):
                return self.model.forward(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            hidden = self.graph_runner.replay(batch)
        else:
            self.attn_backend.plan(batch)
            hidden = self.model.forward(batch)
        if self.draft is not None:  # every slot computed here gets the draft model's KV too (draft_model.py)
            self.draft.mirror(batch)
        return hidden

    @torch.inference_mode()
    def forward_device(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Like :meth:`forward`, leaving the float32 logits on the model's device (for on-device sampling)."""
        if self.tp is not None:
            with self._tp_step(batch, logit_rows):
                hidden = self.model.forward(batch)
                return self.model.compute_logits(hidden.index_select(0, logit_rows.to(hidden.device)))
        hidden = self.hidden_states(batch)
        return self.model.compute_logits(hidden.index_select(0, logit_rows.to(hidden.device)))

    @contextlib.contextmanager
    def _tp_step(self, batch: ForwardBatch, logit_rows: torch.Tensor) -> Iterator[None]:
        """Broadcast the step to the other ranks, then run rank 0's shard inside."""
        assert self.tp is not None
        with self._tp_exclusive():
            send_step(self.tp.comm, batch, logit_rows)
            yield

    @contextlib.contextmanager
    def _tp_exclusive(self) -> Iterator[None]:
        """One operation's collectives at a time — a forward step (on the overlap loop's worker thread) or a
        copy between KV tiers (on the scheduler's thread) — so every rank sees them in one order; a failed
        collective becomes a :class:`RankFailure` naming the rank that died."""
        assert self.ranks is not None
        if self.ranks.failure is not None:
            raise RankFailure(self.ranks.failure)
        with self._tp_lock:
            try:
                yield
            except RuntimeError as exc:
                reason = self.ranks.failure_reason()
                if reason is None:
                    raise
                raise RankFailure(reason) from exc

    def info(self) -> ModelInfo:
        archs: Any = getattr(self.hf_config, "architectures", None) or ["?"]
        path = self.args.model if self.random_weights else str(self.model_path)
        return ModelInfo(path, archs[0], self.context_length, self.vocab_size, self.args.dtype, str(self.device))


def _stop_ranks(ranks: RankGroup, comm: TPComm, device: torch.device, lock: threading.Lock) -> None:
    """Send STOP (if the group still works) and wait for the ranks to exit; idempotent."""
    if ranks.closed:
        return
    if ranks.connected and ranks.failure is None:
        with lock, contextlib.suppress(RuntimeError):
            send_stop(comm, device)
    ranks.close()
