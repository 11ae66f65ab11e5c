"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses request is a chat request in another shape, so it runs through the chat path: parse (the
request's fields, strictly: an unknown or unsupported field is a 400 naming it) → intake (input items,
with those of the ``previous_response_id`` chain before them, become chat messages; tools and
``text.format`` their chat forms; ``openai_api.chat_inputs`` renders the prompt and checks the sampling
fields) → wait or stream (``requests.submit_all`` / ``wait_all`` / ``merged_updates``, aborting on
disconnect) → format (``responses_format``: output items from the same tool-call and reasoning parser
``/v1/chat/completions`` uses, or the stream events built from its deltas).

Chaining: a stored response keeps its whole conversation as normalised input items (``responses_store``);
a follow-up renders that conversation plus its new items through the chat template, so its prompt begins
with the previous prompt and answer and the radix cache serves that prefix (``cached_tokens``). The
``instructions`` of a response are not carried to the next one, as OpenAI specifies.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.core.errors import IntakeError
from runtime.http.errors import APIError, api_error, check_types, parse_json
from runtime.http.openai_api import assistant_output, chat_inputs, chat_names, fan_out, served_model, tm_of
from runtime.http.openai_format import (
    CLIENT_CLOSED,
    AssistantOutput,
    ChoiceStream,
    close,
    first_update,
    json_response,
    merge_delta,
    now,
    raise_if_rejected,
)
from runtime.http.protocol import ChatCompletionRequest, nullable_properties
from runtime.http.requests import ClientDisconnected, abort_unfinished, merged_updates, submit_all, wait_all
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
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import ReqHandle, ServerUnavailable, TokenizerManager

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
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
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
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
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
_CHAT_NAMES = [(re.compile(r"\bmessages(\.\d+)?"), "input"), (re.compile(r"\bmax_completion_tokens\b"),
               "max_output_tokens"), (re.compile(r"\bresponse_format\b"), "text.format"),
               (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1.")]


def _rename(text: str) -> str:
    for pattern, name in _CHAT_NAMES:
        text = pattern.sub(name, text)
    return text


def as_responses(err: APIError) -> APIError:
    """An error of the chat path, its fields named as this request names them."""
    err.message = _rename(err.message)
    err.param = _rename(err.param) if err.param else err.param
    return err


def responses_names(chat: ChatCompletionRequest) -> dict[str, str]:
    """The runtime's field names -> this request's: the chat table, renamed."""
    return {k: _rename(v) for k, v in chat_names(chat).items()}


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
        field = ".".join(str(x) for x in first["loc"])
        raise as_responses(APIError(400, f"{field}: {first['msg']}", field)) from None


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
    req = await parse(request)
    model = served_model(request, req.model)
    check_metadata(req.metadata or {})
    items = stored(request, req.previous_response_id, "previous_response_id").items if req.previous_response_id else []
    items = items + input_items(req.input)
    header = ResponseHeader(new_item_id("resp"), model, now(), req.instructions, req.max_output_tokens,
                            req.metadata or {}, req.previous_response_id, req.temperature, req.top_p,
                            req.tools or [], req.tool_choice or "auto", req.parallel_tool_calls,
                            req.text or {"format": {"type": "text"}}, req.store, req.user)
    chat = chat_request(req, chat_messages(items, req.instructions), header.id)
    try:
        ids, sp = chat_inputs(tm, chat)
    except APIError as err:
        raise as_responses(err) from None
    try:  # the response's id is the call's id: its request is named after it
        handles = await submit_all(tm, fan_out(tm, [ids], sp, chat).requests)
    except IntakeError as exc:
        raise api_error(exc, responses_names(chat)) from None
    turn = Turn(request, tm, handles, header, items, assistant_output(tm, chat))
    return await (turn.stream() if req.stream else turn.whole())


class Turn:
    """One running response: waits for or streams its request, then stores the result."""

    def __init__(self, request: Request, tm: TokenizerManager, handles: list[ReqHandle], header: ResponseHeader,
                 items: list[dict[str, Any]], post: AssistantOutput):
        self.request, self.tm, self.handles, self.header = request, tm, handles, header
        self.items, self.post = items, post
        self.caching = not tm.args.disable_radix_cache

    def remember(self, final: dict[str, Any]) -> None:
        if self.header.store:
            entry = StoredResponse(final, self.items + stored_items(final["output"]))
            response_store(self.request).put(self.header.id, entry)

    async def whole(self) -> Response:
        try:
            (state,) = await wait_all(self.tm, self.request, self.handles)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        raise_if_rejected(state)
        end = outcome(state)
        final = self.header.obj(end.status, output_items(self.post.message(state.text), end.item_status),
                                usage(state, self.caching), end)
        self.remember(final)
        return json_response(final)

    async def stream(self) -> Response:
        updates = merged_updates(self.handles)
        try:
            first = await first_update(self.request, updates)
            raise_if_rejected(first[1])
        except ClientDisconnected:
            await close(updates)
            await abort_unfinished(self.tm, self.handles, "the client disconnected")
            return Response(status_code=CLIENT_CLOSED)
        except APIError:
            await close(updates)
            await abort_unfinished(self.tm, self.handles, "the request was rejected")
            raise

        async def frames() -> Any:
            events = EventStream(self.header, self.caching)
            sent = ChoiceStream()
            state: RequestState = first[1]
            try:
                for e in events.start():
                    yield sse_event(e)
                item: tuple[int, RequestState] | None = first
                while item is not None:
                    state = item[1]
                    delta = self.post.delta(sent.new_text(state))
                    if state.finished is not None:
                        raise_if_rejected(state)
                        delta = merge_delta(delta, self.post.finish_delta())
                    for e in events.feed(delta):
                        yield sse_event(e)
                    item = None if state.finished is not None else await anext(updates, None)
                closing, final = events.finish(state, outcome(state))
                for e in closing:
                    yield sse_event(e)
                self.remember(final)
            except APIError as exc:  # after the first event only an error event can say it
                yield sse_event(events.error(exc.message, exc.param, exc.code or str(exc.status)))
            except ServerUnavailable as exc:
                yield sse_event(events.error(f"the server is unavailable: {exc}", None, "503"))
            finally:
                await close(updates)
                await abort_unfinished(self.tm, self.handles, "the client disconnected")

        return StreamingResponse(frames(), media_type="text/event-stream")


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    return json_response(stored(request, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    stored(request, response_id)
    response_store(request).delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})
