"""SGLang-native endpoints: /generate and the server's control and health endpoints.

Streams follow what SGLang's frontend (``sglang.lang``'s RuntimeEndpoint) reads: each frame's ``text`` and
``output_ids`` are cumulative, its output logprobs are the ones not sent before (with
``output_token_logprobs_length`` the running count), and ``stream_interval`` thins the frames.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from runtime.core.messages import FlushCacheQuery, ServerInfoQuery
from runtime.http.common import tm_of
from runtime.http.delivery import (
    DONE,
    abort_unfinished,
    client_closed,
    json_response,
    merged_updates,
    sse,
    submit_all,
    wait,
)
from runtime.http.errors import APIError, abort_status, check_types, error_response, parse_json
from runtime.http.native_protocol import GenerateRequest
from runtime.request.intake import from_native, reject_unsupported
from runtime.request.state import RequestState, StreamPacer
from runtime.server.tokenizer_manager import ReqHandle, TokenizerManager

router = APIRouter()


@router.post("/generate")
async def generate(request: Request) -> Response:
    tm = tm_of(request)
    body = await parse_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    req = check_types(GenerateRequest, body)  # JSON types checked; the intake reads the request's fields
    reject_unsupported(body)
    call = from_native(body, tm.limits.max_n)
    handles = await submit_all(tm, call.requests)
    # how the answer is rendered (not part of the request the runtime sees)
    token_text = (lambda t: tm.tokenizer.decode([t])) if req.return_text_in_logprobs else None
    prompt_ids = bool(req.return_prompt_token_ids)
    if req.stream:
        return StreamingResponse(_stream(tm, handles, call.is_batch, token_text, prompt_ids),
                                 media_type="text/event-stream")
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


async def _stream(tm: TokenizerManager, handles: list[ReqHandle], is_batch: bool,
                  token_text: Any, prompt_ids: bool) -> AsyncIterator[bytes]:
    sent_logprobs = [0] * len(handles)  # output logprobs already sent, per request
    pacers = [StreamPacer(h.single.sampling.stream_interval) for h in handles]
    try:
        async for i, state in merged_updates(handles):
            s = handles[i].single
            if not pacers[i].due(state):
                continue
            frame = native_result(state, handles[i], token_text, sent_logprobs[i])
            sent_logprobs[i] = len(state.output_logprobs)
            if prompt_ids:
                frame["prompt_token_ids"] = list(s.input_ids or [])
            if is_batch:
                frame["index"] = i
            yield sse(frame)
        yield DONE
    finally:
        await abort_unfinished(tm, handles, "the client disconnected")


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    tm = tm_of(request)
    info = tm.model_info
    return json_response({
        "model_path": info["model_path"],
        "tokenizer_path": tm.args.tokenizer or info["model_path"],
        "served_model_name": request.app.state.served_model_name,
        "is_generation": True,
        "context_length": info["context_length"],
        "vocab_size": info["vocab_size"],
        "architecture": info["architecture"],
        "chat_template": tm.chat_template_text,
    })


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> Response:
    tm = tm_of(request)
    reply = await tm.control(ServerInfoQuery())
    return json_response({
        **tm.args.public_dict(),
        "model_info": tm.model_info,
        "version": request.app.version,
        **reply.data,
    })


@router.get("/health")
async def health(request: Request) -> Response:
    tm = tm_of(request)
    if tm.dead:
        return error_response(503, f"unhealthy: {tm.dead}")
    return json_response({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    tm = tm_of(request)
    if tm.dead:
        return error_response(503, f"unhealthy: {tm.dead}")
    # one token through the same intake as every request; a probe is not held to the queue bound
    call = from_native({"input_ids": [tm.tokenizer.eos_token_id or 0], "rid": f"health-{uuid.uuid4().hex}",
                        "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, tm.limits.max_n)
    (handle,) = await submit_all(tm, call.requests, bounded=False)
    try:
        await asyncio.wait_for(handle.result(), 60)
    except asyncio.TimeoutError:
        await tm.abort(handle.rid)
        return error_response(503, "unhealthy: no token generated within 60 s")
    return json_response({"status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    reply = await tm_of(request).control(FlushCacheQuery())
    if not reply.ok:
        return error_response(400, reply.data.get("message", "the cache was not flushed"))
    return json_response({"message": "Cache flushed."})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await parse_json(request)
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str) or not rid:
        raise APIError(400, "rid: give the id of the request to abort", "rid")
    await tm_of(request).abort(rid)
    return json_response({"message": f"abort of {rid} requested"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    tm = tm_of(request)
    data = request.app.state.metrics.render(tm.status)
    return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")
