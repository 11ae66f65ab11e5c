"""OpenAI-compatible endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Each call becomes one ``SingleRequest`` per choice through the intake's expansion (prompt-major: choice
``index = prompt_index * n + j``), submitted through the TokenizerManager like ``/generate``; the intake's
checks name fields in the runtime's spelling, which ``COMPLETION_NAMES`` / ``chat_names`` map to this API's.
Non-streaming calls wait for all of them (a disconnected client aborts them); streaming calls send SSE chunks
built from each choice's cumulative text, sending only what is new, and abort what is unfinished when the
client goes away.

Chat requests go through two seams meant for tool calling and constrained output: ``chat_inputs``
(request -> prompt ids and SamplingParams: template arguments, grammar) and ``assistant_output``
(generated text -> assistant message / stream deltas, finish reason).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from runtime.core.errors import IntakeError
from runtime.core.messages import RequestOptions
from runtime.core.sampling_params import SamplingParams
from runtime.http.chat_render import render_chat_request
from runtime.http.errors import APIError, api_error, validation_failure
from runtime.http.openai_format import (
    AssistantOutput,
    ChoiceStream,
    Envelope,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    json_response,
    merge_delta,
    new_id,
    now,
    pad,
    raise_if_rejected,
    respond,
    usage,
    visible_output_len,
)
from runtime.http.openai_tools import REASONING_PARSERS, ParsedOutput
from runtime.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from runtime.http.requests import submit_all
from runtime.request.intake import Expansion, expand, sampling_params
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import TokenizerManager

router = APIRouter()
M = TypeVar("M", bound=BaseModel)


# ---------------------------------------------------------------------- shared helpers
def tm_of(request: Request) -> TokenizerManager:
    return request.app.state.tm


async def read_request(request: Request, model: type[M]) -> M:
    """Parse and validate the body; invalid JSON and wrong types are 400s (RequestValidationError)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else None
        if first is not None and first["type"] == "model_type" and not first["loc"]:
            raise APIError(400, "the request body must be a JSON object") from None
        raise validation_failure(exc) from None


def served_model(request: Request, name: str | None) -> str:
    served: str = request.app.state.served_model_name
    if name is None or name in (served, "default"):
        return served
    raise APIError(404, f"The model '{name}' does not exist; this server serves '{served}' "
                   "(alias 'default').", "model", "model_not_found")


# The runtime's field names -> /v1/completions' (chat's depend on the request: ``chat_names``).
COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt",
                    "text": "prompt"}


