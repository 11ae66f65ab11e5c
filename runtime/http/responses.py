"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses request is a chat request in another shape, so it runs through the chat path: parse (the
request's fields, strictly: an unknown or unsupported field is a 400 naming it) → intake (input items,
with those of the ``previous_response_id`` chain before them, become chat messages; tools and
``text.format`` their chat forms; ``chat.chat_prompt`` renders the prompt and checks the sampling
fields) → wait or stream (``delivery``, aborting on disconnect) → format (``responses_format``: output
items from the same output parser ``/v1/chat/completions`` uses, or the stream events built from its
deltas). The chat path's refusals name fields as this request does (``RESPONSES_NAMES``).

Chaining: a stored response keeps its whole conversation as normalised input items (``responses_store``);
a follow-up renders that conversation plus its new items through the chat template, so its prompt begins
with the previous prompt and answer and the radix cache serves that prefix (``cached_tokens``). The
``instructions`` of a response are not carried to the next one, as OpenAI specifies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.core.messages import RequestOptions
from runtime.http.chat import chat_prompt
from runtime.http.common import served_model, tm_of
from runtime.http.delivery import Updates, client_closed, json_response, open_stream, stream_response, submit_all, wait
from runtime.http.errors import APIError, check_types, fields_named, parse_json, raise_if_rejected
from runtime.http.openai_format import chat_delta, chat_message, now
from runtime.http.protocol import ChatCompletionRequest, OpenAITemperature, OpenAITopP, Penalty, nullable_properties
from runtime.http.responses_format import (
    EventStream,
    ResponseHeader,
    new_item_id,
    outcome,
    output_items,
    sse_event,
    usage,
)
from runtime.http.responses_input import (
    chat_messages,
    chat_tool_choice,
    chat_tools,
    check_metadata,
    input_items,
    response_format,
    stored_items,
)
from runtime.http.responses_store import ResponseStore, StoredResponse
from runtime.parsers.output import OutputParser, Parsed, make_output_parser, parse_whole
from runtime.request.intake import expand, sampling_params
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import ReqHandle, TokenizerManager

router = APIRouter()


# ---------------------------------------------------------------------- parse
class ResponsesRequest(BaseModel):
    """The fields served. ``input`` and the tool fields are checked by hand, for errors naming the item."""

    # null means the default (stripped in ``parse``), so the schema lets every optional field be null
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=nullable_properties)
    input: Any = Field(json_schema_extra={"anyOf": [{"type": "string"},
                                                    {"type": "array", "items": {"type": "object"}}]})
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: OpenAITemperature | None = None
    top_p: OpenAITopP | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    # accepted and without effect here: identifiers, and a cache hint (the radix cache needs none)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # SGLang's sampling extensions, as on /v1/chat/completions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stop: Any = None  # a string or a list of strings, checked as on the chat endpoint
    seed: int | None = None


# OpenAI fields this server does not implement: a request that sets them gets a 400 saying so, rather
# than an answer that silently ignores them. The value in the second column is the one accepted.
UNSUPPORTED: dict[str, tuple[str, Any]] = {
    "background": ("background responses are not supported", False),
    "include": ("no extra output data can be included", []),
    "truncation": ("only 'disabled' is supported (a prompt too long is a 400)", "disabled"),
    "reasoning": ("reasoning options are not supported", None),
    "top_logprobs": ("logprobs are not supported on /v1/responses", 0),
    "max_tool_calls": ("a limit on tool calls is not supported", None),
    "service_tier": ("service tiers are not supported", "auto"),
    "prompt": ("prompt templates are not supported", None),
    "conversation": ("conversations are not supported; use previous_response_id", None),
    "stream_options": ("stream options are not supported", None),
    "context_management": ("context management is not supported", None),
}
KNOWN = set(ResponsesRequest.model_fields)


async def parse(request: Request) -> ResponsesRequest:
    body = await parse_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means the default, as OpenAI treats it
    for name in list(body):
        if name in UNSUPPORTED:
            why, accepted = UNSUPPORTED[name]
            if body[name] != accepted:
                raise APIError(400, f"{name}: {why}", name, "unsupported_parameter")
            del body[name]
        elif name not in KNOWN:
            raise APIError(400, f"{name}: unknown field", name, "unknown_parameter")
    return check_types(ResponsesRequest, body)


# ---------------------------------------------------------------------- intake (see responses_input)
# The runtime's field names -> this API's (the chat path's prompt and format fields included)
RESPONSES_NAMES = {"max_new_tokens": "max_output_tokens", "min_new_tokens": "min_tokens", "input_ids": "input",
                   "text": "input", "structural_tag": "tools", "json_schema": "text.format",
                   "response_format": "text.format"}
