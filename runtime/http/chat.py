"""``POST /v1/chat/completions``: parse → intake → wait or stream → format.

The messages go through the chat template (``chat_render``: tools, the grammar ``tool_choice`` or
``response_format`` asks for), then the intake's expansion makes one request per choice (``rid`` names the
call: ``chatcmpl-<rid>``); its refusals name fields as this request does (``chat_names``). Each choice's
text goes through an output parser (``runtime.parsers.output``: reasoning and tool calls split out), whole
or piece by piece as a stream, and ``openai_format`` says how the message or delta looks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.core.messages import RequestOptions
from runtime.core.sampling_params import SamplingParams
from runtime.http.chat_render import one_grammar, render_chat_request, template_failure
from runtime.http.common import read_request, served_model, tm_of, token_text
from runtime.http.delivery import (
    Updates,
    client_closed,
    json_response,
    open_stream,
    sse,
    stream_response,
    submit_all,
    wait,
)
from runtime.http.errors import APIError, fields_named, raise_if_rejected
from runtime.http.openai_format import (
    Envelope,
    TokenText,
    chat_delta,
    chat_finish_reason,
    chat_logprobs,
    chat_message,
    merge_delta,
    new_id,
    pad,
    usage,
    visible_output_len,
)
from runtime.http.protocol import ChatCompletionRequest
from runtime.parsers.output import OutputParser, Parsed, make_output_parser, parse_whole
from runtime.request.intake import expand, sampling_params
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import TokenizerManager

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    tm = tm_of(request)
    # parse
    req = await read_request(request, ChatCompletionRequest)
    model = served_model(request, req.model)
    check_messages(req)
    # intake
    names = chat_names(req)
    ids, fields, parse_calls = chat_prompt(tm, req, names)
    options = RequestOptions(return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                             cache_namespace=req.cache_salt, stream=req.stream)
    with fields_named(names):
        sp = sampling_params({**fields, "n": req.n})
        call = expand([ids], [sp], [options], req.rid, tm.limits.max_n)
        handles = await submit_all(tm, call.requests)
    shape = Shape(Envelope(new_id("chatcmpl", call.call_id), model, req.include_usage), req.n, req.logprobs,
                  req.top_logprobs or 0, token_text(request), sp)
    parsers = [make_output_parser(tm.tool_format if parse_calls else None, tm.args.reasoning_parser)
               for _ in handles]
    # stream
    if req.stream:
        updates = await open_stream(request, tm, handles)
        if updates is None:
            return client_closed()
        return stream_response(tm, handles, updates, chunks(shape, updates, parsers))
    # wait, format
    states = await wait(request, tm, handles)
    if states is None:
        return client_closed()
    return json_response(completion(shape, states, parsers))


# ---------------------------------------------------------------------- parse and intake
def check_messages(req: ChatCompletionRequest) -> None:
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"messages.{i}.content: a {m.role} message needs content",
                           f"messages.{i}.content")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")


def response_format_schema(req: ChatCompletionRequest) -> str | None:
    """The JSON schema (as text) that ``response_format`` asks for, if any."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema: a json_schema response format needs "
                       "a schema", "response_format.json_schema.schema")
    return json.dumps(fmt.json_schema.schema_)


def chat_names(req: ChatCompletionRequest) -> dict[str, str]:
    """The runtime's field names -> this chat request's (the output limit's and a grammar's depend on which
    field the request used)."""
    fmt = req.response_format
    return {"max_new_tokens": req.max_output[0], "min_new_tokens": "min_tokens", "input_ids": "messages",
            "top_logprobs_num": "top_logprobs",
            "structural_tag": "tools", "text": "messages", "response_format": "response_format",
            "json_schema": "json_schema" if fmt is None or fmt.type == "text" else "response_format"}


