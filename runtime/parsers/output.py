"""One interface over the parsing of generated text: plain text, reasoning, tool calls, or both.

An ``OutputParser`` is fed the new text of one choice as it arrives (``feed``) and told when it ends
(``finish``); each call answers what that text turned out to hold (``Parsed``: reasoning, content, whole
tool calls). Nothing emitted is ever taken back, and feeding a text whole or in pieces gives the same
result, so streamed and waited-for answers agree. ``/v1/chat/completions`` (both ways) and
``/v1/responses`` use it; how the pieces look on the wire is the formatting's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.parsers.streams import ReasoningStream, ToolCallStream
from runtime.parsers.tool_formats import ToolCall, ToolCallFormat

# ``--reasoning-parser`` names -> ReasoningStream's options
REASONING_PARSERS: dict[str, dict[str, Any]] = {
    "qwen3": {"implied_start": False},  # the model writes <think> itself
    "deepseek-r1": {"implied_start": True},  # the template ends the prompt with <think>
}


@dataclass
class Parsed:
    """What a piece of generated text held, in order of appearance within each kind."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class OutputParser(Protocol):
    splits_reasoning: bool  # answers carry a reasoning field (even when empty)
    splits_calls: bool

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


class PlainText:
    """Everything is content."""

    splits_reasoning = False
    splits_calls = False

    def feed(self, text: str) -> Parsed:
        return Parsed(content=text)

    def finish(self) -> Parsed:
        return Parsed()


class ReasoningParser:
    """``<think>reasoning</think>content``."""

    splits_reasoning = True
    splits_calls = False

    def __init__(self, options: dict[str, Any]):
        self.stream = ReasoningStream(**options)

    def feed(self, text: str) -> Parsed:
        reasoning, content = self.stream.feed(text)
        return Parsed(reasoning, content)

    def finish(self) -> Parsed:
        reasoning, content = self.stream.finish()
        return Parsed(reasoning, content)


class ToolCallParser:
    """Content with tool calls (in ``fmt``'s syntax) split out."""

    splits_reasoning = False
    splits_calls = True

    def __init__(self, fmt: ToolCallFormat):
        self.stream = ToolCallStream(fmt)

    def feed(self, text: str) -> Parsed:
        content, calls = self.stream.feed(text)
        return Parsed(content=content, calls=calls)

    def finish(self) -> Parsed:
        content, calls = self.stream.finish()
        return Parsed(content=content, calls=calls)


class ReasoningThenCalls:
    """Reasoning first; what follows it is content in which tool calls are looked for."""

    splits_reasoning = True
    splits_calls = True

    def __init__(self, reasoning: ReasoningParser, calls: ToolCallParser):
        self.reasoning, self.calls = reasoning, calls

    def feed(self, text: str) -> Parsed:
        r = self.reasoning.feed(text)
        return Parsed(reasoning=r.reasoning) + self.calls.feed(r.content)

    def finish(self) -> Parsed:
        r = self.reasoning.finish()
        return Parsed(reasoning=r.reasoning) + self.calls.feed(r.content) + self.calls.finish()


def make_output_parser(tool_format: ToolCallFormat | None, reasoning: str | None) -> OutputParser:
    """The parser of one choice: tool calls in ``tool_format`` (None: no tools to call), reasoning as
    ``--reasoning-parser`` names it (None or unknown: none)."""
    options = REASONING_PARSERS.get(reasoning or "")
    think = ReasoningParser(options) if options is not None else None
    calls = ToolCallParser(tool_format) if tool_format is not None else None
    if think is not None and calls is not None:
        return ReasoningThenCalls(think, calls)
    return think or calls or PlainText()


def parse_whole(parser: OutputParser, text: str) -> Parsed:
    """A finished text at once. A parser that splits anything out strips the content (the whitespace
    that stood between the parts split out is not the answer)."""
    parsed = parser.feed(text) + parser.finish()
    if parser.splits_reasoning or parser.splits_calls:
        parsed.content = parsed.content.strip()
    return parsed
