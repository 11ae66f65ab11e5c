"""Where the CPU goes while a server answers a workload: each process's CPU time per request, next to throughput.

On a host with few cores the scheduler's forward threads use all of them, so every CPU-millisecond that the HTTP
process (FastAPI, tokenization, streaming), the detokenizer or the client spend on a request is taken from the
forward pass. This starts ``radixserve serve`` (with ``--server-args``), runs a built-in workload through the
benchmark client (streamed, at the comparison's concurrency) ``--runs`` times on a flushed cache, and reads the
CPU time (user + system, every thread) of each server process and of this process (the client) around each run:

- ``http``: the process that runs uvicorn, the routes and the tokenizer manager;
- ``scheduler``: the scheduler and its forward threads;
- ``detokenizer``;
- ``client``: this process, which sends the requests and reads the streams.

Beside them, from ``/get_server_info`` around each run: how many scheduler steps the run took and which share of
its wall time the scheduler spent in steps (the rest it waited for requests).

Then the same for ``--single`` requests of the workload sent one after another, streamed and not, which shows
what streaming alone costs each process per request. ``--unstreamed`` also runs the whole workload with its
requests unstreamed (one JSON reply each, as ``radixserve bench run --disable-stream`` sends them), alternated with
the streamed runs: the throughput a concurrent run loses to streaming, where every token is a message from the
scheduler to the detokenizer, from there to the HTTP process and an event written to the client.

    python benchmarks/bench_server_cpu.py [--workload fewshot] [--runs 3] [--single 32] [--unstreamed]
        [--server-args '--quantization int8'] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shlex
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx
import psutil
from engine_steps import cpu_simd, emit

from runtime.bench.client import OpenAIClient
from runtime.bench.metrics import summarize
from runtime.bench.servers import ManagedServer, radixserve_server
from runtime.bench.workloads import make_workload

PROCESSES = ("http", "scheduler", "detokenizer", "client")


def server_processes(server: ManagedServer) -> dict[str, psutil.Process]:
    """The server's three processes by role (the scheduler names its pid in /get_server_info)."""
    assert server.proc is not None
    http = psutil.Process(server.proc.pid)
    scheduler_pid = httpx.get(server.url + "/get_server_info", timeout=10).json()["scheduler_pid"]
    workers = [p for p in http.children() if "spawn_main" in " ".join(p.cmdline())]
    detok = [p for p in workers if p.pid != scheduler_pid]
    if len(detok) != 1:
        raise RuntimeError(f"expected one detokenizer process beside the scheduler, found {len(detok)}")
    return {"http": http, "scheduler": psutil.Process(scheduler_pid), "detokenizer": detok[0]}


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["client"] = usage.ru_utime + usage.ru_stime
    return out


def per_request_ms(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    return {name: round(1e3 * (after[name] - before[name]) / requests, 3) for name in PROCESSES}


async def workload_run(url: str, procs: dict[str, psutil.Process], workload: str, stream: bool) -> dict[str, Any]:
    """One run of the workload on a flushed cache, its requests streamed or not."""
    wl = make_workload(workload)
    async with OpenAIClient(url, concurrency=8, progress=False, stream=stream) as client:
        await client.warmup()
        if not await client.flush_cache():
            raise RuntimeError("the server did not flush its cache")
        before = cpu_seconds(procs)
        result = await client.run(wl)
        after = cpu_seconds(procs)
    s = summarize(result, "radixserve")
    wall = s["wall_s"]
    sched = [info["scheduler"] for info in (result.server_before, result.server_after) if info is not None]
    steps = sched[1]["steps"] - sched[0]["steps"] if len(sched) == 2 else None
    busy = sched[1]["forward_seconds"] - sched[0]["forward_seconds"] if len(sched) == 2 else None
    return {"sequences_per_s": round(s["sequences_per_s"], 3), "requests": s["requests"],
            "errors": s["errors"], "wall_s": round(wall, 3), "scheduler_steps": steps,
            "scheduler_busy_share": round(busy / wall, 3) if busy is not None else None,
            "cpu_ms_per_request": per_request_ms(before, after, s["requests"]),
            "cores_busy": {n: round((after[n] - before[n]) / wall, 3) for n in PROCESSES}}


async def workload_runs(url: str, procs: dict[str, psutil.Process], workload: str, runs: int,
                        unstreamed: bool) -> dict[str, list[dict[str, Any]]]:
    """``runs`` streamed runs; with ``unstreamed`` as many unstreamed ones, alternated (which goes first flips
    every round: this host's speed drifts by more than streaming costs)."""
    out: dict[str, list[dict[str, Any]]] = {"streamed": [], "unstreamed": []}
    modes = [True, False] if unstreamed else [True]
    for i in range(runs):
        for stream in modes if i % 2 == 0 else modes[::-1]:
            out["streamed" if stream else "unstreamed"].append(await workload_run(url, procs, workload, stream))
    return {mode: results for mode, results in out.items() if results}


def single_requests(url: str, procs: dict[str, psutil.Process], workload: str, count: int) -> dict[str, Any]:
    """``count`` of the workload's requests one after another, streamed and then not: CPU ms per request."""
    bodies = [r["body"] for r in make_workload(workload)["requests"] if r.get("endpoint") == "completions"][:count]
    if not bodies:
        return {}
    out: dict[str, Any] = {"requests": len(bodies)}
    with httpx.Client(base_url=url, timeout=120) as http:
        for stream in (True, False):
            before = cpu_seconds(procs)
            for body in bodies:
                with http.stream("POST", "/v1/completions", json={**body, "stream": stream}) as resp:
                    resp.raise_for_status()
                    for _ in resp.iter_bytes():
                        pass
            after = cpu_seconds(procs)
            out["streamed" if stream else "not_streamed"] = per_request_ms(before, after, len(bodies))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="fewshot", help="Built-in workload (as radixserve bench run).")
    ap.add_argument("--runs", type=int, default=3, help="Runs of the workload, each on a flushed cache.")
    ap.add_argument("--single", type=int, default=32, help="Requests sent one at a time, streamed and not (0: none).")
    ap.add_argument("--unstreamed", action="store_true",
                    help="Also run the workload with its requests unstreamed (bench run --disable-stream), "
                    "alternated with the streamed runs.")
    ap.add_argument("--server-args", default="", help="radixserve serve flags, one quoted string.")
    ap.add_argument("--json", help="Save the result here.")
    args = ap.parse_args()
    flags = shlex.split(args.server_args)
    with tempfile.TemporaryDirectory() as logs, radixserve_server(Path(logs), extra=flags) as srv:
        procs = server_processes(srv)
        runs = asyncio.run(workload_runs(srv.url, procs, args.workload, args.runs, args.unstreamed))
        single = single_requests(srv.url, procs, args.workload, args.single) if args.single else {}
    medians = {mode: {"sequences_per_s": statistics.median(r["sequences_per_s"] for r in results),
                      "cpu_ms_per_request": {n: statistics.median(r["cpu_ms_per_request"][n] for r in results)
                                             for n in PROCESSES}}
               for mode, results in runs.items()}
    emit({"cpu": cpu_simd(), "server_args": args.server_args, "workload": args.workload, "medians": medians,
          "runs": runs, "one_at_a_time": single}, args.json)


if __name__ == "__main__":
    main()
