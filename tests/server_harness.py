"""Start a real `radixserve serve` process for tests, and stop it (checking it exits cleanly).

The process handling (own process group, health polling, SIGKILL after a timeout) is the benchmarks'
``ManagedServer``; this adds the test defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runtime.bench.servers import ManagedServer, free_port

ROOT = Path(__file__).resolve().parent.parent
__all__ = ["ROOT", "Series", "ServerProcess", "alive_after", "assert_kv_clean", "free_port", "is_idle", "pid_alive",
           "scrape_metrics", "server_info_when", "tmp_log", "use_log_dir"]

# /metrics samples: (name, labels other than model_name, sorted) -> value
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


_log_dir: Path | None = None


def use_log_dir(folder: Path) -> None:
    """Where ``tmp_log`` puts server logs from now on (the test session's own folder under pytest's base temp,
    which pytest prunes to its last three runs, so logs of old runs do not pile up in $TMPDIR)."""
    global _log_dir
    _log_dir = folder


def tmp_log(name: str) -> Path:
    return (_log_dir or Path(os.environ.get("TMPDIR", "/tmp"))) / name


class ServerProcess(ManagedServer):
    """``radixserve serve --model MODEL ARGS`` on ``port`` (a free one by default), logging to ``tmp_log``."""

    def __init__(self, model: str, args: list[str] | None = None, port: int | None = None):
        port = port or free_port()
        self.args = list(args or [])  # kept so that a test can start the same server again
        cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", model, "--port", str(port),
               "--log-level", "warning", *self.args]
        super().__init__("radixserve", cmd, port, tmp_log(f"radixserve-test-{port}.log"))

    def log(self) -> str:
        return self.log_tail(5000)

    def children(self) -> list[int]:
        """PIDs of the server's child processes (scheduler, detokenizer)."""
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def server_info_when(url: str, ready: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30.0,
                     headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The /get_server_info of the server at ``url`` once ``ready`` holds for it (polled), or an AssertionError
    saying the server is not ``what``: waiting for the server's state holds on a loaded host, a fixed sleep not."""
    deadline = time.time() + timeout
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30, headers=headers).json()
        if ready(info):
            return info
        assert time.time() < deadline, f"{url} is not {what}: {info}"
        time.sleep(0.05)


def is_idle(info: dict[str, Any]) -> bool:
    return info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0


def assert_kv_clean(url: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> None:
    """Once the server at ``url`` is idle, its KV accounting (checked by /get_server_info) holds no request's
    private pages and no locked prefix: every request handed back what it took."""
    kv = server_info_when(url, is_idle, "idle", timeout, headers)["kv"]
    assert kv["private"] == 0 and kv["protected"] == 0, kv


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its table entry remains
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def scrape_metrics(url: str, prefix: str = "radixserve_") -> Series:
    """Every sample of the server's /metrics whose name starts with ``prefix``, but the ``_created`` timestamps."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(prefix) and not s.name.endswith("_created")}


def alive_after(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The processes of ``pids`` still running once they have all exited or ``timeout`` seconds have passed: a
    stopped server's children exit on their own schedule, later on a loaded host."""
    deadline = time.time() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.time() < deadline:
        time.sleep(0.1)
    return alive
