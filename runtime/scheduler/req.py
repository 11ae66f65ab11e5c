"""Req: the scheduler's state of one request, from arrival to finish (including retraction and resume).

Its options are the ``RequestOptions`` object the request arrived with, kept by reference."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from radix.base import ReqKV
from runtime.core.messages import FinishReason, ReqOutput, RequestOptions, TokenizedRequest
from runtime.core.sampling_params import SamplingParams
from runtime.speculative.adaptive import DraftLength


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    options: RequestOptions = field(default_factory=RequestOptions)
    eos_ids: frozenset[int] = frozenset()

    output_ids: list[int] = field(default_factory=list)
    # All tokens (prompt + output) as int32: the key the cache matches, kept in step with output_ids.
    tokens: array = field(default_factory=lambda: array("i"))
    kv: ReqKV | None = None
    cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    finished: FinishReason | None = None
    grammar: Any = None  # a compiled grammar matcher, when the request is constrained
    spec: DraftLength | None = None  # speculative decoding: the draft length and the request's draft figures

    # logprobs not yet sent (flushed into each step's ReqOutput)
    input_logprobs_done: bool = False
    first_input_logprob_added: bool = False  # the (None, first token) entry of logprob_start_len = 0
    pending_input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    pending_input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    pending_output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    pending_output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    sent_tokens: int = 0
    announced: bool = False  # the first output carries the sampling params (for the detokenizer)
    retractions: int = 0
    arrival: float = field(default_factory=time.perf_counter)

    @classmethod
    def from_message(cls, msg: TokenizedRequest, seed: int, eos_ids: frozenset[int]) -> Req:
        req = cls(
            rid=msg.rid,
            input_ids=list(msg.input_ids),
            sampling=msg.sampling,
            seed=msg.sampling.seed if msg.sampling.seed is not None else seed,
            options=msg.options,
            eos_ids=eos_ids,
        )
        req.tokens = array("i", req.input_ids)
        return req

    # The two options the sampler reads of a row (runtime/executor/sampling_batch.SamplingRow): views of
    # ``options``, not copies.
    @property
    def return_logprob(self) -> bool:
        return self.options.return_logprob

    @property
    def top_logprobs_num(self) -> int:
        return self.options.top_logprobs_num

    # ------------------------------------------------------------------ progress
    @property
    def kv_len(self) -> int:
        return self.kv.kv_len if self.kv is not None else 0

    @property
    def fill_len(self) -> int:
        """Tokens whose KV must exist before the next token can be sampled (prompt + output so far)."""
        return len(self.tokens)

    @property
    def prefilling(self) -> bool:
        return self.kv_len < self.fill_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        opts = self.options
        return opts.return_logprob and opts.logprob_start_len >= 0 and not self.input_logprobs_done

    @property
    def prompt_logprob_start(self) -> int:
        """First prompt position whose logprob is reported (len(prompt) when none are)."""
        if not self.wants_prompt_logprobs:
            return len(self.input_ids)
        return min(self.options.logprob_start_len, len(self.input_ids))

    def max_prefix_len(self) -> int:
        """How much cached KV a (re)admission may reuse. At least one token is always computed, so the
        last position yields logits; and the logprob of prompt token j needs the logits at j - 1, so
        positions from ``prompt_logprob_start - 1`` on are recomputed."""
        limit = self.fill_len - 1
        if self.wants_prompt_logprobs:
            limit = min(limit, max(0, self.prompt_logprob_start - 1))
        return limit

    def append_token(self, token: int) -> None:
        self.output_ids.append(token)
        self.tokens.append(token)

    def remaining_new_tokens(self) -> int:
        """Tokens before ``max_new_tokens`` (what admission reserves for: the context rarely binds first)."""
        return max(0, self.sampling.max_new_tokens - len(self.output_ids))

    def tokens_left(self, context_length: int) -> int:
        """Tokens it may still emit before a length limit ends it: ``max_new_tokens`` or a full context (0: it
        finishes by length). Every decision about that limit reads it here."""
        return max(0, min(self.sampling.max_new_tokens - len(self.output_ids), context_length - len(self.tokens)))

    # ------------------------------------------------------------------ output
    def take_output(self) -> ReqOutput:
        """Everything produced since the last call, as one message."""
        new = self.output_ids[self.sent_tokens :]
        self.sent_tokens = len(self.output_ids)
        out = ReqOutput(
            rid=self.rid,
            new_token_ids=new,
            finished=self.finished,
            prompt_tokens=len(self.input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=max(0, self.cached_tokens),
            output_logprobs=self.pending_output_logprobs,
            output_top_logprobs=self.pending_output_top,
            input_logprobs=self.pending_input_logprobs,
            input_top_logprobs=self.pending_input_top,
            sampling=None if self.announced else self.sampling,
            spec_draft_tokens=self.spec.drafted if self.spec is not None else None,
            spec_accepted_tokens=self.spec.accepted if self.spec is not None else None,
        )
        self.announced = True
        self.pending_output_logprobs, self.pending_output_top = [], []
        self.pending_input_logprobs, self.pending_input_top = [], []
        return out
