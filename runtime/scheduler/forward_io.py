"""The typed hand-offs of one scheduler step: ``schedule_next() -> ForwardInput``, ``launch(ForwardInput) ->
ForwardOutput``, ``process(ForwardOutput) -> list[ReqOutput]`` (see ``scheduler.py``), and the overlap loop's
decisions about the batch in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radix.base import PrefixCache
from runtime.config import ServerArgs
from runtime.executor.worker import WorkHandle, WorkItem
from runtime.scheduler.admission import PrefillPlan, decode_would_retract
from runtime.scheduler.batch import StepBatch
from runtime.scheduler.req import Req


def overlap_enabled(args: ServerArgs, device: Any) -> bool:
    """Which loop runs on ``device`` (``ServerArgs.overlap_schedule``)."""
    return args.overlap_schedule(getattr(device, "type", str(device)))


@dataclass
class ForwardInput:
    """A scheduled batch: its plans (KV slots already allocated) and what the device runs for it."""

    step: StepBatch
    work: WorkItem
    sample_idx: list[int]  # plan indices sampled in this batch, in order
    first_row: list[int]  # per sampled plan, its first row of the sampled tokens (a draft adds rows after it)
    num_decodes: int  # the first ``num_decodes`` plans are running requests' decodes, the rest prefills
    started: float  # perf_counter() when scheduling began
    ahead: frozenset[int] = frozenset()  # id() of requests whose input token the previous batch samples
    build_seconds: float = 0.0  # of scheduling, the time spent turning the plans into tensors
    accepted_drafts: int = 0  # draft tokens emitted when the batch was processed (speculative decoding)

    @property
    def plans(self) -> list[PrefillPlan]:
        return self.step.plans

    @property
    def prefills(self) -> list[PrefillPlan]:
        return self.step.plans[self.num_decodes :]

    @property
    def prefill_tokens(self) -> int:
        return sum(p.extend for p in self.prefills)

    def requests(self) -> list[Req]:
        return [p.req for p in self.step.plans]


@dataclass
class ForwardOutput:
    """A launched batch: ``handle.wait()`` gives its logits and sampled tokens."""

    input: ForwardInput
    handle: WorkHandle


def needs_previous_token(req: Req) -> bool:
    """Sampling this request's next token reads its previous tokens' values (not just their number)."""
    return req.grammar is not None or req.sampling.has_penalties


def continuing_requests(prev: ForwardInput, context_length: int) -> list[Req]:
    """Requests sampled in ``prev`` that decode next unless ``prev``'s token stops them."""
    out = []
    for i in prev.sample_idx:
        req = prev.plans[i].req
        if req.finished is not None:  # finished after prev was built: its row there is discarded
            continue
        if req.tokens_left(context_length) <= 1:
            continue  # certainly finishes by length at prev
        out.append(req)
    return out


def must_process_first(prev: ForwardInput, continuing: list[Req], cache: PrefixCache) -> bool:
    """The overlap loop must process ``prev`` before scheduling the next batch (a lockstep step)."""
    if any(needs_previous_token(r) for r in continuing):
        return True
    # A prompt chunk in flight: its request continues (and its cache insert happens) only once the chunk is
    # processed, and admission must not start a second chunked prompt meanwhile.
    if any(p.req.kv is not None and p.req.kv_len < p.req.fill_len for p in prev.plans):
        return True
    return decode_would_retract(continuing, cache)  # retraction must see prev's finishes
