"""Incremental detokenization of one request's output, with stop-string trimming.

Each step decodes only a short window of recent tokens (from ``surr`` to the end) and keeps the part
after the window's already-committed text, so the cost per step does not grow with the output. A window
whose text ends in U+FFFD holds an incomplete multi-byte character (a UTF-8 sequence split across
tokens) and is not committed until the next token completes it.

While streaming, text that could be the beginning of a stop string, or of a match of a stop regex, is held
back, so the cumulative text a client sees never has to shrink and never runs past a stop. When the request
finishes, the final text is one full decode of the output (minus a matched stop token, trimmed at a matched
stop string or regex match; with ``no_stop_trim``, kept through the end of the match as SGLang does), and
it always extends what was streamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.core import stop_regex
from runtime.core.messages import FinishReason
from runtime.core.sampling_params import SamplingParams


@dataclass
class DecodeStream:
    tokenizer: Any
    sampling: SamplingParams
    ids: list[int] = field(default_factory=list)
    text: str = ""  # committed text (complete characters)
    surr: int = 0
    read: int = 0
    sent: int = 0  # characters of text already handed out
    released: int = 0  # characters of text ``add`` has returned (never shrinks)
    final: bool = False

    def _decode(self, ids: list[int]) -> str:
        sp = self.sampling
        return self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens,
                                     spaces_between_special_tokens=sp.spaces_between_special_tokens)

    def add(self, new_ids: list[int], finished: FinishReason | None) -> str:
        """Feed the new tokens; returns the cumulative text that may be shown now."""
        self.ids.extend(new_ids)
        if finished is not None:
            self.text = self._final_text(finished)
            self.final = True
            return self.text
        if new_ids:
            prefix = self._decode(self.ids[self.surr : self.read])
            window = self._decode(self.ids[self.surr :])
            if len(window) > len(prefix) and not window.endswith("\ufffd"):
                self.text += window[len(prefix) :]
                self.surr = self.read
                self.read = len(self.ids)
        self.released = max(self.released, self._safe_len())
        return self.text[: self.released]

    def _safe_len(self) -> int:
        """Length of the committed text that cannot turn out to be the start of a stop string or of a
        stop regex match."""
        text = self.text
        hold = 0
        for s in self.sampling.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = len(text) - hold
        if self.sampling.stop_regex:
            safe = min(safe, stop_regex.hold_from(self.sampling.stop_regex, text, self.released))
        return safe

    def _final_text(self, finished: FinishReason) -> str:
        ids = self.ids
        sp = self.sampling
        matched_token = finished.type == "stop" and isinstance(finished.matched, int)
        if matched_token and not sp.no_stop_trim and ids and ids[-1] == finished.matched:
            ids = ids[:-1]
        text = self._decode(ids)
        if finished.type == "stop" and isinstance(finished.matched, str):
            span = self._stop_span(text, finished.matched)
            if span is not None:
                text = text[: span[1]] if sp.no_stop_trim else text[: span[0]]
        return text

    def _stop_span(self, text: str, matched: str) -> tuple[int, int] | None:
        """Where the matched stop string (or stop regex, which ``matched`` names) is in the text."""
        if matched in self.sampling.stop:
            cut = text.find(matched)
            if cut >= 0:
                return cut, cut + len(matched)
        if matched in self.sampling.stop_regex:
            return stop_regex.match_of(matched, text)
        return None

    def delta(self, cumulative: str) -> str:
        """The part of ``cumulative`` not handed out yet (for OpenAI-style streaming deltas)."""
        out = cumulative[self.sent :]
        self.sent = max(self.sent, len(cumulative))
        return out
