"""Router test fixtures: real workers (tiny model) and router processes on loopback."""

from __future__ import annotations

import sys
import threading

import httpx

from runtime.bench.servers import ManagedServer
from tests.server_harness import ServerProcess, free_port, tmp_log

WORKER_ARGS = ["--max-total-tokens", "32768", "--num-threads", "1"]


def start_workers(model: str, n: int, kv_events: bool = True) -> list[ServerProcess]:
    """``n`` workers started in parallel (each publishing its cache events when ``kv_events``)."""
    servers = [ServerProcess(model, [*WORKER_ARGS, *(["--kv-events-port", str(free_port())] if kv_events else [])])
               for _ in range(n)]
    errors: list[BaseException] = []

    def start(s: ServerProcess) -> None:
        try:
            s.start(timeout=300)
        except BaseException as exc:  # reported below, after every thread is done
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                s.stop()
        raise errors[0]
    return servers


class RouterProcess(ManagedServer):
    """``python -m router --worker-urls URLS ARGS`` on a free port, logging to ``tmp_log``."""

    def __init__(self, worker_urls: list[str], args: list[str] | None = None):
        port = free_port()
        cmd = [sys.executable, "-m", "router", "--port", str(port), "--log-level", "warning",
               "--worker-urls", *worker_urls, *(args or [])]
        super().__init__("router", cmd, port, tmp_log(f"radixserve-router-{port}.log"))

    def start(self, timeout: float = 120.0, need_healthy: bool = True) -> RouterProcess:
        """Wait for /health, or only for /workers when ``need_healthy`` is off (a router without workers)."""
        self.health_path = "/health" if need_healthy else "/workers"
        return super().start(timeout)

    def log(self) -> str:
        return self.log_tail(5000)

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in httpx.get(self.url + "/workers", timeout=10).json()["workers"]}