def make_sampling(fields: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    try:
        return sampling_params(fields)
    except IntakeError as exc:
        raise api_error(exc, names) from None


def fan_out(tm: TokenizerManager, prompts: list[list[int]], sp: SamplingParams, req: SamplingFields, *,
            return_logprob: bool = False, logprob_start_len: int = -1, top: int = 0) -> Expansion:
    """The intake's expansion: one request per choice, prompt-major; sample j of a seeded request uses seed + j.
    ``rid`` (SGLang's extension) is the call's id: the response is ``<kind>-<call_id>``. Raises IntakeError."""
    options = RequestOptions(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                             top_logprobs_num=top, cache_namespace=req.cache_salt, stream=req.stream)
    sp = dataclasses.replace(sp, n=req.n)
    return expand(prompts, [sp] * len(prompts), [options] * len(prompts), req.rid, tm.limits.max_n)


def token_text(request: Request) -> TokenText:
    tt = getattr(request.app.state, "openai_token_text", None)
    if tt is None:
        tt = request.app.state.openai_token_text = TokenText(tm_of(request).tokenizer)
    return tt


# ---------------------------------------------------------------------- /v1/models
STARTED = now()


def model_card(request: Request) -> dict[str, Any]:
    return {"id": request.app.state.served_model_name, "object": "model", "created": STARTED,
            "owned_by": "radixserve", "max_model_len": tm_of(request).context_length}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": [model_card(request)]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    served_model(request, model_id)
    return json_response(model_card(request))


# ---------------------------------------------------------------------- /v1/completions
def completion_prompts(tm: TokenizerManager, prompt: Any, echo: bool) -> tuple[list[str], list[list[int]]]:
    """(prompt texts for echo, token ids) of each prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        return list(prompt), [tm.tokenize(p) for p in prompt]
    return [tm.tokenizer.decode(ids) if echo else "" for ids in prompt], [list(ids) for ids in prompt]


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    tm = tm_of(request)
    req = await read_request(request, CompletionRequest)
    model = served_model(request, req.model)
    if req.suffix:
        raise APIError(400, "suffix: inserting text before a suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of: only best_of equal to n is supported (server-side ranking is not), "
                       f"got best_of={req.best_of} and n={req.n}", "best_of")
    texts, prompts = completion_prompts(tm, req.prompt, req.echo)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    names = COMPLETION_NAMES
    sp = make_sampling({**req.sampling_dict(), "max_new_tokens": max_tokens}, names)
    k, n, echo = req.logprobs, req.n, req.echo
    try:
        call = fan_out(tm, prompts, sp, req, return_logprob=k is not None,
                       logprob_start_len=0 if echo and k is not None else -1, top=k or 0)
        handles = await submit_all(tm, call.requests)
    except IntakeError as exc:
        raise api_error(exc, names) from None
    env = Envelope(new_id("cmpl", call.call_id), model, req.include_usage)
    tt = token_text(request)
    streams = [ChoiceStream() for _ in handles]

    def logprobs(st: RequestState, c: ChoiceStream | None) -> dict[str, Any] | None:
        """All of them (non-streaming, ``c`` None) or the ones ``c`` has not sent yet."""
        if k is None:
            return None
        n_out = visible_output_len(st, sp) if st.finished else len(st.output_logprobs)
        n_in = len(st.input_logprobs) if echo else 0
        in_from, out_from = (c.in_sent, c.lp_sent) if c else (0, 0)
        entries = st.input_logprobs[in_from:n_in] + st.output_logprobs[out_from:n_out]
        tops = pad(st.input_top, n_in)[in_from:] + pad(st.output_top, n_out)[out_from:]
        if c is None:
            return completion_logprobs(entries, tops, k, tt)
        c.in_sent, c.lp_sent = n_in, max(out_from, n_out)
        if not entries:
            return None
        lp = completion_logprobs(entries, tops, k, tt, c.offset)
        c.offset += sum(len(t) for t in lp["tokens"])
        return lp

    def build(states: list[RequestState]) -> dict[str, Any]:
        choices = [{"index": i, "text": (texts[i // n] if echo else "") + st.text,
                    "logprobs": logprobs(st, None), "finish_reason": finish_reason(st)}
                   for i, st in enumerate(states)]
        return env.wrap("text_completion", choices, usage=usage(states, n))

    def chunk(i: int, st: RequestState) -> dict[str, Any] | None:
        c = streams[i]
        if c.done:
            return None
        text = c.new_text(st)
        if echo and not c.started:
            text = texts[i // n] + text
        c.started = True
        lp = logprobs(st, c)
        if st.finished is not None:
            raise_if_rejected(st)
            c.done = True
        elif not text and lp is None:
            return None
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason(st)}

    return await respond(request, tm, handles, req.stream, build, chunk, env, "text_completion", n)


# ---------------------------------------------------------------------- /v1/chat/completions
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
            "structural_tag": "tools",
            "text": "messages", "json_schema": "json_schema" if fmt is None or fmt.type == "text" else
            "response_format"}


def chat_inputs(tm: TokenizerManager, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """The prompt (the messages through the chat template) and the sampling parameters of a chat request."""
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"messages.{i}.content: a {m.role} message needs content",
                           f"messages.{i}.content")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
    try:
        ids, setup = render_chat_request(tm.tokenizer, tm.chat_template, tm.tool_format, req)
    except APIError:
        raise
    except Exception as exc:  # the template is the model's; what fails in it is these messages
        message = str(exc)
        if not message.startswith("messages"):
            message = f"messages: the chat template failed: {message}"
        raise APIError(400, message, "messages") from None
    limit = req.max_output[1]
    if limit is None:  # the rest of the context (the intake refuses a prompt that fills it)
        limit = max(0, tm.context_length - len(ids))
    fields = {**req.sampling_dict(), "max_new_tokens": limit}
    schema = response_format_schema(req)
    grammars = [g for g in (schema, setup.structural_tag, req.json_schema, req.regex, req.ebnf) if g is not None]
    if len(grammars) > 1:
        raise APIError(400, "response_format: give only one of response_format, tools with a tool_choice, "
                       "json_schema, regex and ebnf", "response_format")
    if schema is not None:
        fields["json_schema"] = schema
    if setup.structural_tag is not None:
        fields["structural_tag"] = setup.structural_tag
    return ids, make_sampling(fields, chat_names(req))


def assistant_output(tm: TokenizerManager, req: ChatCompletionRequest) -> AssistantOutput:
    """How one choice's text becomes the assistant's message: tool calls and reasoning split out."""
    calls = bool(req.tools) and req.tool_choice != "none"
    reasoning = REASONING_PARSERS.get(tm.args.reasoning_parser or "")
    if not calls and reasoning is None:
        return AssistantOutput()
    return ParsedOutput(tm.tool_format if calls else None, reasoning)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    tm = tm_of(request)
    req = await read_request(request, ChatCompletionRequest)
    model = served_model(request, req.model)
    ids, sp = chat_inputs(tm, req)
    names = chat_names(req)
    k = req.top_logprobs or 0
    try:
        call = fan_out(tm, [ids], sp, req, return_logprob=req.logprobs, top=k)
        handles = await submit_all(tm, call.requests)
    except IntakeError as exc:
        raise api_error(exc, names) from None
    env = Envelope(new_id("chatcmpl", call.call_id), model, req.include_usage)
    tt = token_text(request)
    streams = [ChoiceStream(post=assistant_output(tm, req)) for _ in handles]

    def logprobs(st: RequestState, start: int, end: int) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return chat_logprobs(st.output_logprobs[start:end], pad(st.output_top, end)[start:], k, tt)

    def build(states: list[RequestState]) -> dict[str, Any]:
        choices = []
        for i, st in enumerate(states):
            post = streams[i].post
            choices.append({"index": i, "message": post.message(st.text),
                            "logprobs": logprobs(st, 0, visible_output_len(st, sp)),
                            "finish_reason": post.finish_reason(finish_reason(st) or "stop")})
        return env.wrap("chat.completion", choices, usage=usage(states, req.n))

    def chunk(i: int, st: RequestState) -> dict[str, Any] | None:
        c = streams[i]
        if c.done:
            return None
        delta = c.post.delta(c.new_text(st))
        if not c.started:
            delta = merge_delta({"role": "assistant", "content": ""}, delta)
            c.started = True
        end = visible_output_len(st, sp) if st.finished else len(st.output_logprobs)
        lp = logprobs(st, c.lp_sent, end) if end > c.lp_sent else None
        c.lp_sent = max(c.lp_sent, end)
        reason = None
        if st.finished is not None:
            raise_if_rejected(st)
            delta = merge_delta(delta, c.post.finish_delta())
            reason = c.post.finish_reason(finish_reason(st) or "stop")
            c.done = True
        elif not delta and lp is None:
            return None
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}

    return await respond(request, tm, handles, req.stream, build, chunk, env, "chat.completion.chunk", req.n)
