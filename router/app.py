"""The router's HTTP API: the same endpoints as one worker, plus /workers to manage the workers.

Generation (/generate, /v1/completions, /v1/chat/completions) is routed by the policy. The model
endpoints (/v1/models, /get_model_info, /health_generate) go to any healthy worker. /get_server_info
sums the workers' queue and cache figures; /flush_cache and /abort_request go to every worker; /health
is healthy while at least one worker is; /metrics are the router's own; /dashboard shows the workers live.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.config import RouterArgs
from router.dashboard import router as dashboard_router
from router.errors import RouterError, error_response
from router.request_view import CHAT, COMPLETIONS, GENERATE, RequestView
from router.service import RouterService
from runtime.http.auth import UNAUTHORIZED, ApiKeyMiddleware

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"the request body is not valid JSON: {exc}") from None


def create_app(args: RouterArgs) -> FastAPI:
    service = RouterService(args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        logger.info("router on %s:%d, policy %s, %d workers (%d healthy)", args.host, args.port,
                    service.policy.name, len(service.registry), len(service.registry.healthy()))
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="radixserve router", version=VERSION, lifespan=lifespan)
    app.state.service = service
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key,
                           reject=lambda: error_response(401, UNAUTHORIZED, "invalid_api_key"))

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> Response:
        if exc.status in (429, 503):
            service.metrics.rejected.labels(str(exc.status)).inc()
        return error_response(exc.status, exc.message, exc.code, exc.retry_after)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # e.g. the Allow header of a 405
        return response

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unexpected error in the router")
        return error_response(500, f"internal router error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ routed generation
    async def routed(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None  # forwarded anyway: the worker answers with its own 400
        return await service.proxy.forward(request, path, raw, RequestView.parse(path, body))

    @app.post(GENERATE)
    async def generate(request: Request) -> Response:
        return await routed(request, GENERATE)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await routed(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        return await routed(request, CHAT)

    # ------------------------------------------------------------------ any worker
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await service.proxy.forward_any(request, "/v1/models")

    @app.get("/get_model_info")
    async def model_info(request: Request) -> Response:
        return await service.proxy.forward_any(request, "/get_model_info")

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        return await service.proxy.forward_any(request, "/health_generate")

    # ------------------------------------------------------------------ aggregate / fan-out
    @app.get("/health")
    async def health() -> Response:
        healthy = len(service.registry.healthy())
        if not healthy:
            return error_response(503, f"unhealthy: none of the {len(service.registry)} workers is healthy",
                                  "no_healthy_worker")
        return json_response({"status": "ok", "healthy_workers": healthy, "workers": len(service.registry)})

    @app.get("/get_server_info")
    async def server_info() -> Response:
        return json_response(await service.server_info())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        results = await service.fan_out("POST", "/flush_cache")
        if not results:
            raise RouterError(503, "no healthy worker to flush", "no_healthy_worker")
        failed = {w.url: data for w, status, data in results if status != 200}
        if failed:
            return error_response(400, f"{len(failed)} of {len(results)} workers did not flush: "
                                  + "; ".join(f"{u}: {d}" for u, d in failed.items()))
        service.policy.reset()
        return json_response({"message": "Cache flushed.", "workers": len(results)})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            raise RouterError(400, "rid: give the id of the request to abort")
        await service.fan_out("POST", "/abort_request", orjson.dumps({"rid": rid}))
        return json_response({"message": f"abort of {rid} requested"})

    @app.get("/metrics")
    async def metrics() -> Response:
        data = service.metrics.render(service.registry, service.gate.waiting,
                                      getattr(service.policy, "guard_overrides", 0))
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(dashboard_router)  # /dashboard: one panel per worker (router/dashboard.py)

    # ------------------------------------------------------------------ worker management
    @app.get("/workers")
    async def list_workers() -> Response:
        return json_response(service.describe_workers())

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        body = await _json_body(request)
        url = body.get("url") if isinstance(body, dict) else None
        kv_events = body.get("kv_events") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url:
            raise RouterError(400, 'url: give the worker\'s base URL, e.g. {"url": "http://host:30001"}')
        if kv_events is not None and not isinstance(kv_events, str):
            raise RouterError(400, "kv_events: must be a ZMQ endpoint such as tcp://host:5557")
        try:
            worker, created = await service.add_worker(url, kv_events)
        except ValueError as exc:
            raise RouterError(400, str(exc)) from None
        return json_response({"added": created, "worker": worker.as_json()}, 201 if created else 200)

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        body = await _json_body(request)
        url = request.query_params.get("url") or (body.get("url") if isinstance(body, dict) else None)
        if not isinstance(url, str) or not url:
            raise RouterError(400, "url: give the URL of the worker to remove (body or ?url=)")
        worker = service.remove_worker(url)
        if worker is None:
            raise RouterError(404, f"url: no worker {url!r}")
        return json_response({"removed": worker.url, "inflight": worker.load})

    return app


def serve_router(args: RouterArgs) -> int:
    """Run the router until SIGINT/SIGTERM; returns the exit status (1 if it could not start)."""
    from runtime.http.uvicorn_server import make_server, run_until_stopped
    from runtime.logging_setup import configure_logging

    configure_logging(args.log_level, "router")
    try:
        args.validate()
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    # A requested stop exits 0, and `serve --dp` still stops its workers afterwards.
    return 0 if run_until_stopped(make_server(create_app(args), args.host, args.port, args.log_level)) else 1
