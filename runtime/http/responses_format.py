"""The objects of ``/v1/responses``, as pure functions of what was generated.

A response object is the request's echo (``ResponseHeader``) plus a status, output items and usage.
Output items come from the assistant message that chat's formatting (``openai_format.chat_message``) makes
of what the output parser split out of the generated text: reasoning (if the server splits it out), then
the text as a ``message`` item, then one ``function_call`` item per tool call. ``EventStream`` turns the
same parser's stream deltas into OpenAI's numbered stream events (item added, part added, text deltas, done
events, ``response.completed``), so streamed and whole responses carry the same items. The shapes follow the
official ``openai`` package's ``openai.types.responses`` models, so its client parses them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from runtime.request.state import RequestState


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event, named like OpenAI's (``event: response.output_text.delta``)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def usage(state: RequestState, caching: bool = True) -> dict[str, Any]:
    """``cached_tokens``: prompt tokens whose KV came from the radix cache (e.g. a previous turn's);
    ``cache_write_tokens``: the others, which the radix cache keeps once computed (none without it)."""
    cached = int(state.cached_tokens)
    return {
        "input_tokens": state.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached,
                                 "cache_write_tokens": state.prompt_tokens - cached if caching else 0},
        "output_tokens": state.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": state.prompt_tokens + state.completion_tokens,
    }


@dataclass
class Outcome:
    """How a response ended: its status and the details OpenAI gives with each."""

    status: str  # "completed" | "incomplete" | "failed"
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    @property
    def item_status(self) -> str:
        return "completed" if self.status == "completed" else "incomplete"


def outcome(state: RequestState) -> Outcome:
    fin = state.finished
    if fin is None or fin.type == "stop":
        return Outcome("completed")
    if fin.type == "length":
        return Outcome("incomplete", {"reason": "max_output_tokens"})
    return Outcome("failed", error={"code": "server_error", "message": fin.message or "the request was aborted"})


@dataclass
class ResponseHeader:
    """The fields every object of one response shares: its id and the request's settings, echoed."""

    id: str
    model: str
    created_at: int
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = True
    user: str | None = None

    def obj(self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None = None,
            end: Outcome | None = None) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": end.error if end else None,
            "incomplete_details": end.incomplete_details if end else None,
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata, "model": self.model, "output": output,
            "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
            "reasoning": None, "store": self.store, "temperature": self.temperature, "text": self.text,
            "tool_choice": self.tool_choice, "tools": self.tools, "top_p": self.top_p, "truncation": "disabled",
            "usage": use, "user": self.user,
        }


# ---------------------------------------------------------------------- output items
def text_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def text_item(kind: str, item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``message`` (the assistant's text) or ``reasoning`` item; ``text`` None: no content part yet."""
    parts = [] if text is None else [text_part(kind, text)]
    if kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "content": parts, "status": status}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def function_call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """``call``: a tool call in chat shape (``{"id", "function": {"name", "arguments"}}``)."""
    fn = call["function"]
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """The items of a whole assistant message: reasoning, text, calls. A message with neither text nor
    calls still gives an (empty) message item, so there is always something to read."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(text_item("reasoning", new_item_id("rs"), message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    if content or not calls:
        items.append(text_item("message", new_item_id("msg"), content, status))
    items.extend(function_call_item(new_item_id("fc"), c, "completed") for c in calls)
    return items


# ---------------------------------------------------------------------- streaming
_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


@dataclass
class _OpenText:
    kind: str  # "message" | "reasoning"
    id: str
    index: int  # output_index
    text: str = ""


class EventStream:
    """Stream deltas of the assistant message (``{"reasoning_content", "content", "tool_calls"}``) as
    Responses events. Text opens an item (added, content part added) and streams into it; whatever comes
    next of another kind, and the end, close it (text done, part done, item done). Tool calls arrive
    whole from the parser: each is an item with one arguments delta."""

    def __init__(self, header: ResponseHeader, caching: bool = True):
        self.header = header
        self.caching = caching  # whether prompts are kept in the radix cache (usage)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.open: _OpenText | None = None
        self.blank = ""  # whitespace held back until it turns out to begin a message

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        first = self.header.obj("in_progress", [])
        return [self._event("response.created", response=first),
                self._event("response.in_progress", response=first)]

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, state: RequestState, end: Outcome) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response object."""
        events = self._close(end.item_status)
        if not self.items:
            events += self._open("message") + self._close(end.item_status)
        final = self.header.obj(end.status, list(self.items), usage(state, self.caching), end)
        name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(end.status,
                                                                                           "response.failed")
        events.append(self._event(name, response=final))
        return events, final

    def error(self, message: str, param: str | None, code: str) -> dict[str, Any]:
        """The event that ends a stream which failed after it began."""
        return self._event("error", code=code, message=message, param=param)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open.kind != kind:
            if kind == "message" and not (self.blank + text).strip():
                # whitespace around tool calls is not a message (whole responses strip it too)
                self.blank += text
                return events
            text, self.blank = self.blank + text, ""
            events += self._close("completed")
            events += self._open(kind)
        assert self.open is not None
        if text:
            self.open.text += text
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            events.append(self._event(_TEXT_EVENTS[kind] + ".delta", item_id=self.open.id,
                                      output_index=self.open.index, content_index=0, delta=text, **extra))
        return events

    def _open(self, kind: str) -> list[dict[str, Any]]:
        o = self.open = _OpenText(kind, new_item_id("rs" if kind == "reasoning" else "msg"), len(self.items))
        return [self._event("response.output_item.added", output_index=o.index,
                            item=text_item(kind, o.id, None, "in_progress")),
                self._event("response.content_part.added", item_id=o.id, output_index=o.index, content_index=0,
                            part=text_part(kind, ""))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        o = self.open
        if o is None:
            return []
        self.open = None
        where = {"item_id": o.id, "output_index": o.index, "content_index": 0}
        extra: dict[str, Any] = {"logprobs": []} if o.kind == "message" else {}
        item = text_item(o.kind, o.id, o.text, status)
        self.items.append(item)
        return [self._event(_TEXT_EVENTS[o.kind] + ".done", **where, text=o.text, **extra),
                self._event("response.content_part.done", **where, part=text_part(o.kind, o.text)),
                self._event("response.output_item.done", output_index=o.index, item=item)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        self.blank = ""
        events = self._close("completed")
        index, item_id = len(self.items), new_item_id("fc")
        done = function_call_item(item_id, call, "completed")
        where = {"item_id": item_id, "output_index": index}
        events.append(self._event("response.output_item.added", output_index=index,
                                  item={**done, "arguments": "", "status": "in_progress"}))
        events.append(self._event("response.function_call_arguments.delta", **where, delta=done["arguments"]))
        events.append(self._event("response.function_call_arguments.done", **where, arguments=done["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return events
