"""The server's own endpoints beside the generation APIs (SGLang's names): model and server information,
health (``/health``, and ``/health_generate``, which generates one token through the same intake as every
request), ``/flush_cache``, ``/abort_request`` and Prometheus ``/metrics``."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.core.messages import FlushCacheQuery, ServerInfoQuery
from runtime.http.common import tm_of
from runtime.http.delivery import json_response, submit_all
from runtime.http.errors import APIError, error_response, parse_json
from runtime.request.intake import from_native

router = APIRouter()
HEALTH_GENERATE_S = 60


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
        await asyncio.wait_for(handle.result(), HEALTH_GENERATE_S)
    except asyncio.TimeoutError:
        await tm.abort(handle.rid)
        return error_response(503, f"unhealthy: no token generated within {HEALTH_GENERATE_S} s")
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
