"""Tool-call formats: how a model writes a call, how to constrain it, how to read it back.

Each format knows its call syntax, builds the xgrammar structural tag that constrains calls (for
``tool_choice`` = required / a named function, and — once the model opens a call — for ``auto``), parses
finished text into content + calls, and renders earlier calls and tool results back into a transcript
for chat templates that have no tool support of their own.

Arguments are kept as the exact JSON text the model produced, so a call returned to the client and sent
back in the next turn renders to the very same text — and the same cached tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from runtime.constrained.json_strings import strict_strings

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Validate OpenAI chat ``tools``; returns [{name, description, parameters}]. Raises ValueError("tools...")."""
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f"tools.{i}: each tool must be {{'type': 'function', 'function': {{...}}}}")
    return check_functions([(t["function"], f"tools.{i}.function") for i, t in enumerate(tools)])


def check_functions(functions: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    """Validate function definitions (``name``, ``description``, ``parameters``), each given with where the
    request holds it (``tools.0.function`` on chat, ``tools.0`` on the Responses API), which a ValueError's
    message starts with. Returns [{name, description, parameters}]."""
    out = []
    seen = set()
    for fn, where in functions:
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"{where}.name: must be 1-64 letters, digits, '_', '-' or '.'")
        if name in seen:
            raise ValueError(f"{where}.name: {name!r} is defined twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"{where}.parameters: must be a JSON schema object")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise ValueError(f"{where}.description: must be a string")
        out.append({"name": name, "description": desc, "parameters": params})
    return out


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    """The structural-tag content for arguments matching ``schema``: at most one whitespace character in
    a row (so sampling cannot wander off into endless indentation) and strings that stay valid JSON."""
    return {"type": "json_schema", "json_schema": strict_strings(schema), "max_whitespace_cnt": 1}


def _json_object_at(text: str, start: int) -> int:
    """End index (exclusive) of the JSON value starting at ``start``, or -1."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return -1
    return end


class ToolCallFormat(ABC):
    name: str
    trigger: str  # text that opens a call; streaming holds back anything that may become it

    @abstractmethod
    def tag(self, tool: dict[str, Any]) -> dict[str, Any]:
        """The structural-tag ``tag`` of one tool: begin, JSON-schema content, end."""

    def structural_tag(self, tools: list[dict[str, Any]], choice: str, parallel: bool = True) -> str:
        """choice: "auto" (free text, calls constrained once opened), "required", or a tool name;
        ``parallel``: more than one call may follow the first."""
        if choice not in ("auto", "required"):
            tools = [t for t in tools if t["name"] == choice]
        tags = [self.tag(t) for t in tools]
        if choice == "auto":
            fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                                   "at_least_one": False, "stop_after_first": not parallel}
        else:
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                   "at_least_one": True, "stop_after_first": not parallel or choice != "required"}
        return json.dumps({"type": "structural_tag", "format": fmt})

    separator = "\n"

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split finished text into (content, calls); text that is no valid call stays content."""

    @abstractmethod
    def take_call(self, buf: str) -> tuple[ToolCall | None, int]:
        """For text that starts with ``trigger``: (call, characters used) once a whole call is there;
        (None, 0) while it may still become one; (None, -1) when it cannot (it is content)."""

    @abstractmethod
    def render_call(self, call: ToolCall) -> str:
        """An earlier call as the model would have written it."""

    @abstractmethod
    def render_result(self, content: str, name: str | None) -> str:
        """A tool result, as the user turn that carries it when the template has no tool role."""

    @abstractmethod
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text describing the tools, for templates with no tool support."""

    def _tool_list(self, tools: list[dict[str, Any]]) -> str:
        return "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)


class HermesFormat(ToolCallFormat):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen 2.5 / 3)."""

    name = "hermes"
    trigger = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def tag(self, tool: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f'<tool_call>\n{{"name": "{tool["name"]}", "arguments": ',
                "content": json_content(tool["parameters"]), "end": "}\n</tool_call>"}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        content = []
        pos = 0
        for m in self._block.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue
            content.append(text[pos : m.start()])
            calls.append(call)
            pos = m.end()
        content.append(text[pos:])
        return "".join(content).strip(), calls

    def take_call(self, buf: str) -> tuple[ToolCall | None, int]:
        end = buf.find("</tool_call>")
        if end < 0:
            return None, 0
        m = self._block.match(buf)
        call = self._call(m.group(1)) if m else None
        return (call, m.end()) if (call and m) else (None, -1)

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        m = re.match(r'\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*', body)
        if m is None:
            return None
        end = _json_object_at(body, m.end())
        if end < 0 or not body[m.end() :].lstrip().startswith("{") or body[end:].strip() != "}":
            return None
        return ToolCall(m.group(1), body[m.end() : end])

    def render_call(self, call: ToolCall) -> str:
        return f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'

    def render_result(self, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call one or more functions to help with the user's request. The functions are "
                "described in JSON below, between <tools></tools>:\n<tools>\n" + self._tool_list(tools)
                + "\n</tools>\nTo call a function, answer with a JSON object holding its name and arguments "
                "between <tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1+ JSON calls: ``{"name": ..., "parameters": {...}}`` (calls separated by ``;``)."""

    name = "llama3"
    trigger = '{"name": '
    separator = "; "
    _start = re.compile(r'\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')

    def tag(self, tool: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{{"name": "{tool["name"]}", "parameters": ',
                "content": json_content(tool["parameters"]), "end": "}"}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.replace("<|python_tag|>", "").strip()
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            call, used = self.take_call(body[pos:])
            if call is None:
                break
            calls.append(call)
            pos += used
        if not calls or body[pos:].strip():
            return text.strip(), []
        return "", calls

    def take_call(self, buf: str) -> tuple[ToolCall | None, int]:
        m = self._start.match(buf)
        if m is None:
            return None, -1
        end = _json_object_at(buf, m.end())
        rest = buf[end:].lstrip() if end >= 0 else ""
        if end < 0 or not rest.startswith("}"):
            return None, 0
        used = len(buf) - len(rest) + 1
        tail = buf[used:].lstrip()
        if tail.startswith(";"):
            used = len(buf) - len(tail[1:].lstrip())
        return ToolCall(m.group(1), buf[m.end() : end]), used

    def render_call(self, call: ToolCall) -> str:
        return f'{{"name": "{call.name}", "parameters": {call.arguments}}}'

    def render_result(self, content: str, name: str | None) -> str:
        return content

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("You have access to the functions below. To call one, answer only with a JSON object of "
                'the form {"name": function name, "parameters": dictionary of argument name and value}.\n\n'
                + self._tool_list(tools))


FORMATS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat, "llama3": Llama3JsonFormat}


def make_tool_format(name: str | None, chat_template: str | None) -> ToolCallFormat:
    """The format named by ``--tool-call-parser``, else the one the chat template speaks, else Hermes."""
    if name is None:
        template = chat_template or ""
        name = "llama3" if ("<|python_tag|>" in template or "ipython" in template) else "hermes"
    if name not in FORMATS:
        raise ValueError(f"tool_call_parser: unknown format {name!r}; choose one of {sorted(FORMATS)}")
    return FORMATS[name]()


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")
