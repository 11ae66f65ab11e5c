"""RequestState: what the caller side knows of one request, and its SGLang-native JSON form.

Fed with ``ReqOutput`` deltas (token ids, logprobs, finish) plus the cumulative text, it produces the
``/generate`` response object (``text``, ``output_ids``, ``meta_info``); the Engine returns the same dicts.

A streamed frame (``output_from`` > 0) carries only the output logprobs not sent before, with
``output_token_logprobs_length`` counting all of them: what SGLang's frontend merges (its
``text_async_iter(..., return_meta_data=True)``), while ``text`` and ``output_ids`` stay cumulative.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runtime.core.messages import FinishReason, ReqOutput, RequestOptions


@dataclass
class RequestState:
    rid: str
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: FinishReason | None = None
    first_token_at: float | None = None
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    spec_draft_tokens: int | None = None  # speculative decoding only
    spec_accepted_tokens: int | None = None

    def update(self, out: ReqOutput, text: str) -> None:
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids.extend(out.new_token_ids)
        self.text = text
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.finished = out.finished
        self.input_logprobs.extend(out.input_logprobs)
        self.input_top.extend(out.input_top_logprobs)
        self.output_logprobs.extend(out.output_logprobs)
        self.output_top.extend(out.output_top_logprobs)
        if out.spec_draft_tokens is not None:
            self.spec_draft_tokens, self.spec_accepted_tokens = out.spec_draft_tokens, out.spec_accepted_tokens

    def meta_info(self, options: RequestOptions | None = None, token_text: Any = None,
                  output_from: int = 0) -> dict[str, Any]:
        """``token_text(id) -> str`` adds each token's text to logprob entries (return_text_in_logprobs);
        output logprobs start at output token ``output_from`` (a stream's frames send each once)."""

        def entry(lp: float | None, tid: int) -> list[Any]:
            return [lp, tid, token_text(tid) if token_text else None]

        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finished.to_json() if self.finished else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(time.perf_counter() - self.created, 6),
        }
        if self.spec_draft_tokens is not None:  # the server speculates: draft tokens verified, and accepted
            meta["spec_draft_tokens"] = self.spec_draft_tokens
            meta["spec_accepted_tokens"] = self.spec_accepted_tokens
        opts = options or RequestOptions()
        if opts.return_logprob:
            meta["input_token_logprobs"] = [entry(lp, t) for lp, t in self.input_logprobs]
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in self.output_logprobs[output_from:]]
            meta["output_token_logprobs_length"] = len(self.output_logprobs)
            if opts.top_logprobs_num:
                meta["input_top_logprobs"] = [
                    [entry(lp, t) for lp, t in top] if top is not None else None for top in self.input_top]
                meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in top]
                                               for top in self.output_top[output_from:]]
        return meta

    def to_native(self, options: RequestOptions | None = None, token_text: Any = None,
                  output_from: int = 0) -> dict[str, Any]:
        return {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": self.meta_info(options, token_text, output_from),
        }


@dataclass
class StreamPacer:
    """When a stream sends its next frame (SGLang's ``stream_interval``, shared by /generate and the Engine):
    the first at once, then one per ``interval`` new tokens, the last always; every update when None."""

    interval: int | None
    sent_tokens: int = -1  # completion tokens at the last frame (-1: none sent yet)

    def due(self, state: RequestState) -> bool:
        """Whether ``state`` makes a frame now (and if so, it counts as sent)."""
        if (self.interval is not None and state.finished is None and self.sent_tokens >= 1
                and state.completion_tokens - self.sent_tokens < self.interval):
            return False
        self.sent_tokens = state.completion_tokens
        return True
