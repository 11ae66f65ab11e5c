"""Scheduler: continuous batching over the prefix cache, as three typed steps and two loops over them.

* ``schedule_next() -> ForwardInput | None``: every running request gets a slot for its next token
  (retracting requests when KV runs out), admission fills the rest of the step's token budget with waiting
  prompts (or the next chunk of a long one), and the plans become one batch.
* ``launch(input) -> ForwardOutput``: the batch's forward pass and sampling go to the ``ForwardWorker``.
* ``process(output) -> list[ReqOutput]``: tokens are applied, stop conditions checked, finished requests
  hand their KV to the cache.

With ``--speculative-algorithm ngram|draft`` (normal loop only) a running request's decode may carry a draft
that the same step verifies: see ``speculation.py``.

``step()`` runs one iteration of the loop in force; both are below, side by side. The normal loop does the
three in order. The overlap loop (default on CUDA, ``--enable-overlap-schedule`` on CPU) launches batch
N+1 *before* processing batch N, so the device never waits for the CPU's scheduling and bookkeeping:

    schedule N+1  (N's samplers continue; their input token is read on the device, see batch.py)
    launch N+1    (queued behind N on the worker)
    process N

A request that finishes in N (EOS, stop string) already has a row in N+1: that row is discarded when
N+1 is processed (``stats.discarded_rows``). Its KV — the token whose K/V the discarded row writes
included — goes to the cache when N is processed: batches run in order on the worker, so any later
reader or writer of those slots runs after N+1. Requests that will certainly finish by length are not
scheduled again. Some steps process N first (``stats.lockstep_steps``): when the next step would retract
(retraction must see N's finishes), when a request's sampling reads the previous token's value
(penalties, grammar), when N holds a chunk of a longer prompt, and before any control operation
(``drain``: abort, flush, integrity checks, server info). Outputs equal the normal loop's for greedy and
seeded sampling; numerics that depend on batch shape may differ in the last bits (bit equality is a
promise of ``--enable-deterministic-inference``). The same class runs in the server's scheduler process
and in the in-process Engine; it knows nothing about transports.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from typing import Any

from radix.base import PrefixCache
from runtime.config import ServerArgs
from runtime.core.messages import AbortCause, FinishReason, ReqOutput, SchedulerStatus, TokenizedRequest
from runtime.executor.model_runner import ModelRunner
from runtime.executor.sampler import make_sampler
from runtime.executor.worker import ForwardWorker, WorkItem
from runtime.request.intake import Limits, length_refusal
from runtime.scheduler.admission import NewTokenRatio, Outcome, PrefillAdder, PrefillPlan, decode_would_retract
from runtime.scheduler.batch import build_step, snapshot_table
from runtime.scheduler.cache_setup import make_cache
from runtime.scheduler.emit import emit_tokens
from runtime.scheduler.forward_io import (
    ForwardInput,
    ForwardOutput,
    continuing_requests,
    must_process_first,
    overlap_enabled,
)
from runtime.scheduler.grammar_queue import GrammarQueue
from runtime.scheduler.policy import make_schedule_policy
from runtime.scheduler.req import Req
from runtime.scheduler.results import live_status, log_step, record_prompt_logprobs, status_report, step_log_enabled
from runtime.scheduler.speculation import make_speculation, sampling_layout
from runtime.scheduler.stats import SchedulerStats
from runtime.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)
DECODE_LOG_INTERVAL = 40


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, tokenizer: Any, eos_ids: frozenset[int],
                 cache_event_sink: Any = None):
        self.args = args
        self.runner = runner
        self.cache: PrefixCache = make_cache(args, runner, cache_event_sink)
        self.policy = make_schedule_policy(args.schedule_policy, args.enable_priority_scheduling,
                                           args.schedule_low_priority_values_first)
        self.sampler = make_sampler(runner.vocab_size, args.enable_deterministic_inference, device=runner.device)
        self.stop = StopChecker(tokenizer, runner.context_length)
        self.tokenizer = tokenizer
        self.grammars = GrammarQueue(tokenizer, runner.vocab_size, eos_ids, self.sampler)  # waiting for their grammar
        self.eos_ids = eos_ids
        self.ratio = NewTokenRatio(args.schedule_conservativeness)
        self.rng = random.Random(args.random_seed)
        self.limits = Limits(runner.vocab_size, runner.context_length, runner.allocator.capacity,
                             args.max_running_requests)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.stats = SchedulerStats()
        self._pending: list[ReqOutput] = []  # outputs produced between steps (early finishes, aborts)
        self._decode_steps = 0
        self.overlap = overlap_enabled(args, runner.device)
        self._inflight: ForwardOutput | None = None  # overlap loop: the batch launched and not yet processed
        self._ahead: frozenset[int] = frozenset()  # id() of requests whose input token is still being sampled
        self.worker = ForwardWorker(runner, self.sampler, threaded=self.overlap)
        self.spec = make_speculation(args, self.overlap, runner)
        weakref.finalize(self, self.worker.close)  # the worker thread ends with its scheduler

    # ------------------------------------------------------------------ requests in and out
    def submit(self, msg: TokenizedRequest) -> None:
        refusal = length_refusal(len(msg.input_ids), msg.sampling.max_new_tokens, self.limits)
        assert refusal is None, f"request {msg.rid} skipped the intake (runtime.request.intake.prepare): {refusal}"
        req = Req.from_message(msg, seed=self.rng.getrandbits(63), eos_ids=self.eos_ids)
        req.spec = self.spec.new_state() if self.spec is not None else None
        if req.sampling.grammar is not None:
            self.grammars.add(req)
        else:
            self.waiting.append(req)

    def _collect_grammars(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue."""
        if not self.grammars:
            return
        ready, failed = self.grammars.collect()
        self.waiting += ready
        for req, message in failed:
            self._finish_early(req, FinishReason("abort", message=message, cause=AbortCause.INVALID))

    def abort(self, rid: str, message: str = "aborted by request", cause: AbortCause = AbortCause.CLIENT) -> bool:
        """Remove ``rid`` from the queue or the running batch and free its KV; False if unknown."""
        self.drain()
        queued = next((r for r in self.waiting if r.rid == rid), None)
        if queued is not None:
            self.waiting.remove(queued)
        else:
            queued = self.grammars.remove(rid)
        if queued is not None:
            self._finish_early(queued, FinishReason("abort", message=message, cause=cause))
            return True
        for req in self.running + ([self.chunked] if self.chunked else []):
            if req.rid == rid:
                if req is self.chunked:
                    self.chunked = None
                else:
                    self.running.remove(req)
                self._finish(req, FinishReason("abort", message=message, cause=cause))
                self._pending.append(req.take_output())
                return True
        return False

    def _finish_early(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        self._pending.append(req.take_output())
        self.stats.finished += 1

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Hand the request's KV to the cache: every token whose K/V is computed or being computed by a
        launched batch (``kv_len`` counts those slots)."""
        req.finished = reason
        if self.spec is not None:  # (first: a draft in flight is dropped, not cached)
            self.spec.finished(req, self.cache)
        if req.kv is not None:
            self.cache.cache_finished_req(req.kv, req.tokens[: req.kv_len])
            req.kv = None
        self.stats.finished += 1

    def pop_outputs(self) -> list[ReqOutput]:
        """Outputs produced between steps (early finishes, aborts); ``step()`` returns them too."""
        out, self._pending = self._pending, []
        return out

    @property
    def compiling(self) -> bool:
        """Requests are waiting for their grammar (a driver polls briefly instead of blocking)."""
        return bool(self.grammars)

    @property
    def idle(self) -> bool:
        """Nothing to do and nothing coming (a driver may block on its inbox)."""
        return not (self.busy or self.compiling)

    @property
    def busy(self) -> bool:
        """A step would do work now (otherwise only grammar compilations are pending)."""
        return bool(self.waiting or self.running or self.chunked or self._pending or self._inflight is not None)

    @property
    def inflight(self) -> ForwardOutput | None:
        """The overlap loop's launched, unprocessed batch (None between steps of the normal loop)."""
        return self._inflight

    def inflight_requests(self) -> list[Req]:
        return self._inflight.input.requests() if self._inflight is not None else []

    def admitted(self) -> list[Req]:
        """Admitted and not finished: running, the chunked prompt, and the overlap loop's batch in flight, whose
        newly admitted prompts join ``running`` only when it is processed."""
        reqs = [*self.running, *([self.chunked] if self.chunked else []), *self.inflight_requests()]
        return list({id(r): r for r in reqs if r.finished is None}.values())

    def holders(self) -> list[Req]:
        return [r for r in self.running + ([self.chunked] if self.chunked else []) if r.kv is not None]

    # ------------------------------------------------------------------ the two loops
    def step(self) -> list[ReqOutput]:
        """One iteration of the loop in force (overlap or normal)."""
        return self._overlap_step() if self.overlap else self._normal_step()

    def _normal_step(self) -> list[ReqOutput]:
        outputs = self.pop_outputs()
        inp = self.schedule_next()
        if inp is not None:
            outputs += self.process(self.launch(inp))
            self._record(inp)
        return outputs

    def _overlap_step(self) -> list[ReqOutput]:
        outputs = self.pop_outputs()
        prev, self._inflight = self._inflight, None
        if prev is not None:
            continuing = continuing_requests(prev.input, self.runner.context_length)
            if must_process_first(prev.input, continuing, self.cache):
                self.stats.lockstep_steps += 1
                outputs += self.process(prev)
                prev = None
            else:
                self.running, self._ahead = continuing, frozenset(id(r) for r in continuing)
        try:
            inp = self.schedule_next()
        finally:
            self._ahead = frozenset()
        if inp is not None:
            self._inflight = self.launch(inp)
        if prev is not None:
            outputs += self.process(prev)
        if inp is not None:
            self._record(inp)
        return outputs

    def drain(self) -> None:
        """Process the overlap loop's in-flight batch now (its outputs come with the next step), so control
        operations see every request where the normal loop would have it."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._pending += self.process(prev)

    def close(self) -> None:
        self.drain()
        self.worker.close()

    def _record(self, inp: ForwardInput) -> None:
        seconds = time.perf_counter() - inp.started
        self.stats.record_step(inp.num_decodes + inp.accepted_drafts, inp.prefill_tokens, seconds)
        if self.spec is not None:
            self.spec.observe_step(inp.step.forward.num_tokens, seconds)
        self._log_step(inp.prefills, inp.num_decodes)

    # ------------------------------------------------------------------ 1. schedule
    def schedule_next(self) -> ForwardInput | None:
        """The next batch: a decode slot for every running request, then admitted prefills (None: no work)."""
        t0 = time.perf_counter()
        self._collect_grammars()
        self._make_decode_room()
        plans = [PrefillPlan(r, 1) for r in self.running]
        states = [r.kv for r in self.running if r.kv is not None]
        assert len(states) == len(self.running)
        self.cache.alloc_decode_tokens(states)
        if self.spec is not None:
            self.spec.add_drafts(plans, self.cache, self.runner.context_length)
        num_decodes = len(plans)
        plans += self._admit(sum(p.extend for p in plans))
        if not plans:
            return None
        ahead = self._ahead
        t_build = time.perf_counter()
        step = build_step(plans, self.runner, ahead)
        ctx = self.runner.context_length  # a request whose input token is still being sampled has one less
        sample_idx = [i for i in step.sample_rows if plans[i].req.tokens_left(ctx) - (id(plans[i].req) in ahead) > 0]
        rows, pending, picks, table_rows, first = sampling_layout(plans, sample_idx, step.sample_rows, ahead)
        if self.overlap:  # run on the worker thread while this thread keeps changing the table
            snapshot_table(step.forward)
        sampling = self.sampler.prepare(rows, pending)  # a snapshot, in both loops
        work = WorkItem(step.forward, step.logit_rows, picks, sampling, table_rows, step.fill_positions,
                        step.fill_rows, all_logits=bool(step.prompt_rows))
        return ForwardInput(step, work, sample_idx, first, num_decodes, t0, ahead, time.perf_counter() - t_build)

    def _make_decode_room(self) -> None:
        """Retract running requests until every remaining one can get its next token's slot."""
        while self.running and decode_would_retract(self.running, self.cache):
            victim = self.policy.retraction_victim(self.running)
            self.running.remove(victim)
            assert victim.kv is not None and id(victim) not in self._ahead
            self.cache.release_req(victim.kv)
            victim.kv = None
            victim.retractions += 1
            self.waiting.insert(0, victim)
            self.ratio.on_retract()
            self.stats.retractions += 1
            logger.warning("KV memory is short: retracted request %s (%d tokens); it will resume later",
                           victim.rid, victim.fill_len)

    def _admit(self, decode_tokens: int) -> list[PrefillPlan]:
        chunk = self.args.chunk_size
        budget = max(chunk - decode_tokens, self.cache.page_size) if chunk else self.args.max_prefill_tokens
        budget = min(budget, self.args.max_prefill_tokens)
        reserved = sum(self.ratio.reserve(r) for r in self.running)
        adder = PrefillAdder(self.cache, budget, reserved, self.ratio, chunk,
                             self.args.max_running_requests - len(self.running))
        if self.chunked is not None and adder.add_chunked(self.chunked) is Outcome.STOP:
            return adder.plans
        if self.waiting:
            for req in self.policy.order(self.waiting, self.cache):
                outcome = adder.add_new(req)
                if outcome is Outcome.STOP:
                    break
                if outcome is Outcome.ADDED:
                    self.waiting.remove(req)
        return adder.plans

    # ------------------------------------------------------------------ 2. launch
    def launch(self, inp: ForwardInput) -> ForwardOutput:
        """Hand the batch to the worker: run now (normal loop) or queued behind the batch in flight."""
        return ForwardOutput(inp, self.worker.submit(inp.work))

    # ------------------------------------------------------------------ 3. process
    def process(self, out: ForwardOutput) -> list[ReqOutput]:
        """Apply a launched batch's results (waiting for them). Plans of requests that finished or were
        aborted after the batch was built are skipped: their rows are discarded."""
        inp = out.input
        result = out.handle.wait()
        plans = inp.plans
        live = {i for i, p in enumerate(plans) if p.req.finished is None}
        self.stats.discarded_rows += len(plans) - len(live)
        drawn = {i: inp.first_row[k] for k, i in enumerate(inp.sample_idx) if i in live}
        assert sorted(drawn) == [i for i in sorted(inp.step.sample_rows) if i in live
                                 and plans[i].req.tokens_left(self.runner.context_length) > 0], "sampled rows disagree"
        record_prompt_logprobs(inp.step, result.logits, self.sampler, live)
        sampled = result.sampled
        # requests holding a slot in the batch launched after this one: the cache sees their lockstep length
        ahead = self._inflight.input.ahead if self._inflight is not None else frozenset()
        still_running: list[Req] = []
        outputs: list[ReqOutput] = []
        for i in sorted(live):
            req = plans[i].req
            assert req.kv is not None
            if req.kv_len < req.fill_len:  # a chunk of a longer prompt
                self.cache.cache_unfinished_req(req.kv, req.tokens[: req.kv_len])
                self.chunked = req
                self.stats.prefill_chunks += 1
                continue
            if req is self.chunked:
                self.chunked = None
            req.input_logprobs_done = True
            finish: FinishReason | None
            if i in drawn and sampled is not None:
                draft = plans[i].draft
                finish, emitted = emit_tokens(req, sampled, drawn[i], draft, self.stop)
                if draft and self.spec is not None:  # the rejected positions' KV is freed now
                    inp.accepted_drafts += self.spec.settle(req, len(draft), emitted - 1, self.cache, self.stats)
            else:
                finish = FinishReason("length", length=len(req.output_ids))
            if finish is not None:
                self._finish(req, finish)
            else:
                if i >= inp.num_decodes:  # its prompt is complete: cache it now, others may hit it
                    self.cache.cache_unfinished_req(req.kv, req.tokens[: req.kv_len - (id(req) in ahead)])
                still_running.append(req)
            if req.finished is not None or req.options.stream:
                outputs.append(req.take_output())
        self.running = still_running
        return outputs

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are queued or running."""
        self.drain()
        if not self.idle:
            return False
        self.cache.reset()
        if self.spec is not None:
            self.spec.clear()
        return True

    def check_integrity(self) -> dict[str, int]:
        self.drain()
        return self.cache.check_integrity([r.kv for r in self.holders() if r.kv is not None])

    def status(self) -> SchedulerStatus:
        """The live figures (queues, KV books, cache, counters), cheap enough to compute twice a second: no
        drain of an in-flight batch, no integrity check."""
        return live_status(self.cache, self.stats, len(self.admitted()), len(self.waiting))

    def server_info(self) -> dict[str, Any]:
        """The live figures plus KV accounting (checked), cache and scheduler details."""
        self.drain()
        return status_report(self.status(), self.cache, self.stats, self.policy, self.ratio.value,
                             self.check_integrity())

    def _log_step(self, prefills: list[PrefillPlan], decodes: int) -> None:
        if not prefills and decodes:
            self._decode_steps += 1
            self.ratio.step()
        if step_log_enabled() and (prefills or self._decode_steps % DECODE_LOG_INTERVAL == 0):
            log_step(self.status(), prefills, decodes)
