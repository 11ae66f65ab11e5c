"""Router test fixtures: real workers (tiny model) and router processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.server_harness import ROOT, ServerProcess, free_port

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


@dataclass
class RouterProcess:
    worker_urls: list[str]
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0, need_healthy: bool = True) -> RouterProcess:
        cmd = [sys.executable, "-m", "router", "--port", str(self.port), "--log-level", "warning",
               "--worker-urls", *self.worker_urls, *self.args]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"radixserve-router-{self.port}.log"
        log = open(self.log_path, "w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + ("/health" if need_healthy else "/workers"), timeout=1)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router did not start in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-5000:] if self.log_path and self.log_path.exists() else ""

    def stop(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in httpx.get(self.url + "/workers", timeout=10).json()["workers"]}