def chat_prompt(tm: TokenizerManager, req: ChatCompletionRequest,
                names: dict[str, str]) -> tuple[list[int], dict[str, Any], bool]:
    """(prompt ids, sampling fields in the runtime's names, whether to parse tool calls out of the answer).
    ``names``: how the calling API names the fields (``chat_names`` here; the Responses API has its own)."""
    prompt_field = names["text"]
    try:
        ids, setup = render_chat_request(tm.tokenizer, tm.chat_template, tm.tool_format, req, prompt_field)
    except Exception as exc:
        raise template_failure(exc, prompt_field) from None
    limit = req.max_output[1]
    if limit is None:  # the rest of the context (the intake refuses a prompt that fills it)
        limit = max(0, tm.context_length - len(ids))
    fields = {**req.sampling_dict(), "max_new_tokens": limit}
    schema = response_format_schema(req)
    one_grammar({"response_format": schema, "tools": setup.structural_tag, "json_schema": req.json_schema,
                 "regex": req.regex, "ebnf": req.ebnf}, names["response_format"],
                f"{names['response_format']}, tools with a tool_choice, json_schema, regex and ebnf")
    if schema is not None:
        fields["json_schema"] = schema
    if setup.structural_tag is not None:
        fields["structural_tag"] = setup.structural_tag
    return ids, fields, setup.parse_calls


# ---------------------------------------------------------------------- format
@dataclass
class Shape:
    """How this call's answer looks: what formatting needs besides the requests' states."""

    env: Envelope
    n: int
    logprobs: bool
    top: int  # alternatives per token
    tt: TokenText
    sampling: SamplingParams


def logprobs(shape: Shape, st: RequestState, start: int, end: int) -> dict[str, Any] | None:
    if not shape.logprobs:
        return None
    return chat_logprobs(st.output_logprobs[start:end], pad(st.output_top, end)[start:], shape.top, shape.tt)


def completion(shape: Shape, states: list[RequestState], parsers: list[OutputParser]) -> dict[str, Any]:
    """The whole ``chat.completion`` object."""
    choices = []
    for i, (st, parser) in enumerate(zip(states, parsers)):
        parsed = parse_whole(parser, st.text)
        choices.append({"index": i, "message": chat_message(parsed, parser.splits_reasoning),
                        "logprobs": logprobs(shape, st, 0, visible_output_len(st, shape.sampling)),
                        "finish_reason": chat_finish_reason(st, len(parsed.calls))})
    return shape.env.wrap("chat.completion", choices, usage=usage(states, shape.n))


@dataclass
class Sent:
    """What one choice of a stream has sent so far."""

    parser: OutputParser
    text: int = 0  # characters of the cumulative text
    logprobs: int = 0  # output logprob entries
    calls: int = 0  # tool calls
    started: bool = False
    done: bool = False
    delta: Parsed = field(default_factory=Parsed)


def chunk_choice(shape: Shape, i: int, st: RequestState, sent: Sent) -> dict[str, Any] | None:
    """The choice of the next stream chunk for choice ``i`` (None: nothing new to send)."""
    if sent.done:
        return None
    new = st.text[sent.text:]
    sent.text = max(sent.text, len(st.text))
    parsed = sent.parser.feed(new) if new else Parsed()
    if st.finished is not None:
        raise_if_rejected(st)
        parsed = parsed + sent.parser.finish()
    delta = chat_delta(parsed, sent.calls)
    sent.calls += len(parsed.calls)
    if not sent.started:
        delta = merge_delta({"role": "assistant", "content": ""}, delta)
        sent.started = True
    end = visible_output_len(st, shape.sampling) if st.finished else len(st.output_logprobs)
    lp = logprobs(shape, st, sent.logprobs, end) if end > sent.logprobs else None
    sent.logprobs = max(sent.logprobs, end)
    reason = None
    if st.finished is not None:
        reason = chat_finish_reason(st, sent.calls)
        sent.done = True
    elif not delta and lp is None:
        return None
    return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}


async def chunks(shape: Shape, updates: Updates, parsers: list[OutputParser]) -> AsyncIterator[bytes]:
    """The stream's frames: one chunk per update that has something new, then usage when asked for."""
    sent = [Sent(p) for p in parsers]
    last: list[RequestState] = [updates.first[1]] * len(parsers)
    async for i, st in updates:
        last[i] = st
        choice = chunk_choice(shape, i, st, sent[i])
        if choice is not None:
            yield sse(shape.env.chunk("chat.completion.chunk", [choice]))
    if shape.env.include_usage:
        yield sse(shape.env.usage_chunk("chat.completion.chunk", usage(last, shape.n)))
