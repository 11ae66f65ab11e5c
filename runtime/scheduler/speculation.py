"""Speculative decoding in the scheduler's step (``--speculative-algorithm ngram|draft``, ``runtime.speculative``).

One way through the code: a decode is a plan of one new token; with a draft it is a plan of ``1 + k``.

* schedule: once every running request holds the slot of its next token (retracting if memory is short),
  :meth:`Speculation.add_drafts` asks the drafter (``runtime.speculative.drafter``: n-gram drafts or a draft
  model, the class :data:`DRAFTERS` names for the algorithm) for up to K tokens per eligible request (fewer while
  its drafts are rejected: ``runtime.speculative.adaptive``; never longer than the step's cap, the length that
  pays at this batch on this machine: ``runtime.speculative.step_budget``); the drafter takes their KV slots through
  :class:`StepSlots`, as private slots of the request, only from memory that is available (free or evictable)
  — a draft never retracts anyone;
* the batch: the plan's input is the last real token and the draft, with a logits row at each position
  (``batch.py``); :func:`sampling_layout` gives each of those rows the request's sampling row at that output
  position (``runtime.speculative.verify``);
* process: ``emit.emit_tokens`` emits the sampled tokens while the draft agreed, checking grammar, stop
  conditions and length after each as any decode does (a stop inside an accepted run drops the rest); then
  :meth:`Speculation.settle` frees the slots of the rejected positions at once: the request keeps KV for every
  token but its last (``kv_len = len(tokens) - 1``, as after any decode), the pages wholly past that go back
  to the allocator, and the unused tail of the last page stays the request's, as the allocator's page rule
  has it. So between steps no request holds a draft slot, and the KV invariant holds as without speculation;
  during a step the draft slots are counted as the request's private slots (a request that finishes before its
  step is processed, an abort, drops them first: :meth:`Speculation.finished`).

Who drafts: every decoding request but grammar-constrained ones (their matcher would have to advance through
each draft token and roll back on rejection; they decode one token per step as before). Penalties,
``min_new_tokens``, logit bias, logprobs and seeded sampling are handled per position by the verify rows.

The overlap loop builds step N+1 before N's tokens are known, so a request there has no last token to draft
from; speculation is off with it (a start-up log line says so, and no draft model is loaded).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from radix.base import PrefixCache, ReqKV
from runtime.config import ServerArgs
from runtime.executor.model_runner import ModelRunner
from runtime.executor.sampling_batch import SamplingRow
from runtime.scheduler.admission import PrefillPlan
from runtime.scheduler.req import Req
from runtime.scheduler.stats import SchedulerStats
from runtime.speculative.adaptive import DraftLength
from runtime.speculative.drafter import Drafter, DraftJob
from runtime.speculative.model_drafter import ModelDrafter
from runtime.speculative.ngram import NgramConfig, NgramDrafter
from runtime.speculative.step_budget import BUDGETS, DraftBudget
from runtime.speculative.verify import verify_rows

logger = logging.getLogger(__name__)


def ngram_drafter(args: ServerArgs, runner: ModelRunner | None) -> Drafter:
    cfg = NgramConfig(num_draft_tokens=args.speculative_num_draft_tokens,
                      min_match=args.speculative_ngram_min_match_window_size,
                      max_match=args.speculative_ngram_max_match_window_size,
                      capacity=args.speculative_ngram_capacity)
    logger.info("speculative decoding: ngram drafts of up to %d tokens (match window %d..%d, store of %d tokens)",
                cfg.num_draft_tokens, cfg.min_match, cfg.max_match, cfg.capacity)
    return NgramDrafter(cfg)


def model_drafter(args: ServerArgs, runner: ModelRunner | None) -> Drafter:
    if runner is None or runner.draft is None:
        raise ValueError("speculative_algorithm: draft needs the model runner to hold the draft model "
                         "(--speculative-draft-model)")
    logger.info("speculative decoding: drafts of up to %d tokens from the draft model %s",
                args.speculative_num_draft_tokens, runner.draft.name)
    return ModelDrafter(runner.draft)


# --speculative-algorithm -> its drafter: every method is a class behind runtime.speculative.drafter.Drafter
DRAFTERS: dict[str, Callable[[ServerArgs, ModelRunner | None], Drafter]] = {
    "ngram": ngram_drafter,
    "draft": model_drafter,
}


def make_speculation(args: ServerArgs, overlap: bool, runner: ModelRunner | None = None) -> Speculation | None:
    """The speculation of ``args`` (None: off)."""
    if args.speculative_algorithm is None:
        return None
    if overlap:
        logger.warning("speculative decoding (--speculative-algorithm %s) is off: the overlap schedule does not "
                       "support it yet; add --disable-overlap-schedule to use it", args.speculative_algorithm)
        return None
    drafter = DRAFTERS[args.speculative_algorithm](args, runner)
    step_tokens = min(args.chunk_size or args.max_prefill_tokens, args.max_prefill_tokens)
    # half a step's token budget at most
    budget = BUDGETS[args.speculative_draft_budget](args.speculative_num_draft_tokens)
    return Speculation(drafter, budget, max(1, step_tokens // 2))


class StepSlots:
    """The :class:`~runtime.speculative.drafter.DraftSlots` of one step: draft slots for the jobs' plans, from
    available memory and a budget of draft tokens (drafts count against the step's token budget and must not
    crowd waiting prompts out of it)."""

    def __init__(self, plans: Sequence[PrefillPlan], cache: PrefixCache, budget: int):
        self.plans = plans
        self.cache = cache
        self.budget = budget
        self.reserved = [0] * len(plans)

    def reserve(self, job: int, n: int) -> bool:
        plan, cache = self.plans[job], self.cache
        kv = plan.req.kv
        assert kv is not None and self.reserved[job] == 0, "one reservation per job"
        alloc = cache.allocator
        need = (alloc.pages_for(kv.kv_len + n) - alloc.pages_for(kv.kv_len)) * cache.page_size
        if n <= 0 or n > self.budget or need > cache.available_size:
            return False
        cache.alloc_tokens(kv, n)
        plan.extend += n
        self.budget -= n
        self.reserved[job] = n
        return True


class Speculation:
    def __init__(self, drafter: Drafter, budget: DraftBudget, max_step_tokens: int):
        self.drafter = drafter
        self.budget = budget  # the step's cap on draft lengths (the length that pays, or always K); max_k: K
        self.max_step_tokens = max_step_tokens  # most draft tokens in one step

    def new_state(self) -> DraftLength:
        return DraftLength(self.budget.max_k)

    def add_drafts(self, plans: Sequence[PrefillPlan], cache: PrefixCache, context_length: int) -> None:
        """Give the decode ``plans`` (each holding its next token's slot) their drafts and the drafts' slots, at
        most ``max_step_tokens`` draft tokens in all."""
        chosen: list[PrefillPlan] = []
        jobs: list[DraftJob] = []
        for plan in plans:
            req = plan.req
            if req.spec is None or req.grammar is not None or req.kv is None:
                continue
            # never past max_new_tokens or the context: every emitted token must be one the request may emit
            k = min(req.spec.want(), req.tokens_left(context_length) - 1)
            if k > 0:
                chosen.append(plan)
                jobs.append(DraftJob(req.tokens, req.options.cache_namespace, k, req.kv.row))
        cap = self.budget.cap(len(plans), len(jobs))  # what pays at this batch on this machine
        if cap <= 0:
            return
        jobs = [dataclasses.replace(job, k=min(job.k, cap)) for job in jobs]
        slots = StepSlots(chosen, cache, self.max_step_tokens)
        for plan, draft, reserved in zip(chosen, self.drafter.draft(jobs, slots), slots.reserved):
            assert len(draft) == reserved, f"a draft of {len(draft)} tokens in {reserved} slots"
            plan.draft = draft

    def settle(self, req: Req, drafted: int, accepted: int, cache: PrefixCache, stats: SchedulerStats) -> int:
        """After ``req`` verified a draft of ``drafted`` tokens and emitted ``accepted`` of them (plus the
        model's own token): record it, adapt the draft length, free the rejected positions' KV. Returns
        ``accepted``."""
        assert req.spec is not None and req.kv is not None
        req.spec.update(drafted, accepted)
        self.budget.verified(drafted, accepted)
        stats.record_verification(drafted, accepted)
        release_tail(cache, req.kv, len(req.tokens) - 1)
        return accepted

    def finished(self, req: Req, cache: PrefixCache) -> None:
        """``req`` finishes (before its KV goes to the cache). A draft scheduled and not yet processed (an abort
        between the two) holds slots past the request's tokens: they hold no token of it, so they are freed, never
        cached. Then its tokens become draft material."""
        if req.kv is not None and req.kv_len > len(req.tokens):
            release_tail(cache, req.kv, len(req.tokens))
        self.drafter.finished(req.tokens, req.cached_tokens, req.options.cache_namespace)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A forward step of ``rows`` rows took ``seconds`` (what the step budget learns from)."""
        self.budget.observe(rows, seconds)

    def clear(self) -> None:
        self.drafter.clear()


def release_tail(cache: PrefixCache, state: ReqKV, new_len: int) -> None:
    """Shrink a request's KV to its first ``new_len`` positions: the pages wholly past them are freed, a
    partly used last page stays the request's (its stale tail is overwritten by the next allocation)."""
    assert state.protected_len <= new_len <= state.kv_len, (state, new_len)
    keep = cache.allocator.pages_for(new_len) * cache.page_size
    if state.kv_len > keep:
        cache.allocator.free(cache.req_to_token.read(state.row, keep, state.kv_len))
    state.kv_len = new_len


def sampling_layout(plans: Sequence[PrefillPlan], sample_idx: Sequence[int], sample_rows: dict[int, int],
                    ahead: frozenset[int]) -> tuple[list[SamplingRow], list[bool], list[int], list[int], list[int]]:
    """The sampled rows of a batch: per row its sampling row, whether its previous token is still being sampled
    (overlap loop), its logits row and its request-table row; and per sampled plan its first row (a plan
    verifying a draft of k tokens has k + 1 consecutive rows)."""
    rows: list[SamplingRow] = []
    pending: list[bool] = []
    picks: list[int] = []
    table_rows: list[int] = []
    first: list[int] = []
    for i in sample_idx:
        req, draft = plans[i].req, plans[i].draft
        assert req.kv is not None
        first.append(len(picks))
        rows += verify_rows(req, draft) if draft else [req]
        pending += [id(req) in ahead] * (len(draft) + 1)
        picks += range(sample_rows[i], sample_rows[i] + len(draft) + 1)
        table_rows += [req.kv.row] * (len(draft) + 1)
    return rows, pending, picks, table_rows, first
