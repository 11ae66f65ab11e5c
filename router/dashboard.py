"""The router's dashboard: ``GET /dashboard`` with one panel per worker, fed by ``GET /dashboard/stream``.

A sample is the router's own view of each worker (health, requests in flight, requests routed, the hit rate its
policy predicted and the hit rate the worker reported in its answers, from ``GET /workers``) plus the worker's
own live figures (its ``GET /dashboard/stats``: KV pool, running and waiting requests, decode tokens/s), fetched
with a short timeout so a slow worker only blanks its own panel. Viewers share samples (at most two a second).
The page reuses the server dashboard's static files (``runtime/http/static``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from router.errors import RouterError
from router.service import RouterService
from runtime.http.dashboard_files import EVENT_STREAM_HEADERS, FRESH, static_file

router = APIRouter()
WORKER_TIMEOUT = aiohttp.ClientTimeout(total=2)


class RouterStats:
    def __init__(self, service: RouterService):
        self.service = service
        self._last: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    async def _worker_stats(self, url: str) -> dict[str, Any] | None:
        try:
            async with self.service.session.get(url + "/dashboard/stats", timeout=WORKER_TIMEOUT) as resp:
                if resp.status != 200:
                    return None
                data: dict[str, Any] = orjson.loads(await resp.read())
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
            return None

    async def sample(self, max_age: float = FRESH) -> dict[str, Any]:
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < max_age:
                return self._last[1]
            view = self.service.describe_workers()
            workers = view["workers"]
            stats = await asyncio.gather(*(self._worker_stats(w["url"]) if w["healthy"] else _none()
                                           for w in workers))
            for w, s in zip(workers, stats):
                w["stats"] = s
            sample = {**view, "router": True, "time": time.time()}
            self._last = (time.monotonic(), sample)
            return sample


async def _none() -> None:
    return None


def stats_of(request: Request) -> RouterStats:
    state = request.app.state
    stats: RouterStats | None = getattr(state, "dashboard_stats", None)
    if stats is None:
        stats = state.dashboard_stats = RouterStats(state.service)
    return stats


def _static(name: str) -> Response:
    response = static_file(name)
    if response is None:
        raise RouterError(404, f"no dashboard file {name!r}")
    return response


@router.get("/dashboard")
async def dashboard_page() -> Response:
    return _static("router.html")


@router.get("/dashboard/static/{name:path}")
async def dashboard_static(name: str) -> Response:
    return _static(name)


@router.get("/dashboard/stats")
async def dashboard_stats(request: Request) -> Response:
    return Response(orjson.dumps(await stats_of(request).sample()), media_type="application/json")


@router.get("/dashboard/stream")
async def dashboard_stream(request: Request) -> Response:
    raw = request.query_params.get("interval", "1")
    try:
        interval = float(raw)
    except ValueError:
        raise RouterError(400, f"interval: must be a number, got {raw!r}") from None
    if not 0.25 <= interval <= 60:
        raise RouterError(400, f"interval: must be between 0.25 and 60, got {interval:g}")
    stats = stats_of(request)

    async def events() -> AsyncIterator[bytes]:
        while not await request.is_disconnected():
            yield b"event: stats\ndata: " + orjson.dumps(await stats.sample(min(FRESH, interval / 2))) + b"\n\n"
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream", headers=EVENT_STREAM_HEADERS)
