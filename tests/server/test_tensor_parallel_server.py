"""``radixserve serve --tp 2``: it serves, and a rank killed while it serves ends the server cleanly — new
requests get 503, the server exits with status 1, and no process of it is left (ranks included).
``--dp 2 --tp 2``: two workers of two ranks each behind the router give tp 1's greedy tokens, and stopping
the launcher leaves no process of it (workers, their schedulers and ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.conftest import checked_engine
from tests.oracle import WITH_TOP2, assert_all_agree
from tests.server_harness import ServerProcess, alive_after, assert_kv_clean

BASE = ["--tp", "2", "--dtype", "float32", "--max-total-tokens", "8192", "--log-level", "info"]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


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
        assert alive_after(everything) == [], log
    finally:
        server.stop()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Here is a short story about a lighthouse keeper",
           "Once upon a time"]
SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_dp2_of_tp2_workers_give_tp1_tokens_and_stop_clean(tiny_model_dir: Path) -> None:
    with checked_engine(tiny_model_dir, dtype="float32", max_total_tokens=4096) as eng:
        reference = [eng.generate(p, SAMPLING, **WITH_TOP2) for p in PROMPTS]
    args = ["--dp", "2", "--tp", "2", "--dtype", "float32", "--max-total-tokens", "4096",
            "--router-policy", "round_robin"]
    server = ServerProcess(str(tiny_model_dir), args).start()
    everything: list[int] = []
    try:
        got = []
        for p in PROMPTS:
            r = httpx.post(server.url + "/generate", json={"text": p, "sampling_params": SAMPLING, **WITH_TOP2},
                           timeout=120)
            assert r.status_code == 200, r.text
            got.append(r.json())
        assert_all_agree(reference, got, "dp 2 x tp 2 through the router")
        workers = httpx.get(server.url + "/workers", timeout=30).json()["workers"]
        assert len(workers) == 2 and all(w["routed"] == 2 for w in workers), workers
        for w in workers:
            assert_kv_clean(w["url"])
            scheduler = httpx.get(w["url"] + "/get_server_info", timeout=30).json()["scheduler_pid"]
            assert len(rank_pids(scheduler)) == 1  # rank 1 beside the worker's scheduler, which is rank 0
        assert server.proc is not None
        everything = descendants(server.proc.pid)
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert alive_after(everything) == [], server.log()
