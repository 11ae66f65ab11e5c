"""Overlap scheduling: the scheduler prepares step N+1 while the device runs step N.

Without overlap a step is strictly serial: schedule, build the batch, forward, sample, apply the results.
The device idles while the CPU schedules and applies results. With overlap (SGLang's design) the forward
pass and the sampling of a batch run on a worker — a thread issuing work on its own CUDA stream on GPU;
a plain thread on CPU, where torch releases the GIL inside its kernels, so the same logic runs and is
tested there — and each ``Scheduler.step()`` does::

    schedule + build batch N+1      (assuming every request of batch N continues)
    launch batch N+1 on the worker  (queued behind batch N)
    wait for batch N, apply its results exactly as the lockstep scheduler would

**Placeholders.** A request that samples in batch N decodes in batch N+1, whose input token is the one
batch N is still computing. Batch N+1 is built with a placeholder in that row; the worker fills it from
batch N's sampled tokens right before N+1's forward. Sampling N+1 needs only the *length* of each
request's output (the seeded draw's position, ``min_new_tokens``), which is known; requests whose sampling
reads the previous tokens' values (penalties, a grammar) make that step run in lockstep instead.

**Finishing one step late.** A request that finishes in batch N (EOS, stop string, abort by grammar) is
already in batch N+1: that row's token is discarded when N+1's results are applied, and the KV slot
allocated for it is given back (see ``_complete``). Requests that will certainly finish by length are
not scheduled again. While batch N's results are applied, the requests that hold a slot in batch N+1
have their ``kv_len`` lowered by that one slot, so the cache sees the same lengths, inserts the same
prefixes and frees the same slots as in lockstep; the integrity invariant holds between any two steps.

**Lockstep fallbacks.** Some steps apply batch N's results before building N+1, for exactness: when
the next step would retract (KV too short for every running request's next token: retraction must see
the previous step's finishes), when a running request needs the previous token's value to sample, when
batch N holds a chunk of a longer prompt (the chunked request continues, and its prefix is cached, only
once the chunk is applied; and admission must not start a second chunked prompt meanwhile), and before
any control operation between steps (``drain``: abort, flush, integrity checks, server info). Such a
step still launches its batch before returning, so the next step overlaps again.

**Data races.** The worker plans attention from a private copy of the batch's rows of the
request-to-token table, taken when the batch is built: the scheduler keeps writing the table for later
batches meanwhile. KV slots freed while a batch is in flight may be handed out again at once: the next
batch that writes them runs after it on the same worker (same stream), so the in-flight batch never sees
the new owner's data.

Outputs equal lockstep's for greedy and seeded sampling (same tokens, finish reasons, logprobs); batch
compositions differ (a request finishing at N is only known after N+1 was built), so numerics that
depend on batch shape may differ in the last bits.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from runtime.executor.sampler import SampleResult
from runtime.messages import ReqOutput
from runtime.scheduler.admission import PrefillPlan
from runtime.scheduler.batch import PromptLogprobRows, StepBatch, build_step
from runtime.scheduler.req import Req

if TYPE_CHECKING:
    from runtime.config import ServerArgs
    from runtime.executor.model_runner import ModelRunner
    from runtime.executor.sampler import Sampler
    from runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN = 0  # what a not-yet-sampled input token holds until the worker fills it in


def overlap_enabled(args: ServerArgs, device: torch.device) -> bool:
    """On by default on CUDA; on CPU only with ``--enable-overlap-schedule``; never with the disable flag."""
    if args.disable_overlap_schedule:
        return False
    return device.type == "cuda" or args.enable_overlap_schedule


# ---------------------------------------------------------------------- what the worker samples with
@dataclass
class SampleRowSnapshot:
    """A request's sampling inputs as of the step being built (``Sampler`` reads these attributes).

    ``output_ids`` is a copy whose length counts a token still being computed (a placeholder value the
    sampler never reads: requests whose sampling reads output values run in lockstep)."""

    sampling: Any
    seed: int
    output_ids: list[int]
    input_ids: list[int]
    eos_ids: frozenset[int]
    return_logprob: bool
    top_logprobs_num: int
    grammar: Any

    @classmethod
    def of(cls, req: Req, pending: bool) -> SampleRowSnapshot:
        out = [*req.output_ids, PLACEHOLDER_TOKEN] if pending else list(req.output_ids)
        return cls(req.sampling, req.seed, out, req.input_ids, req.eos_ids, req.return_logprob,
                   req.top_logprobs_num, req.grammar)


def plain_greedy(row: SampleRowSnapshot) -> bool:
    """Rows whose token is the argmax of the raw logits (nothing the sampler would change first)."""
    sp = row.sampling
    return (sp.is_greedy and not row.return_logprob and not sp.logit_bias and not sp.has_penalties
            and row.grammar is None and len(row.output_ids) >= sp.min_new_tokens)


def needs_previous_token(req: Req) -> bool:
    """Sampling this request's next token reads its previous tokens' values (not just their number)."""
    return req.grammar is not None or req.sampling.has_penalties


# ---------------------------------------------------------------------- one launched batch
@dataclass
class Job:
    sb: StepBatch
    sample_idx: list[int]  # plan indices sampled in this batch, in order
    rows: list[SampleRowSnapshot]  # their sampling inputs
    running_at_build: list[Req]  # Scheduler.running when built (= its decode plans' requests)
    pending: list[Req]  # requests whose input token here comes from ``prev``
    resolve_rows: list[int]  # token rows of the batch holding placeholders ...
    resolve_src: list[int]  # ... and the position of their token in prev's sampled tokens
    prev: Job | None
    num_decodes: int
    prefills: list[PrefillPlan]
    sample_pos: dict[int, int] = field(default_factory=dict)  # id(req) -> position in the sampled tokens
    ready: Any = None  # CUDA event: the batch's tensors are written (recorded by the scheduler thread)
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    result: SampleResult | None = None
    error: BaseException | None = None

    def tokens(self) -> list[int]:
        return self.result.token_ids if self.result is not None else []


# ---------------------------------------------------------------------- the worker
class ForwardWorker:
    """Runs jobs in submission order on one thread: fill placeholders, forward, sample."""

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler
        self.device = runner.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="radixserve-forward", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self.stream is not None:
            job.ready = torch.cuda.Event()
            job.ready.record()  # on the scheduler thread's stream, after the batch's tensors were written
        self._queue.put(job)

    def close(self) -> None:
        """Stop the thread and wait for it: a thread still inside torch when the interpreter tears down
        aborts the process ("terminate called without an active exception")."""
        self._queue.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
                with ctx:
                    self._run(job)
            except BaseException as exc:  # handed to the scheduler thread, which re-raises it
                job.error = exc
            finally:
                job.done.set()

    def _run(self, job: Job) -> None:
        if job.ready is not None and self.stream is not None:
            self.stream.wait_event(job.ready)
        fb = job.sb.forward
        if job.resolve_rows:
            prev = job.prev
            assert prev is not None and prev.done.is_set()  # jobs run in order
            if prev.error is not None:
                raise RuntimeError("the previous batch failed") from prev.error
            prev_tokens = prev.tokens()
            values = torch.tensor([prev_tokens[k] for k in job.resolve_src], dtype=fb.input_ids.dtype)
            rows = torch.tensor(job.resolve_rows, dtype=torch.int64)
            fb.input_ids[rows.to(fb.input_ids.device)] = values.to(fb.input_ids.device)
        sb = job.sb
        if job.rows and not sb.prompt_rows and all(plain_greedy(r) for r in job.rows):
            # Argmax where the logits are: no copy of [B, vocab] fp32 to the host. Same values, same
            # first-maximum tie rule as the sampler's argmax.
            logits = self.runner.forward_device(fb, sb.logit_rows)
            picks = torch.tensor([sb.sample_rows[i] for i in job.sample_idx], device=logits.device)
            ids = torch.argmax(logits.index_select(0, picks)[:, : self.sampler.vocab_size], dim=-1).tolist()
            job.logits = torch.empty(0, self.runner.vocab_size)
            job.result = SampleResult(ids, [None] * len(ids), [None] * len(ids))
            return
        job.logits = self.runner.forward(fb, sb.logit_rows)
        if job.sample_idx:
            picks = torch.tensor([sb.sample_rows[i] for i in job.sample_idx])
            job.result = self.sampler.sample(job.logits.index_select(0, picks), job.rows)


@contextlib.contextmanager
def placeholder_tokens(reqs: Sequence[Req]) -> Iterator[None]:
    """Temporarily append a placeholder for the token each request is still waiting for (so the batch
    builder sees a full-length sequence)."""
    for r in reqs:
        r.tokens.append(PLACEHOLDER_TOKEN)
    try:
        yield
    finally:
        for r in reqs:
            r.tokens.pop()


# ---------------------------------------------------------------------- the scheduler side
class OverlapScheduler:
    """Drives a :class:`Scheduler` with one batch in flight (see the module docstring)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.worker = ForwardWorker(sched.runner, sched.sampler)
        weakref.finalize(self, self.worker.close)  # the worker thread ends with its scheduler
        self.inflight: Job | None = None
        self.lockstep_steps = 0  # steps that fell back to lockstep (for tests and stats)
        self.discarded = 0  # rows computed for requests that had finished one step earlier

    # ------------------------------------------------------------------ public
    def step(self) -> list[ReqOutput]:
        s = self.sched
        t0 = time.perf_counter()
        s._collect_grammars()
        outputs, s._pending = s._pending, []
        prev = self.inflight
        pending: list[Req] = []
        if prev is not None:
            pending = self._continuing(prev)
            if self._must_lockstep(prev, pending):
                self.lockstep_steps += 1
                self.inflight = None
                outputs += self._complete(prev, [])
                prev, pending = None, []
            else:
                s.running = pending  # they decode next, unless batch N finishes them (then discarded)
        plans, prefills = s._schedule()
        job = self._launch(plans, prefills, prev, pending) if plans else None
        self.inflight = job
        if prev is not None:
            outputs += self._complete(prev, pending)
        if job is not None:
            s.stats.record_step(job.num_decodes, sum(p.extend for p in prefills), time.perf_counter() - t0)
            s._log_step(prefills, job.num_decodes)
        return outputs

    def drain(self) -> list[ReqOutput]:
        """Apply the in-flight batch's results now (lockstep state: nothing in flight)."""
        job, self.inflight = self.inflight, None
        return self._complete(job, []) if job is not None else []

    def inflight_requests(self) -> list[Req]:
        return [p.req for p in self.inflight.sb.plans] if self.inflight is not None else []

    def close(self) -> None:
        self.worker.close()

    # ------------------------------------------------------------------ building
    def _continuing(self, prev: Job) -> list[Req]:
        """Requests of ``prev`` that will decode in the next batch if none of prev's tokens stops them."""
        ctx = self.sched.runner.context_length
        out = []
        for i in prev.sample_idx:
            req = prev.sb.plans[i].req
            if req.finished is not None:  # finished after prev was built: its row there is discarded
                continue
            produced = len(req.output_ids) + 1  # prev's token is not applied yet
            if produced >= req.sampling.max_new_tokens or len(req.tokens) + 1 >= ctx:
                continue  # certainly finishes by length at prev
            out.append(req)
        return out

    def _must_lockstep(self, prev: Job, pending: list[Req]) -> bool:
        s = self.sched
        if any(needs_previous_token(r) for r in pending):
            return True
        # A prompt chunk in flight: its request continues (and its cache insert happens) only once the chunk
        # is applied, and admission must not start a second chunked prompt meanwhile.
        if any(p.req.kv is not None and p.req.kv_len < p.req.fill_len for p in prev.sb.plans):
            return True
        ps = s.cache.page_size
        # Scheduler._make_decode_room's test: would the next step retract?
        need = sum(ps for r in pending if r.kv_len % ps == 0)
        return need > s.cache.available_size

    def _launch(self, plans: list[PrefillPlan], prefills: list[PrefillPlan], prev: Job | None,
                pending: list[Req]) -> Job:
        s = self.sched
        pending_ids = {id(r) for r in pending}
        with placeholder_tokens(pending):
            sb = build_step(plans, s.runner)
        sample_idx = [i for i in sb.sample_rows
                      if plans[i].req.remaining_new_tokens() - (id(plans[i].req) in pending_ids) > 0]
        rows = [SampleRowSnapshot.of(plans[i].req, id(plans[i].req) in pending_ids) for i in sample_idx]
        resolve_rows: list[int] = []
        resolve_src: list[int] = []
        offset = 0
        for plan in plans:
            if id(plan.req) in pending_ids:
                assert prev is not None and plan.extend == 1
                resolve_rows.append(offset)
                resolve_src.append(prev.sample_pos[id(plan.req)])
            offset += plan.extend
        self._snapshot_table(sb)
        num_decodes = len(plans) - len(prefills)
        job = Job(sb, sample_idx, rows, [p.req for p in plans[:num_decodes]], pending, resolve_rows,
                  resolve_src, prev, num_decodes, prefills)
        job.sample_pos = {id(plans[i].req): k for k, i in enumerate(sample_idx)}
        self.worker.submit(job)
        return job

    @staticmethod
    def _snapshot_table(sb: StepBatch) -> None:
        """Give the batch its own copy of its rows of the request-to-token table (the scheduler keeps
        writing the table while the batch is in flight)."""
        fb = sb.forward
        width = max(fb.seq_lens_cpu, default=0) + 1
        fb.req_to_token = fb.req_to_token.index_select(0, fb.req_pool_indices)[:, :width].contiguous()
        fb.req_pool_indices = torch.arange(fb.batch_size, dtype=torch.int64, device=fb.req_pool_indices.device)

    # ------------------------------------------------------------------ applying results
    def _complete(self, job: Job, next_pending: list[Req]) -> list[ReqOutput]:
        """Wait for ``job`` and apply its results as the lockstep scheduler would. ``next_pending``: the
        requests that already hold one more KV slot in the batch built after ``job``."""
        job.done.wait()
        # The worker read prev's tokens while running job; keeping the link would chain every job of a busy
        # period (with its batch tensors and logits) to the next one.
        job.prev = None
        if job.error is not None:
            raise RuntimeError("the forward worker failed") from job.error
        s = self.sched
        sb, result = self._without_finished(job)
        holders = [r for r in next_pending if r.kv is not None]
        extra = {id(r): (r.kv.row, r.kv.kv_len - 1) for r in holders if r.kv is not None}
        for r in holders:
            assert r.kv is not None
            r.kv.kv_len -= 1  # hide the next batch's slot: the cache sees lockstep lengths
        s.running = [r for r in job.running_at_build if r.finished is None]
        try:
            assert job.logits is not None
            outputs = s._process(sb, job.logits, sampled=result)
        finally:
            for r in holders:
                if r.kv is not None:
                    r.kv.kv_len += 1
                else:  # finished at this step: its slot in the next batch is discarded
                    self._free_discarded_slot(*extra[id(r)])
        return outputs

    def _free_discarded_slot(self, row: int, position: int) -> None:
        """A finished request's slot for ``position``, allocated for the next batch. When it started a new
        page that page is still the request's alone; otherwise it shared the last page, which finishing
        already freed."""
        s = self.sched
        ps = s.cache.page_size
        if position % ps == 0:
            slot = s.runner.req_to_token.table[row, position : position + 1].to("cpu")
            s.cache.allocator.free(slot)

    def _without_finished(self, job: Job) -> tuple[StepBatch, SampleResult | None]:
        """The job's batch and sampled tokens minus the plans of requests that finished (or were aborted)
        after it was built."""
        sb, result = job.sb, job.result
        keep = [i for i, p in enumerate(sb.plans) if p.req.finished is None]
        if len(keep) == len(sb.plans):
            kept_sb = sb
        else:
            self.discarded += len(sb.plans) - len(keep)
            new_index = {old: new for new, old in enumerate(keep)}
            kept_sb = StepBatch(
                [sb.plans[i] for i in keep], sb.forward, sb.logit_rows,
                {new_index[i]: row for i, row in sb.sample_rows.items() if i in new_index},
                [PromptLogprobRows(new_index[pr.plan], pr.positions, pr.rows) for pr in sb.prompt_rows
                 if pr.plan in new_index])
        kept_samples = [k for k, i in enumerate(job.sample_idx) if sb.plans[i].req.finished is None]
        expected = [i for i in kept_sb.sample_rows if kept_sb.plans[i].req.remaining_new_tokens() > 0]
        assert len(expected) == len(kept_samples), "overlap: sampled rows disagree with the scheduler's"
        if result is None or len(kept_samples) == len(result.token_ids):
            return kept_sb, result
        return kept_sb, SampleResult([result.token_ids[k] for k in kept_samples],
                                     [result.logprobs[k] for k in kept_samples],
                                     [result.top_logprobs[k] for k in kept_samples])