# chat's fields -> this API's, for what chat's request model refuses of what this request filled in
CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]], rid: str) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"messages": messages, "stream": req.stream, "rid": rid,
                              "parallel_tool_calls": req.parallel_tool_calls,
                              "max_completion_tokens": req.max_output_tokens,
                              "tools": chat_tools(req.tools) if req.tools else None,
                              "tool_choice": chat_tool_choice(req.tool_choice),
                              "response_format": response_format(req.text)}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "stop", "seed"):
        fields[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = [str(x) for x in first["loc"]]
        field = ".".join([CHAT_FIELDS.get(loc[0], loc[0]), *loc[1:]]) if loc else "input"
        raise APIError(400, f"{field}: {first['msg']}", field) from None


def response_store(request: Request) -> ResponseStore:
    store = getattr(request.app.state, "responses_store", None)
    if store is None:
        store = request.app.state.responses_store = ResponseStore()
    return store


def stored(request: Request, response_id: str, param: str | None = None) -> StoredResponse:
    entry = response_store(request).get(response_id)
    if entry is None:
        raise APIError(404, f"{param + ': ' if param else ''}no stored response with id {response_id!r} "
                       "(unknown, deleted, evicted from the server's bounded store, or created with "
                       "store=false)", param, "previous_response_not_found" if param else "response_not_found")
    return entry


# ---------------------------------------------------------------------- the endpoints
@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    tm = tm_of(request)
    # parse
    req = await parse(request)
    model = served_model(request, req.model)
    check_metadata(req.metadata or {})
    # intake: the conversation so far and the new items, as a chat request
    items = stored(request, req.previous_response_id, "previous_response_id").items if req.previous_response_id else []
    items = items + input_items(req.input)
    header = ResponseHeader(new_item_id("resp"), model, now(), req.instructions, req.max_output_tokens,
                            req.metadata or {}, req.previous_response_id, req.temperature, req.top_p,
                            req.tools or [], req.tool_choice or "auto", req.parallel_tool_calls,
                            req.text or {"format": {"type": "text"}}, req.store, req.user)
    chat = chat_request(req, chat_messages(items, req.instructions), header.id)
    ids, fields, parse_calls = chat_prompt(tm, chat, RESPONSES_NAMES)
    options = RequestOptions(cache_namespace=chat.cache_salt, stream=req.stream)
    with fields_named(RESPONSES_NAMES):
        # the response's id is the call's id: its request is named after it
        call = expand([ids], [sampling_params(fields)], [options], header.id, tm.limits.max_n)
        handles = await submit_all(tm, call.requests)
    turn = Turn(request, tm, handles, header, items,
                make_output_parser(tm.tool_format if parse_calls else None, tm.args.reasoning_parser))
    # wait or stream, format
    return await (turn.stream() if req.stream else turn.whole())


class Turn:
    """One running response: waits for or streams its request, then stores the result."""

    def __init__(self, request: Request, tm: TokenizerManager, handles: list[ReqHandle], header: ResponseHeader,
                 items: list[dict[str, Any]], parser: OutputParser):
        self.request, self.tm, self.handles, self.header = request, tm, handles, header
        self.items, self.parser = items, parser
        self.caching = not tm.args.disable_radix_cache

    def remember(self, final: dict[str, Any]) -> None:
        if self.header.store:
            entry = StoredResponse(final, self.items + stored_items(final["output"]))
            response_store(self.request).put(self.header.id, entry)

    async def whole(self) -> Response:
        states = await wait(self.request, self.tm, self.handles)
        if states is None:
            return client_closed()
        (state,) = states
        end = outcome(state)
        message = chat_message(parse_whole(self.parser, state.text), self.parser.splits_reasoning)
        final = self.header.obj(end.status, output_items(message, end.item_status), usage(state, self.caching), end)
        self.remember(final)
        return json_response(final)

    async def stream(self) -> Response:
        updates = await open_stream(self.request, self.tm, self.handles)
        if updates is None:
            return client_closed()
        events = EventStream(self.header, self.caching)

        def error_frame(exc: APIError) -> bytes:  # after the first event only an error event can say it
            return sse_event(events.error(exc.message, exc.param, exc.code or str(exc.status)))

        return stream_response(self.tm, self.handles, updates, self.frames(events, updates), error_frame, done=None)

    async def frames(self, events: EventStream, updates: Updates) -> AsyncIterator[bytes]:
        for e in events.start():
            yield sse_event(e)
        sent, calls = 0, 0
        state: RequestState = updates.first[1]
        async for _, state in updates:
            new = state.text[sent:]
            sent = max(sent, len(state.text))
            parsed = self.parser.feed(new) if new else Parsed()
            if state.finished is not None:
                raise_if_rejected(state)
                parsed = parsed + self.parser.finish()
            for e in events.feed(chat_delta(parsed, calls)):
                yield sse_event(e)
            calls += len(parsed.calls)
        closing, final = events.finish(state, outcome(state))
        for e in closing:
            yield sse_event(e)
        self.remember(final)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    return json_response(stored(request, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    stored(request, response_id)
    response_store(request).delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})
