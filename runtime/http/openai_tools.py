"""Tools and reasoning on /v1/chat/completions: the prompt side and the response side.

Prompt side (``tool_setup``): validates ``tools`` / ``tool_choice``, renders them through the chat
template when it knows tools (else describes them in the system message in the model's call format and
renders earlier calls and tool results as text), and picks the grammar: ``required`` and a named
function constrain the whole answer to calls; ``auto`` leaves text free but constrains every call the
model opens, so an ``auto`` call is valid too.

Response side (``ParsedOutput``): splits reasoning (``<think>``) and tool calls out of the text, both
for whole messages and stream deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runtime.http.errors import APIError
from runtime.http.openai_format import AssistantOutput
from runtime.parsers.streams import ReasoningStream, ToolCallStream
from runtime.parsers.tool_formats import ToolCall, ToolCallFormat, check_tools, template_supports_tools

REASONING_PARSERS: dict[str, dict[str, Any]] = {
    "qwen3": {"implied_start": False},  # the model writes <think> itself
    "deepseek-r1": {"implied_start": True},  # the template ends the prompt with <think>
}


@dataclass
class ToolSetup:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    structural_tag: str | None = None
    parse_calls: bool = False


def _choice(tool_choice: Any, names: list[str]) -> str:
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not names:
            raise APIError(400, f"tool_choice: {tool_choice!r} needs tools", "tool_choice")
        return str(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise APIError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        return str(name)
    raise APIError(400, "tool_choice: must be 'none', 'auto', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _as_calls(raw: list[dict[str, Any]]) -> list[ToolCall]:
    calls = []
    for c in raw:
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        calls.append(ToolCall(str(fn.get("name", "")), args if isinstance(args, str) else json.dumps(args),
                              str(c.get("id", ""))))
    return calls


def tool_setup(messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any,
               fmt: ToolCallFormat, chat_template: str | None, parallel: bool = True) -> ToolSetup:
    try:
        specs = check_tools(tools or [])
    except ValueError as exc:
        raise APIError(400, str(exc), "tools") from None
    choice = _choice(tool_choice, [t["name"] for t in specs])
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not specs and not has_history:
        return ToolSetup(messages)
    setup = ToolSetup(list(messages), parse_calls=choice != "none")
    if template_supports_tools(chat_template):
        if specs:
            setup.template_kwargs["tools"] = tools
        for m in setup.messages:  # templates expect arguments as objects, OpenAI sends strings
            for c in m.get("tool_calls") or []:
                args = (c.get("function") or {}).get("arguments")
                if isinstance(args, str):
                    try:
                        c["function"] = {**c["function"], "arguments": json.loads(args)}
                    except ValueError:
                        raise APIError(400, "messages: tool_calls arguments must be JSON", "messages") from None
    else:
        setup.messages = _render_as_text(setup.messages, specs, fmt)
    if choice != "none" and specs:
        setup.structural_tag = fmt.structural_tag(specs, choice, parallel)
    return setup


def _render_as_text(messages: list[dict[str, Any]], specs: list[dict[str, Any]],
                    fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """For templates without tool support: tools described in the system message, calls and results as
    ordinary text in assistant and user turns, written exactly as the model writes them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(fmt.render_call(c) for c in _as_calls(m.pop("tool_calls")))
            m["content"] = (m.get("content") or "") + calls
        if m.get("role") == "tool":
            m = {"role": "user", "content": fmt.render_result(m.get("content") or "", m.get("name"))}
        out.append(m)
    if specs:
        text = fmt.instructions(specs)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


class ParsedOutput(AssistantOutput):
    """The assistant message with reasoning and tool calls split out of the generated text."""

    def __init__(self, fmt: ToolCallFormat | None, reasoning: dict[str, Any] | None):
        self.fmt = fmt
        self.reasoning_kw = reasoning
        self.tools = ToolCallStream(fmt) if fmt else None
        self.reasoning = ReasoningStream(**reasoning) if reasoning is not None else None
        self.n_calls = 0

    def _split(self, text: str, final: bool) -> dict[str, Any]:
        if self.reasoning is not None:
            r, c = self.reasoning.feed(text)
            if final:
                r2, c2 = self.reasoning.finish()
                r, c = r + r2, c + c2
        else:
            r, c = "", text
        calls: list[ToolCall] = []
        if self.tools is not None:
            c, calls = self.tools.feed(c)
            if final:
                c2, more = self.tools.finish()
                c, calls = c + c2, calls + more
        delta: dict[str, Any] = {}
        if r:
            delta["reasoning_content"] = r
        if c:
            delta["content"] = c
        if calls:
            delta["tool_calls"] = [call.to_openai(self.n_calls + i) for i, call in enumerate(calls)]
            self.n_calls += len(calls)
        return delta

    def message(self, text: str) -> dict[str, Any]:
        fresh = ParsedOutput(self.fmt, self.reasoning_kw)
        parts = fresh._split(text, final=True)
        self.n_calls = fresh.n_calls
        calls = [{k: v for k, v in c.items() if k != "index"} for c in parts.get("tool_calls", [])]
        msg: dict[str, Any] = {"role": "assistant", "content": parts.get("content", "").strip() or
                               (None if calls else ""), "refusal": None}
        if calls:
            msg["tool_calls"] = calls
        if self.reasoning is not None:
            msg["reasoning_content"] = parts.get("reasoning_content")
        return msg

    def delta(self, new_text: str) -> dict[str, Any]:
        return self._split(new_text, final=False) if new_text else {}

    def finish_delta(self) -> dict[str, Any]:
        return self._split("", final=True)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.n_calls and reason == "stop" else reason
