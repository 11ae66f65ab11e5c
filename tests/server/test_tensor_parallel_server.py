"""``radixserve serve --tp 2``: it serves, and a rank killed while it serves ends the server cleanly — new
requests get 503, the server exits with status 1, and no process of it is left (ranks included)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.server_harness import ServerProcess, assert_kv_clean, pid_alive

BASE = ["--tp", "2", "--dtype", "float32", "--max-total-tokens", "8192", "--log-level", "info"]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def rank_pids(scheduler_pid: int) -> list[int]:
    """The scheduler's spawned rank processes (not multiprocessing's resource tracker)."""
    out = []
    for pid in children(scheduler_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(pid)
    return out


def test_killed_rank_gives_503_and_a_clean_exit(tiny_model_dir: Path) -> None:
    server = ServerProcess(str(tiny_model_dir), BASE).start()
    try:
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] >= 1
        assert_kv_clean(server.url)
        scheduler = httpx.get(server.url + "/get_server_info", timeout=30).json()["scheduler_pid"]
        ranks = rank_pids(scheduler)
        assert len(ranks) == 1, ranks
        everything = [scheduler, *children(scheduler)]
        os.kill(ranks[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and server.proc is not None and server.proc.poll() is None:
            try:
                status = httpx.post(server.url + "/generate", json=body, timeout=30).status_code
            except httpx.HTTPError:
                break  # the server already closed its port
            if status == 503:
                break
            time.sleep(0.1)
        assert server.proc is not None
        code = server.proc.wait(timeout=60)
        log = server.log()
        assert status in (503, None), status  # None: the port had closed before the next request
        assert code == 1, log
        assert "tensor-parallel rank 1" in log and "killed by signal SIGKILL" in log, log
        assert "failing pending requests with 503" in log, log
        time.sleep(0.5)
        assert [p for p in everything if pid_alive(p)] == [], log
    finally:
        server.stop()
