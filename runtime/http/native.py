"""SGLang's native generation API: ``POST /generate``, which reads top to bottom as every API does: parse →
intake → wait or stream → format.

Streams follow what SGLang's frontend (``sglang.lang``'s RuntimeEndpoint) reads: each frame's ``text`` and
``output_ids`` are cumulative, its output logprobs are the ones not sent before (with
``output_token_logprobs_length`` the running count), and ``stream_interval`` thins the frames. A stream goes
through the shared delivery path (``delivery.open_stream`` / ``stream_response``): a request refused before its
first update keeps its HTTP status, and what goes wrong after the 200 (the server lost a process) is SGLang's
error frame. The server's other native endpoints (information, health, cache, aborts, metrics) are in
``admin.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.http.common import tm_of
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
from runtime.http.errors import ERROR_TYPES, APIError, abort_status, check_types, parse_json
from runtime.http.native_protocol import GenerateRequest
from runtime.request.intake import from_native, reject_unsupported
from runtime.request.state import RequestState, StreamPacer
from runtime.server.tokenizer_manager import ReqHandle

router = APIRouter()


@router.post("/generate")
async def generate(request: Request) -> Response:
    tm = tm_of(request)
    # parse
    body = await parse_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    req = check_types(GenerateRequest, body)  # JSON types checked; the intake reads the request's fields
    reject_unsupported(body)
    # intake
    call = from_native(body, tm.limits.max_n)
    handles = await submit_all(tm, call.requests)
    # how the answer is rendered (not part of the request the runtime sees)
    token_text = (lambda t: tm.tokenizer.decode([t])) if req.return_text_in_logprobs else None
    prompt_ids = bool(req.return_prompt_token_ids)
    # stream
    if req.stream:
        updates = await open_stream(request, tm, handles)
        if updates is None:
            return client_closed()
        return stream_response(tm, handles, updates, frames(updates, handles, call.is_batch, token_text, prompt_ids),
                               native_error_frame)
    # wait, format
    states = await wait(request, tm, handles)
    if states is None:
        return client_closed()
    results = [native_result(st, h, token_text) for st, h in zip(states, handles)]
    if prompt_ids:
        for result, h in zip(results, handles):
            result["prompt_token_ids"] = list(h.single.input_ids or [])
    return json_response(results if call.is_batch else results[0])


def native_result(state: RequestState, handle: ReqHandle, token_text: Any, output_from: int = 0) -> dict[str, Any]:
    """The SGLang-native object; an abort that is an error carries its HTTP status in the finish reason, as
    SGLang's does (a stream has sent its 200 by then)."""
    out = state.to_native(handle.single.options, token_text, output_from)
    status = abort_status(state.finished)
    if status is not None:
        out["meta_info"]["finish_reason"]["status_code"] = status
    return out


async def frames(updates: Updates, handles: list[ReqHandle], is_batch: bool, token_text: Any,
                 prompt_ids: bool) -> AsyncIterator[bytes]:
    """One frame per update that is due (``stream_interval``); a batch's frames carry their request's index."""
    sent_logprobs = [0] * len(handles)  # output logprobs already sent, per request
    pacers = [StreamPacer(h.single.sampling.stream_interval) for h in handles]
    async for i, state in updates:
        if not pacers[i].due(state):
            continue
        frame = native_result(state, handles[i], token_text, sent_logprobs[i])
        sent_logprobs[i] = len(state.output_logprobs)
        if prompt_ids:
            frame["prompt_token_ids"] = list(handles[i].single.input_ids or [])
        if is_batch:
            frame["index"] = i
        yield sse(frame)


def native_error_frame(exc: APIError) -> bytes:
    """What SGLang's server sends when a stream fails after its 200 (then ``[DONE]``): the error's message,
    type and status as ``code``; SGLang's clients read ``error.message``."""
    return sse({"error": {"message": exc.message, "type": ERROR_TYPES.get(exc.status, "invalid_request_error"),
                          "code": exc.status, "retryable": False}})
