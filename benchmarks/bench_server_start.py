"""How long `radixserve serve` takes from launch to its first healthy /health, this checkout against another.

A server's start is mostly imports and the model load, and on a shared VM both move with the minute, so the two
checkouts are started alternately, ``--runs`` times each, and their medians are compared. ``--base-dir`` is a
checkout of another revision (``git worktree add /tmp/base REV``); without it only this checkout is timed.

    python benchmarks/bench_server_start.py [--base-dir /tmp/base] [--runs 5] [--model default] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from engine_steps import cpu_simd, emit

from runtime.bench.servers import free_port

ROOT = Path(__file__).resolve().parent.parent


def start_seconds(checkout: Path, model: str, timeout: float = 300.0) -> float:
    """Seconds from spawning ``radixserve serve`` in ``checkout`` to a 200 from its /health (then stopped)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", model, "--port", str(port),
           "--max-total-tokens", "32768", "--log-level", "warning"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server in {checkout} exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"the server in {checkout} did not start within {timeout:.0f} s")
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-dir", type=Path, help="a checkout of the revision to compare with")
    ap.add_argument("--runs", type=int, default=5, help="starts per checkout (default 5)")
    ap.add_argument("--model", default="default", help="--model for both servers (default: default)")
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    checkouts = {"this": ROOT} if a.base_dir is None else {"base": a.base_dir.resolve(), "this": ROOT}
    times: dict[str, list[float]] = {name: [] for name in checkouts}
    for r in range(a.runs):
        for name in list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]:
            times[name].append(start_seconds(checkouts[name], a.model))
    result: dict[str, Any] = {"cpu": cpu_simd(), "runs": a.runs, "model": a.model}
    for name, ts in times.items():
        result[f"{name}_median_s"] = round(statistics.median(ts), 2)
        result[f"{name}_s"] = [round(t, 2) for t in ts]
    if "base" in times:
        result["this_vs_base"] = round(result["this_median_s"] / result["base_median_s"], 3)
    emit(result, a.json)


if __name__ == "__main__":
    main()
