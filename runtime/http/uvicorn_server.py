"""Running an ASGI app under uvicorn the way every radixserve HTTP process does (server and router)."""

from __future__ import annotations

import signal
from typing import Any

import uvicorn


def make_server(app: Any, host: str, port: int, log_level: str) -> uvicorn.Server:
    """uvloop + httptools; access logs only at debug level; 5 s for open requests to finish on stop."""
    config = uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools", log_level=log_level,
                            access_log=log_level == "debug", timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def run_until_stopped(server: uvicorn.Server) -> bool:
    """Serve until SIGINT/SIGTERM or ``server.should_exit``; whether the server had started.

    uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal once it has restored
    the previous handlers: these no-op handlers receive it, so the caller's clean-up (stopping child
    processes or workers) still runs and a requested stop exits 0.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return bool(server.started)
