"""Incremental parsing of generated text: reasoning (``<think>...</think>``) and tool calls.

Both hold back the shortest tail that could still turn into a marker, so what they emit is never
taken back; ``finish`` flushes what is left. Feeding a whole text at once gives the same result as
feeding it piece by piece, so streamed and non-streamed responses agree.
"""

from __future__ import annotations

from runtime.parsers.tool_formats import ToolCall, ToolCallFormat


def held_tail(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.buf = ""

    def feed(self, new_text: str) -> tuple[str, list[ToolCall]]:
        self.buf += new_text
        content: list[str] = []
        calls: list[ToolCall] = []
        trigger = self.fmt.trigger
        while self.buf:
            i = self.buf.find(trigger)
            if i < 0:
                keep = held_tail(self.buf, trigger)
                content.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            content.append(self.buf[:i])
            self.buf = self.buf[i:]
            call, used = self.fmt.take_call(self.buf)
            if call is not None:
                calls.append(call)
                self.buf = self.buf[used:]
            elif used < 0:  # the trigger text was not a call after all
                content.append(trigger)
                self.buf = self.buf[len(trigger) :]
            else:
                break  # a call in progress: wait for more text
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buf = self.buf, ""
        if not rest:
            return "", []
        content, calls = self.fmt.parse(rest)
        return (content if calls else rest), calls


class ReasoningStream:
    """Splits ``<think>reasoning</think>content``. With ``implied_start`` the reasoning is taken to be
    open from the first token (templates that end the prompt with ``<think>``)."""

    def __init__(self, start: str = "<think>", end: str = "</think>", implied_start: bool = False):
        self.start, self.end = start, end
        self.state = "reasoning" if implied_start else "begin"
        self.buf = ""
        self._after_end = False  # newlines right after </think> separate, they are not content

    def feed(self, new_text: str) -> tuple[str, str]:
        self.buf += new_text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            if self.state == "begin":
                stripped = self.buf.lstrip()
                if stripped.startswith(self.start):
                    self.buf = stripped[len(self.start) :]
                    self.state = "reasoning"
                elif self.start.startswith(stripped):
                    break  # may still become the start marker
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(self.end)
                if i < 0:
                    keep = held_tail(self.buf, self.end)
                    reasoning.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                reasoning.append(self.buf[:i])
                self.buf = self.buf[i + len(self.end) :]
                self.state = "content"
                self._after_end = True
            else:
                if self._after_end:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        break
                    self._after_end = False
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest
