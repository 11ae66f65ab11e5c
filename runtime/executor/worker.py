"""ForwardWorker: runs one batch's forward pass and sampling, inline or one batch ahead on a thread.

The scheduler hands it a :class:`WorkItem` (tensors of the batch, which logits rows to sample and how) and
gets a :class:`WorkHandle` back. Inline (the normal loop) the work is done before ``submit`` returns. In
the overlap loop a thread runs items in submission order — on CUDA on its own stream, on CPU as a plain
thread (torch releases the GIL inside its kernels), so the same logic runs and is tested on both.
Sampling runs where the logits are, from the item's :class:`SamplingBatch` (a snapshot of the rows'
settings taken when the item was built: the worker never reads a request); only logits wanted for prompt
logprobs are copied to the host.

**Next-token table.** In the overlap loop batch N+1 is built before batch N's tokens are known, so a
request that samples in N has no input token yet in N+1. The worker keeps, on the device, the last token
sampled for every request-table row (:class:`NextTokenTable`): after sampling a batch it writes the
sampled ids there, and before running the next batch it copies them into the rows of ``input_ids`` the
item names (``fill_positions`` / ``fill_rows``). Items run in order, so the value read is always the one
the previous batch wrote; no batch refers to another.

**Cross-stream lifetime (CUDA).** Every tensor of the batch is created on the scheduler thread's stream
and read on the worker's. Two guards, for every batch (a middle prompt chunk, with no logits to read back,
included): the worker's stream waits on an event recorded after the tensors were written (data ready),
and each tensor is marked with ``record_stream`` (:func:`protect_for_stream`), so the caching allocator does
not hand its memory to a new tensor before the worker's queued kernels are done with it — however early
the scheduler drops its last reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.core.forward_batch import ForwardBatch
from runtime.executor.model_runner import ModelRunner
from runtime.executor.sampler import Sampler, SampleResult
from runtime.executor.sampling_batch import SamplingBatch


@dataclass
class WorkItem:
    """What the device runs for one batch."""

    batch: ForwardBatch
    logit_rows: torch.Tensor  # [L] token rows whose logits are wanted (host)
    sample_picks: list[int]  # rows of those logits that are sampled, in order
    sampling: SamplingBatch  # the sampling inputs of those rows (a snapshot: the worker reads no request)
    sample_table_rows: list[int]  # request-table row of each sampled request (its token goes to the table)
    fill_positions: list[int] = field(default_factory=list)  # input_ids rows whose token the previous batch
    fill_rows: list[int] = field(default_factory=list)  # samples: read from the table at these rows
    all_logits: bool = False  # the caller reads every logits row (prompt logprobs), not only the samples


@dataclass
class WorkResult:
    logits: torch.Tensor  # fp32 [L, vocab] on the host when the item wants all logits, else empty
    sampled: SampleResult | None


class WorkHandle:
    """The pending result of one submitted item."""

    def __init__(self, item: WorkItem):
        self.item = item
        self.ready: Any = None  # CUDA event recorded on the scheduler's stream after the batch was written
        self._done = threading.Event()
        self._result: WorkResult | None = None
        self._error: BaseException | None = None

    def finish(self, result: WorkResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> WorkResult:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError("the forward worker failed") from self._error
        assert self._result is not None
        return self._result


def batch_tensors(batch: ForwardBatch) -> list[torch.Tensor]:
    """Every tensor a ForwardBatch carries, by field (so a field added later is covered too); the KV pool
    is excluded: it is allocated once and never freed."""
    return [v for f in dataclasses.fields(batch) if isinstance(v := getattr(batch, f.name), torch.Tensor)]


def protect_for_stream(tensors: Iterable[Any], stream: Any) -> int:
    """``record_stream`` every CUDA tensor on ``stream``: its memory is not reused before the work queued
    there so far has run. Returns how many were marked (host tensors need nothing)."""
    n = 0
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)
            n += 1
    return n


class NextTokenTable:
    """The last token sampled for each request-table row, on the device (see the module docstring)."""

    def __init__(self, rows: int, device: torch.device):
        self.ids = torch.zeros(rows, dtype=torch.int64, device=device)

    def write(self, rows: Sequence[int], tokens: torch.Tensor) -> None:
        if rows:
            self.ids[torch.tensor(rows, device=self.ids.device)] = tokens.to(self.ids.device, torch.int64)

    def fill(self, input_ids: torch.Tensor, positions: Sequence[int], rows: Sequence[int]) -> None:
        if positions:
            dev = input_ids.device
            src = self.ids[torch.tensor(rows, device=self.ids.device)].to(dev)
            input_ids[torch.tensor(positions, device=dev)] = src.to(input_ids.dtype)


class ForwardWorker:
    """Runs items inline (``threaded=False``) or on one thread in submission order (``threaded=True``)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, threaded: bool):
        self.runner = runner
        self.sampler = sampler
        self.threaded = threaded
        self.device = runner.device
        self.tokens = NextTokenTable(runner.max_requests, self.device)
        self.stream = torch.cuda.Stream(self.device) if threaded and self.device.type == "cuda" else None
        self._queue: queue.SimpleQueue[WorkHandle | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="radixserve-forward", daemon=True)
            self._thread.start()

    def submit(self, item: WorkItem) -> WorkHandle:
        handle = WorkHandle(item)
        if not self.threaded:
            handle.finish(self._run(item))  # an error propagates to the caller directly
            return handle
        if self.stream is not None:
            handle.ready = torch.cuda.Event()
            handle.ready.record()  # on the scheduler thread's stream, after the batch's tensors were written
        self._queue.put(handle)
        return handle

    def close(self) -> None:
        """Stop the thread and wait for it: a thread still inside torch when the interpreter tears down
        aborts the process ("terminate called without an active exception")."""
        if self._thread is None:
            return
        self._queue.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            try:
                ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
                with ctx:
                    if self.stream is not None:
                        self.stream.wait_event(handle.ready)
                        protect_for_stream([*batch_tensors(handle.item.batch), handle.item.logit_rows],
                                           self.stream)
                    result = self._run(handle.item)
                handle.finish(result)
            except BaseException as exc:  # handed to the scheduler thread, which re-raises it
                handle.finish(None, exc)

    def _run(self, item: WorkItem) -> WorkResult:
        fb = item.batch
        self.tokens.fill(fb.input_ids, item.fill_positions, item.fill_rows)
        if item.logit_rows.numel() == 0:  # a middle prompt chunk: nothing to read back
            return WorkResult(self.runner.forward(fb, item.logit_rows), None)
        # Sampled where the logits are: only the rows read for prompt logprobs come to the host.
        logits = self.runner.forward_device(fb, item.logit_rows)
        sampled = None
        if item.sample_picks:
            # The sampler never writes into the logits it is given (it edits a copy of its own), so a step that
            # samples every row in order hands them over as they are (the copy: ~50 us for a batch-8 step's logits).
            picked = logits
            if item.sample_picks != list(range(logits.shape[0])):
                picked = logits.index_select(0, torch.tensor(item.sample_picks, device=logits.device))
            sampled = self.sampler.sample(picked, item.sampling)
            if self.threaded:
                self.tokens.write(item.sample_table_rows, torch.tensor(sampled.token_ids))
        host = logits.cpu() if item.all_logits else torch.empty(0, self.runner.vocab_size)
        return WorkResult(host, sampled)
