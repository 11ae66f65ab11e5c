"""Scheduler: continuous batching over the prefix cache, one ``step()`` at a time.

A step: every running request gets a slot for its next token (retracting requests when KV runs out),
admission fills the rest of the step's token budget with waiting prompts (or the next chunk of a long
one), one forward pass runs the mixed batch, tokens are sampled, and finished requests hand their KV to
the cache. The same class runs inside the server's scheduler process and inside the in-process Engine;
it knows nothing about transports.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Future
from typing import Any

import torch

from radix.base import PrefixCache
from radix.naive_cache import NaiveCache
from radix.radix_cache import RadixCache
from runtime.config import ServerArgs
from runtime.constrained.grammar import GrammarBackend, GrammarMasker
from runtime.executor.model_runner import ModelRunner
from runtime.executor.sampler import SampleResult, make_sampler
from runtime.messages import FinishReason, ReqOutput, TokenizedRequest
from runtime.scheduler.admission import NewTokenRatio, Outcome, PrefillAdder, PrefillPlan
from runtime.scheduler.batch import StepBatch, build_step
from runtime.scheduler.overlap import OverlapScheduler, overlap_enabled
from runtime.scheduler.policy import make_schedule_policy
from runtime.scheduler.req import Req
from runtime.scheduler.stats import SchedulerStats
from runtime.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)
DECODE_LOG_INTERVAL = 40


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, tokenizer: Any, eos_ids: frozenset[int],
                 cache_event_sink: Any = None):
        self.args = args
        self.runner = runner
        self.cache: PrefixCache
        if args.disable_radix_cache:
            self.cache = NaiveCache(runner.allocator, runner.req_to_token)
        else:
            self.cache = RadixCache(runner.allocator, runner.req_to_token, args.eviction_policy, cache_event_sink)
        self.policy = make_schedule_policy(args.schedule_policy, args.enable_priority_scheduling,
                                           args.schedule_low_priority_values_first)
        self.sampler = make_sampler(runner.vocab_size, args.enable_deterministic_inference)
        self.stop = StopChecker(tokenizer, runner.context_length)
        self.tokenizer = tokenizer
        self._grammar: GrammarBackend | None = None
        self.compiling: list[tuple[Req, Future[Any]]] = []  # waiting for their grammar
        self.eos_ids = eos_ids
        self.ratio = NewTokenRatio(args.schedule_conservativeness)
        self.rng = random.Random(args.random_seed)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.stats = SchedulerStats()
        self._pending: list[ReqOutput] = []
        self._decode_steps = 0
        # Overlap scheduling (overlap.py): step N+1 is prepared while step N runs on a worker.
        self.overlap = OverlapScheduler(self) if overlap_enabled(args, runner.device) else None

    # ------------------------------------------------------------------ requests in and out
    def submit(self, msg: TokenizedRequest) -> None:
        req = Req.from_message(msg, seed=self.rng.getrandbits(63), eos_ids=self.eos_ids)
        error = self._admissible(req)
        if error:
            self._finish_early(req, FinishReason("abort", message=error, status_code=400))
            return
        grammar = req.sampling.grammar
        if grammar is not None:
            self.compiling.append((req, self._grammar_backend().compile_async(*grammar)))
            return
        self.waiting.append(req)

    def _grammar_backend(self) -> GrammarBackend:
        if self._grammar is None:  # built on first use: most servers never see a grammar
            self._grammar = GrammarBackend(self.tokenizer, self.runner.vocab_size, sorted(self.eos_ids))
            self.sampler.grammar_masker = GrammarMasker(self.runner.vocab_size)
        return self._grammar

    def _collect_grammars(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue."""
        if not self.compiling:
            return
        still = []
        for req, fut in self.compiling:
            if not fut.done():
                still.append((req, fut))
                continue
            exc = fut.exception()
            if exc is not None:
                self._finish_early(req, FinishReason("abort", message=str(exc), status_code=400))
                continue
            req.grammar = self._grammar_backend().matcher(fut.result())
            self.waiting.append(req)
        self.compiling = still

    def _admissible(self, req: Req) -> str | None:
        n = len(req.input_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.runner.context_length:
            return f"the prompt has {n} tokens; the model's context length is {self.runner.context_length}"
        if n + 1 > self.runner.allocator.capacity:
            return f"the prompt needs {n + 1} KV tokens but the pool holds {self.runner.allocator.capacity}"
        return None

    def abort(self, rid: str, message: str = "aborted by request", status_code: int | None = None) -> bool:
        """Remove ``rid`` from the queue or the running batch and free its KV; False if unknown."""
        self._drain_overlap()
        for req in self.waiting + [r for r, _ in self.compiling]:
            if req.rid == rid:
                if req in self.waiting:
                    self.waiting.remove(req)
                else:
                    self.compiling = [(r, f) for r, f in self.compiling if r is not req]
                self._finish_early(req, FinishReason("abort", message=message, status_code=status_code))
                return True
        for req in self.running + ([self.chunked] if self.chunked else []):
            if req.rid == rid:
                if req is self.chunked:
                    self.chunked = None
                else:
                    self.running.remove(req)
                self._finish(req, FinishReason("abort", message=message, status_code=status_code))
                self._pending.append(req.take_output())
                return True
        return False

    def _finish_early(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        self._pending.append(req.take_output())
        self.stats.finished += 1

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        if req.kv is not None:
            self.cache.cache_finished_req(req.kv, req.tokens[: req.kv_len])
            req.kv = None
        self.stats.finished += 1

    @property
    def idle(self) -> bool:
        """Nothing to do and nothing coming (a driver may block on its inbox)."""
        return not (self.busy or self.compiling)

    @property
    def busy(self) -> bool:
        """A step would do work now (otherwise only grammar compilations are pending)."""
        return bool(self.waiting or self.running or self.chunked or self._pending
                    or (self.overlap is not None and self.overlap.inflight is not None))

    def holders(self) -> list[Req]:
        return [r for r in self.running + ([self.chunked] if self.chunked else []) if r.kv is not None]

    # ------------------------------------------------------------------ one step
    def step(self) -> list[ReqOutput]:
        if self.overlap is not None:
            return self.overlap.step()
        t0 = time.perf_counter()
        self._collect_grammars()
        outputs, self._pending = self._pending, []
        plans, prefills = self._schedule()
        if not plans:
            return outputs
        sb = build_step(plans, self.runner)
        logits = self.runner.forward(sb.forward, sb.logit_rows)
        outputs += self._process(sb, logits)
        self.stats.record_step(len(plans) - len(prefills), sum(p.extend for p in prefills), time.perf_counter() - t0)
        self._log_step(prefills, len(plans) - len(prefills))
        return outputs

    def _schedule(self) -> tuple[list[PrefillPlan], list[PrefillPlan]]:
        """The next batch's plans (a decode slot for every running request, then admitted prefills) and,
        separately, the prefills."""
        self._make_decode_room()
        plans = [PrefillPlan(r, 1) for r in self.running]
        for plan in plans:
            assert plan.req.kv is not None
            self.cache.alloc_tokens(plan.req.kv, 1)
        prefills = self._admit(len(plans))
        return plans + prefills, prefills

    def _drain_overlap(self) -> None:
        """Apply an in-flight overlap batch now, so control operations see lockstep state."""
        if self.overlap is not None:
            self._pending += self.overlap.drain()

    def _make_decode_room(self) -> None:
        """Retract running requests until every remaining one can get its next token's slot."""
        ps = self.cache.page_size
        while self.running:
            need = sum(ps for r in self.running if r.kv_len % ps == 0)
            if need <= self.cache.available_size:
                return
            victim = self.policy.retraction_victim(self.running)
            self.running.remove(victim)
            assert victim.kv is not None
            self.cache.release_req(victim.kv)
            victim.kv = None
            victim.retractions += 1
            self.waiting.insert(0, victim)
            self.ratio.on_retract()
            self.stats.retractions += 1
            logger.warning("KV memory is short: retracted request %s (%d tokens); it will resume later",
                           victim.rid, victim.fill_len)

    def _admit(self, num_decodes: int) -> list[PrefillPlan]:
        chunk = self.args.chunk_size
        budget = max(chunk - num_decodes, self.cache.page_size) if chunk else self.args.max_prefill_tokens
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

    # ------------------------------------------------------------------ results
    def _process(self, sb: StepBatch, logits: torch.Tensor, sampled: SampleResult | None = None) -> list[ReqOutput]:
        """Apply a step's results. ``sampled``: tokens already drawn for the sampled rows (overlap mode)."""
        plans = sb.plans
        sample_idx = [i for i in sb.sample_rows if plans[i].req.remaining_new_tokens() > 0]
        result = sampled
        if sample_idx and result is None:
            rows = torch.tensor([sb.sample_rows[i] for i in sample_idx])
            result = self.sampler.sample(logits.index_select(0, rows), [plans[i].req for i in sample_idx])
        drawn = {i: k for k, i in enumerate(sample_idx)}
        self._prompt_logprobs(sb, logits)
        running_ids = {id(r) for r in self.running}
        still_running: list[Req] = []
        outputs: list[ReqOutput] = []
        for i, plan in enumerate(plans):
            req = plan.req
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
            if i in drawn and result is not None:
                k = drawn[i]
                token = result.token_ids[k]
                req.append_token(token)
                if req.grammar is not None and not req.grammar.accept_token(token):
                    self._finish(req, FinishReason("abort", message=f"token {token} violates the grammar"))
                    outputs.append(req.take_output())
                    continue
                if req.return_logprob:
                    lp = result.logprobs[k]
                    req.pending_output_logprobs.append((float(lp) if lp is not None else 0.0, token))
                    if req.top_logprobs_num:
                        req.pending_output_top.append(result.top_logprobs[k] or [])
                finish = self.stop.check(req)
            else:
                finish = FinishReason("length", length=len(req.output_ids))
            if finish is not None:
                self._finish(req, finish)
            else:
                if id(req) not in running_ids:
                    self.cache.cache_unfinished_req(req.kv, req.tokens[: req.kv_len])
                still_running.append(req)
            if req.finished is not None or req.stream:
                outputs.append(req.take_output())
        self.running = still_running
        return outputs

    def _prompt_logprobs(self, sb: StepBatch, logits: torch.Tensor) -> None:
        for plan in sb.plans:
            req = plan.req
            if req.wants_prompt_logprobs and req.prompt_logprob_start == 0 and not req.first_input_logprob_added:
                # the first prompt token has no context, so no logprob (SGLang reports None)
                req.pending_input_logprobs.append((None, req.tokens[0]))
                req.pending_input_top.append(None)
                req.first_input_logprob_added = True
        for pr in sb.prompt_rows:
            req = sb.plans[pr.plan].req
            logp = self.sampler.log_softmax(logits[pr.rows[0] : pr.rows[-1] + 1])
            targets = torch.tensor([req.tokens[p + 1] for p in pr.positions])
            vals = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            for j, p in enumerate(pr.positions):
                req.pending_input_logprobs.append((vals[j], req.tokens[p + 1]))
                if req.top_logprobs_num:
                    tv, ti = torch.topk(logp[j], req.top_logprobs_num)
                    req.pending_input_top.append(list(zip(tv.tolist(), ti.tolist())))

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are queued or running."""
        self._drain_overlap()
        if not self.idle:
            return False
        self.cache.reset()
        return True

    def check_integrity(self) -> dict[str, int]:
        self._drain_overlap()
        return self.cache.check_integrity([r.kv for r in self.holders() if r.kv is not None])

    def server_info(self) -> dict[str, Any]:
        """Queue sizes, KV accounting (checked), cache and scheduler statistics."""
        self._drain_overlap()
        cs = self.cache.stats()
        return {
            "num_running_reqs": len(self.running) + (1 if self.chunked else 0),
            "num_waiting_reqs": len(self.waiting),
            "kv": self.check_integrity(),
            "cache": {
                "enabled": not isinstance(self.cache, NaiveCache),
                "hit_tokens": cs.hit_tokens,
                "miss_tokens": cs.miss_tokens,
                "hit_rate": round(cs.hit_rate, 4),
                "cached_tokens": cs.cached_tokens,
                "num_nodes": cs.num_nodes,
                "evictable_size": cs.evictable_size,
                "protected_size": cs.protected_size,
                "evicted_tokens": cs.evicted_tokens,
                "eviction_policy": self.cache.eviction_policy,
                "page_size": self.cache.page_size,
            },
            "scheduler": {**self.stats.as_dict(), "schedule_policy": self.policy.name,
                          "queue_reorders": self.policy.reorders},
            "new_token_ratio": round(self.ratio.value, 4),
        }

    def _log_step(self, prefills: list[PrefillPlan], decodes: int) -> None:
        if prefills:
            new_tokens = sum(p.extend for p in prefills)
            logger.info("prefill: %d seqs, %d new tokens, cache hit rate %.1f%%, %d running, %d queued",
                        len(prefills), new_tokens, 100 * self.cache.stats().hit_rate, len(self.running),
                        len(self.waiting))
        elif decodes:
            self._decode_steps += 1
            self.ratio.step()
            if self._decode_steps % DECODE_LOG_INTERVAL == 0:
                logger.info("decode: %d running, %d queued, %.1f tokens/s, KV usage %.1f%%", decodes,
                            len(self.waiting), self.stats.decode_throughput(),
                            100 * (1 - self.cache.available_size / self.cache.allocator.capacity))
