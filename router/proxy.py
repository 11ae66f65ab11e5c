"""Forwarding a request to a worker: retries before the first byte, pass-through after it.

The request body goes to the worker unchanged. A worker failing *before any byte of its answer has been
passed on* (refused or reset connection, 502/503/504, a stream dying before its first chunk) costs
nothing but time, so the request is routed again among the other workers, up to ``max_retries`` times.
Once the client has received bytes that cannot be undone: a stream that breaks later is ended with an
SSE error event.

Streams are passed through chunk by chunk as the worker writes them (``iter_any``: whatever bytes have
arrived, no re-framing), so the client receives the worker's bytes unchanged. Plain JSON answers are read
whole (the worker sends them in one piece once the request is done) and forwarded as they are. The
router's decision travels in response headers (``x-radixserve-worker``, ``-route``, ``-predicted-match``)
and never in the body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.errors import RouterError, sse_error
from router.health import HealthChecker
from router.metrics import RouterMetrics
from router.observe import ResponseObserver
from router.policies.base import Choice, Policy
from router.request_view import RequestView
from router.workers import SlotGate, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})
# Hop-by-hop headers, and those the HTTP layers on each side set for themselves.
DROP_REQUEST = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                          "upgrade", "accept-encoding", "proxy-connection"})
DROP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})


def upstream_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST}


def downstream_headers(resp: aiohttp.ClientResponse, choice: Choice | None) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items() if k.lower() not in DROP_RESPONSE}
    if choice is not None:
        out["x-radixserve-worker"] = choice.worker.url
        out["x-radixserve-route"] = choice.reason
        out["x-radixserve-predicted-match"] = str(choice.match)
    return out


class _Stream(StreamingResponse):
    """A StreamingResponse that always runs ``on_close``, even if its body iterator never started
    (a client gone before the first chunk) — so a worker slot is never leaked."""

    def __init__(self, body: AsyncIterator[bytes], status: int, headers: dict[str, str],
                 on_close: Callable[[], None]):
        super().__init__(body, status_code=status, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ClientGone(Exception):
    pass


async def _until_disconnect(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client hangs up first, cancel it (closing the upstream connection makes the
    worker abort the request) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientGone()
    finally:
        watcher.cancel()


class _Attempt:
    """The end of one try of a request on one worker: frees its slot, records usage, tells the policy.
    Called exactly once however the try ends (the first call wins)."""

    def __init__(self, proxy: Proxy, view: RequestView, choice: Choice, path: str, start: float):
        self.proxy, self.view, self.choice, self.path, self.start = proxy, view, choice, path, start
        self.finished = False

    def __call__(self, ok: bool, obs: ResponseObserver | None) -> None:
        if self.finished:
            return
        self.finished = True
        p, worker = self.proxy, self.choice.worker
        p.gate.release(worker)
        usage = obs.tokens() if obs is not None else None
        if usage is not None:
            p.metrics.on_usage(worker.url, *usage)
        p.policy.on_finished(self.view, self.choice, ok, obs.completion() if obs is not None and ok else None)
        p.metrics.latency.labels(self.path).observe(time.perf_counter() - self.start)


class Proxy:
    def __init__(self, session: aiohttp.ClientSession, registry: WorkerRegistry, gate: SlotGate,
                 policy: Policy, metrics: RouterMetrics, health: HealthChecker, max_retries: int):
        self.session = session
        self.registry = registry
        self.gate = gate
        self.policy = policy
        self.metrics = metrics
        self.health = health
        self.max_retries = max_retries

    def _failed(self, worker: Worker, exc_or_status: BaseException | int) -> str:
        if isinstance(exc_or_status, int):
            why = f"answered {exc_or_status}"
            self.registry.failed(worker, why)
        else:
            why = f"{type(exc_or_status).__name__}: {exc_or_status}"
            # A refused connection: nothing listens there any more. Anything else may be a passing
            # problem; a probe right away settles it.
            self.registry.failed(worker, why, hard=isinstance(exc_or_status, aiohttp.ClientConnectorError))
        self.health.check_soon(worker)
        self.metrics.retries.labels(worker.url).inc()
        logger.warning("request failed on %s (%s); trying another worker", worker.url, why)
        return why

    async def forward(self, request: Request, path: str, raw: bytes, view: RequestView) -> Response:
        """Route ``raw`` (the client's body, unchanged) to a worker the policy picks, with retries."""
        start = time.perf_counter()
        self.policy.prepare(view)
        headers = upstream_headers(request)
        tried: set[str] = set()
        last = "no worker tried"
        for attempt in range(self.max_retries + 1):
            choice: Choice = await self.gate.acquire(lambda c: self.policy.select(view, c), tried)
            worker = choice.worker
            worker.routed += 1
            self.metrics.on_routed(worker.url, choice.reason, choice.match, choice.prompt_units)
            done = _Attempt(self, view, choice, path, start)
            last_try = attempt == self.max_retries
            try:
                resp = await unless_disconnected(request, self.session.post(
                    worker.url + path, data=raw, headers=headers))
            except ClientGone:
                done(False, None)
                return Response(status_code=499)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                done(False, None)
                last = self._failed(worker, exc)
                tried.add(worker.url)
                continue
            if resp.status in RETRY_STATUSES and not last_try:
                resp.release()
                done(False, None)
                last = self._failed(worker, resp.status)
                tried.add(worker.url)
                continue
            try:
                if resp.content_type == "text/event-stream":
                    first = await unless_disconnected(request, resp.content.readany())
                    if not first and not last_try:
                        raise aiohttp.ServerDisconnectedError("the stream ended before its first byte")
                    return self._stream(resp, first, choice, done)
                body = await unless_disconnected(request, resp.read())
            except ClientGone:
                resp.close()
                done(False, None)
                return Response(status_code=499)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                resp.close()
                done(False, None)
                last = self._failed(worker, exc)
                tried.add(worker.url)
                continue
            resp.release()
            obs = ResponseObserver()
            if resp.status == 200 and resp.content_type == "application/json":
                obs.feed_json(body)
            worker.record_served()
            done(resp.status == 200, obs)
            return Response(body, status_code=resp.status, headers=downstream_headers(resp, choice))
        raise RouterError(502, f"the request failed on every worker tried ({len(tried)}): {last}",
                          "all_workers_failed")

    def _stream(self, resp: aiohttp.ClientResponse, first: bytes, choice: Choice,
                finish: _Attempt) -> Response:
        obs = ResponseObserver()
        state = {"ok": False}

        async def pump() -> AsyncIterator[bytes]:
            try:
                yield first
                obs.feed_sse(first)
                async for chunk in resp.content.iter_any():
                    yield chunk
                    obs.feed_sse(chunk)  # after the bytes are on their way
                state["ok"] = resp.status == 200
                choice.worker.record_served()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                # Bytes already reached the client: no retry. End the stream with an explicit error.
                self._failed_midstream(choice.worker, exc)
                yield sse_error(502, f"the worker failed during the response: {type(exc).__name__}: {exc}",
                                "worker_failed")
            finally:
                close()

        def close() -> None:
            if state["ok"]:
                resp.release()
            else:
                resp.close()  # an unfinished answer: closing makes the worker abort the request
            finish(state["ok"], obs)

        return _Stream(pump(), resp.status, downstream_headers(resp, choice), close)

    def _failed_midstream(self, worker: Worker, exc: BaseException) -> None:
        self.registry.failed(worker, f"{type(exc).__name__}: {exc}")
        self.health.check_soon(worker)
        logger.warning("stream from %s broke after it started: %s", worker.url, exc)

    async def forward_any(self, request: Request, path: str, method: str = "GET",
                          raw: bytes | None = None) -> Response:
        """An unrouted request (model list, model info): any healthy worker, the next one if it fails."""
        tried: set[str] = set()
        last = "no healthy worker"
        for worker in sorted(self.registry.healthy(), key=lambda w: w.load):
            tried.add(worker.url)
            try:
                async with self.session.request(method, worker.url + path, data=raw,
                                                headers=upstream_headers(request)) as resp:
                    body = await resp.read()
                    if resp.status in RETRY_STATUSES:
                        last = self._failed(worker, resp.status)
                        continue
                    return Response(body, status_code=resp.status, headers=downstream_headers(resp, None))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = self._failed(worker, exc)
        raise RouterError(503, f"no worker could answer {path}: {last}", "no_healthy_worker", retry_after=1)
