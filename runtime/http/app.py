"""The FastAPI application: routes, error handlers, metrics, and the watchdog over the child processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from runtime.http import admin, chat, completions, native, openai_models, responses
from runtime.http.auth import UNAUTHORIZED, ApiKeyMiddleware
from runtime.http.dashboard import router as dashboard_router
from runtime.http.errors import error_response, install_error_handlers
from runtime.http.metrics import ServerMetrics
from runtime.http.openapi import install_openapi
from runtime.server.tokenizer_manager import TokenizerManager
from runtime.server.watchdog import ProgressWatch

logger = logging.getLogger(__name__)
VERSION = "0.1.0"
WATCH_INTERVAL = 0.5


def create_app(tm: TokenizerManager, served_model_name: str,
               check_children: Callable[[], str | None] | None = None,
               on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """``check_children()`` returns why a child process is gone (or None); ``on_fatal`` stops the server. With
    ``check_children`` the app also watches the scheduler's progress (runtime/server/watchdog.py)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        watcher = asyncio.create_task(_watch(tm, check_children, on_fatal)) if check_children else None
        try:
            yield
        finally:
            if watcher:
                watcher.cancel()
            await tm.stop()

    app = FastAPI(title="radixserve", version=VERSION, lifespan=lifespan)
    app.state.tm = tm
    app.state.served_model_name = served_model_name
    app.state.metrics = ServerMetrics(served_model_name)
    tm.on_output = app.state.metrics.on_output
    install_error_handlers(app)
    if tm.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=tm.args.api_key,
                           reject=lambda: error_response(401, UNAUTHORIZED, code="invalid_api_key"))
    routers = (native.router, admin.router, completions.router, chat.router, responses.router, openai_models.router,
               dashboard_router)
    for router in routers:
        app.include_router(router)
    app.state.routes = [*app.routes, *(route for router in routers for route in router.routes)]
    install_openapi(app, api_key=bool(tm.args.api_key), context_length=tm.context_length,
                    max_running_requests=tm.args.max_running_requests)
    return app


async def _watch(tm: TokenizerManager, check: Callable[[], str | None],
                 on_fatal: Callable[[], None] | None) -> Any:
    progress = ProgressWatch(tm.args.watchdog_timeout)
    while True:
        await asyncio.sleep(WATCH_INTERVAL)
        reason = check() or progress.check(tm.pending, tm.status, tm.status_time, time.monotonic())
        if reason is not None:
            logger.error("%s; failing pending requests with 503 and shutting down", reason)
            tm.mark_dead(reason)
            if on_fatal is not None:
                on_fatal()
            return
