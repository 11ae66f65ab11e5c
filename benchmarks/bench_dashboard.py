"""What an open dashboard costs the server: scheduler step time under steady load with the page's polling on
and off.

    python benchmarks/bench_dashboard.py [--model default] [--clients 8] [--phase 20] [--rounds 4] [--viewers 1]
                                         [--json out.json]

Steady load: ``--clients`` threads each send few-shot requests (one shared ~600-token block, a distinct
question, 32 new tokens) back to back, so the scheduler is never idle and the tree keeps growing. Phases
alternate, dashboard closed then open, ``--rounds`` times (alternating cancels slow drift on a shared host).
"Open" emulates ``--viewers`` pages exactly as dashboard.js polls: the stats stream (one event a second) and
``GET /cache/tree?max_nodes=300`` every 2 s. The figure is the scheduler's wall time per step (elapsed time /
steps, from the step counter), which includes the control queries answered between steps.

The viewer threads run at the lowest CPU priority (nice 19): a real page runs in a browser on another machine,
so only the server's own work for it should compete with the model here. After the loaded rounds, the load
stops and the server's CPU time (all its processes, from psutil) is measured with the page closed and open
over the grown, now still tree: what serving one open page costs the server per second, without noise from
the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from engine_steps import cpu_simd, emit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.bench.servers import radixserve_server

PREFIX = "You are a precise assistant. Answer in the style of the examples.\n" + "".join(
    f"Example {i}: the sum of {i} and {3 * i} is {4 * i}; the product is {3 * i * i}.\n" for i in range(30))


class Load:
    def __init__(self, url: str, clients: int):
        self.url, self.stop, self.sent = url, threading.Event(), 0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, k: int) -> None:
        with httpx.Client(timeout=300) as c:
            i = 0
            while not self.stop.is_set():
                body = {"text": PREFIX + f"Question {k}-{i}: what is {k} plus {i}?",
                        "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
                c.post(self.url + "/generate", json=body).raise_for_status()
                self.sent += 1
                i += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def lowest_priority() -> None:
    """This thread yields the CPU to everything else (Linux: niceness is per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU time of the server's process and all its children so far."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def idle_cost(url: str, pid: int, seconds: float, viewers: int) -> dict[str, float]:
    """Server CPU ms per wall second with no load, the page closed then open."""
    out = {}
    for label, n in (("closed", 0), ("open", viewers)):
        pages = [Viewer(url) for _ in range(n)]
        for p in pages:
            p.__enter__()
        time.sleep(1.0)
        c0, t0 = server_cpu_seconds(pid), time.perf_counter()
        time.sleep(seconds)
        c1, t1 = server_cpu_seconds(pid), time.perf_counter()
        for p in pages:
            p.__exit__()
        out[f"cpu_ms_per_s_{label}"] = round(1000 * (c1 - c0) / (t1 - t0), 2)
    return out


class Viewer:
    """One open dashboard page: the stats stream and the tree poll."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.tree_ms: list[float] = []
        self.threads = [threading.Thread(target=self._stream, daemon=True),
                        threading.Thread(target=self._tree, daemon=True)]

    def _stream(self) -> None:
        lowest_priority()
        with httpx.stream("GET", self.url + "/dashboard/stream", timeout=60) as r:
            for _ in r.iter_lines():
                if self.stop.is_set():
                    return

    def _tree(self) -> None:
        lowest_priority()
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                c.get(self.url + "/cache/tree", params={"max_nodes": 300}).raise_for_status()
                self.tree_ms.append(1000 * (time.perf_counter() - t))
                self.stop.wait(2.0)

    def __enter__(self) -> Viewer:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)


def steps(url: str) -> tuple[float, int, float, int]:
    s = httpx.get(url + "/dashboard/stats", timeout=30).json()
    return time.perf_counter(), s["scheduler"]["steps"], s["scheduler"]["forward_seconds"], s["cache"]["num_nodes"]


def phase(url: str, seconds: float, viewers: int) -> dict[str, Any]:
    pages = [Viewer(url) for _ in range(viewers)]
    for p in pages:
        p.__enter__()
    time.sleep(1.0)  # let the viewers settle into their rhythm
    t0, s0, f0, _ = steps(url)
    time.sleep(seconds)
    t1, s1, f1, nodes = steps(url)
    for p in pages:
        p.__exit__()
    tree_ms = [m for p in pages for m in p.tree_ms]
    n = max(1, s1 - s0)
    # forward_ms is the model's share of a step: the dashboard cannot change it, so a change there is host noise
    return {"open": viewers > 0, "step_ms": round(1000 * (t1 - t0) / n, 2),
            "forward_ms": round(1000 * (f1 - f0) / n, 2), "steps": s1 - s0, "tree_nodes": nodes,
            "tree_request_ms": round(statistics.median(tree_ms), 1) if tree_ms else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--phase", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--viewers", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    server = radixserve_server(log_dir, args.model, extra=["--max-total-tokens", "65536"]).start()
    try:
        with Load(server.url, args.clients):
            time.sleep(10)  # warm-up: the prefix is cached, the batch is full
            runs = []
            for _ in range(args.rounds):
                runs.append(phase(server.url, args.phase, 0))
                runs.append(phase(server.url, args.phase, args.viewers))
        assert server.proc is not None
        idle = idle_cost(server.url, server.proc.pid, args.phase, args.viewers)
    finally:
        server.stop()
    closed = [r["step_ms"] for r in runs if not r["open"]]
    opened = [r["step_ms"] for r in runs if r["open"]]
    # each open phase against the closed phase just before it: drift on a shared host cancels out
    ratios = [o / c for c, o in zip(closed, opened)]
    emit({"model": args.model, "clients": args.clients, "viewers": args.viewers, "phase_s": args.phase,
          "cpu_simd": cpu_simd(), "runs": runs, "step_ms_closed": round(statistics.mean(closed), 2),
          "step_ms_open": round(statistics.mean(opened), 2),
          "overhead_pct_median": round(100 * (statistics.median(ratios) - 1), 2),
          "overhead_pct_per_round": [round(100 * (r - 1), 2) for r in ratios],
          # the page's cost to the server: CPU ms per second it takes from the 2 cores the model runs on
          **idle, "dashboard_cpu_ms_per_s": round(idle["cpu_ms_per_s_open"] - idle["cpu_ms_per_s_closed"], 2),
          "cpu_count": os.cpu_count()}, args.json)


if __name__ == "__main__":
    main()
