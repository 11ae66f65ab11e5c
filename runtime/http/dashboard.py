"""The live cache dashboard: ``GET /dashboard`` (the page), ``GET /cache/tree``, the stats stream and one sample.

- ``GET /cache/tree?max_nodes=N&min_tokens=M``: the radix tree, aggregated in the scheduler
  (``RadixCache.snapshot``) to at most N nodes, subtrees under M tokens folded into their parent's aggregate;
  each node has ``id``, ``parent``, ``tokens``, ``subtree_tokens``, ``text`` (decoded here, from the first
  token ids of the node), ``hits``, ``last_access`` (the cache's logical clock; ``clock`` is its latest value),
  ``lock_count``, ``tier``, and for aggregates ``aggregated`` (how many nodes) and ``label``.
- ``GET /dashboard/stream``: server-sent events, one ``stats`` event a second (``?interval=`` seconds), after a
  first ``history`` event holding the samples the hub already has (``dashboard_stats.py``).
- ``GET /dashboard/stats``: the latest sample as JSON (``radixserve top``, the router's panels).

All of it is read-only; the page's files ship in ``static/`` (uPlot and d3-hierarchy vendored with their
licences), so it works offline.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from runtime.core.messages import CacheTreeQuery
from runtime.http.common import tm_of
from runtime.http.dashboard_files import EVENT_STREAM_HEADERS, FRESH, static_file
from runtime.http.dashboard_stats import StatsHub
from runtime.http.delivery import json_response
from runtime.http.errors import APIError
from runtime.server.tokenizer_manager import TokenizerManager

router = APIRouter()
MAX_NODES = 20_000


def static_response(name: str) -> Response:
    response = static_file(name)
    if response is None:
        raise APIError(404, f"no dashboard file {name!r}")
    return response


N = TypeVar("N", int, float)


def query_number(request: Request, name: str, default: N, lo: N, hi: N) -> N:
    """Query parameter ``name`` as the type of ``default`` (int or float), within [lo, hi]; a 400 otherwise."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    kind = type(default)
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise APIError(400, f"{name}: must be {what}, got {raw!r}", name) from None
    if not lo <= value <= hi:
        raise APIError(400, f"{name}: must be between {lo:g} and {hi:g}, got {value:g}", name)
    return value


def live_tm(request: Request) -> TokenizerManager:
    """The tokenizer manager of a server that can still answer (a dead one: 503)."""
    tm = tm_of(request)
    if tm.dead:
        raise APIError(503, f"the server cannot serve: {tm.dead}")
    return tm


def hub_of(request: Request) -> StatsHub:
    state = request.app.state
    hub: StatsHub | None = getattr(state, "dashboard_hub", None)
    if hub is None:
        hub = state.dashboard_hub = StatsHub(state.tm, state.metrics)
    return hub


class PreviewTexts:
    """Node previews as text, decoded once: the tokenizer lives in this process, and a polled tree sends the same
    nodes' first token ids every time, so only new nodes are decoded (an LRU bounded to ``size`` previews)."""

    def __init__(self, tokenizer: Any, size: int = 65_536):
        self._decode = functools.lru_cache(maxsize=size)(lambda ids: tokenizer.decode(list(ids)))

    def fill(self, tree: dict[str, Any]) -> dict[str, Any]:
        """Replace each node's ``preview_ids`` by its ``text`` (an ellipsis when the node has more tokens)."""
        for node in tree["nodes"]:
            ids = node.pop("preview_ids")
            if ids:
                node["text"] = self._decode(tuple(ids)) + ("…" if len(ids) < node["tokens"] else "")
            else:
                node["text"] = node["label"] or ""
        return tree

    def cache_info(self) -> Any:
        return self._decode.cache_info()


def previews_of(request: Request) -> PreviewTexts:
    state = request.app.state
    previews: PreviewTexts | None = getattr(state, "dashboard_previews", None)
    if previews is None:
        previews = state.dashboard_previews = PreviewTexts(state.tm.tokenizer)
    return previews


def _query(name: str, description: str, minimum: int, maximum: int, default: int) -> dict[str, Any]:
    # declared for /openapi.json only: the route parses its query itself (OpenAI-shaped 400s, never 422s)
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": "integer", "minimum": minimum, "maximum": maximum, "default": default}}


TREE_PARAMS = {"parameters": [
    _query("max_nodes", "most nodes in the answer, aggregates included", 2, MAX_NODES, 500),
    _query("min_tokens", "subtrees with fewer tokens are folded into their parent's aggregate", 0, 2**31 - 1, 1)]}


@router.get("/cache/tree", openapi_extra=TREE_PARAMS,
            summary="The radix tree, aggregated to at most max_nodes nodes (read-only)")
async def cache_tree(request: Request) -> Response:
    max_nodes = query_number(request, "max_nodes", 500, 2, MAX_NODES)
    min_tokens = query_number(request, "min_tokens", 1, 0, 2**31 - 1)
    tm = live_tm(request)
    reply = await tm.control(CacheTreeQuery(max_nodes, min_tokens))
    if not reply.ok:
        raise APIError(400, reply.data.get("message", "the cache tree is not available"))
    return json_response(previews_of(request).fill(reply.data))


@router.get("/dashboard/stats", summary="The dashboard's latest live sample (KV pool, hit rate, rates, latency)")
async def dashboard_stats(request: Request) -> Response:
    live_tm(request)
    try:
        sample = await hub_of(request).sample()
    except RuntimeError as exc:
        raise APIError(503, f"the scheduler did not answer: {exc}") from None
    return json_response({**sample, "model": request.app.state.served_model_name})


@router.get("/dashboard/stream", include_in_schema=False)  # endless SSE: documented in docs/ARCHITECTURE.md
async def dashboard_stream(request: Request) -> Response:
    interval = query_number(request, "interval", 1.0, 0.25, 60.0)
    live_tm(request)
    hub = hub_of(request)

    async def events() -> AsyncIterator[bytes]:
        yield b"event: history\ndata: " + orjson.dumps(hub.history()) + b"\n\n"
        while not await request.is_disconnected():
            try:
                sample = await hub.sample(min(FRESH, interval / 2))
            except RuntimeError as exc:  # ServerUnavailable included
                yield b"event: error\ndata: " + orjson.dumps({"message": str(exc)}) + b"\n\n"
                return
            yield b"event: stats\ndata: " + orjson.dumps(sample) + b"\n\n"
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream", headers=EVENT_STREAM_HEADERS)


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> Response:
    return static_response("dashboard.html")


@router.get("/dashboard/static/{name:path}", include_in_schema=False)
async def dashboard_static(name: str) -> Response:
    return static_response(name)
