"""Speculative decoding on the served default model: the agent and multi-turn workloads at concurrency 1 and 8,
with and without speculation, in one run.

    python benchmarks/bench_speculative.py [--workloads agent multiturn] [--concurrency 1 8] [--repeats 3]
        [--algorithms ngram] [--draft-model PATH] [--server-args ...] [--json out.json]

A plain server and one server per speculative algorithm stay up for the whole run; each workload at each
concurrency runs ``--repeats`` times on each, alternating, with the cache flushed before every run (which also
empties the n-gram store). The built-in workloads are greedy, but their sessions feed each answer back, so a
float near-tie decided differently (a different batch shape) changes the later requests of a session: the runs
are short and noisy, hence the repeats. Reported per workload and concurrency: output tokens/s of each run, the
median of the per-repeat ratios to the plain server, the acceptance rate and tokens per verifying step from the
server's own counters (``/get_server_info``), and how many answers differ from the plain server's.

Also measured, in-process: what one n-gram proposal costs against a store of finished sequences.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import torch
from engine_steps import cpu_simd, emit

from runtime.bench.client import RunResult, run_workload
from runtime.bench.metrics import summarize
from runtime.bench.servers import ManagedServer, radixserve_server
from runtime.bench.workloads import make_workload
from runtime.speculative.ngram import NgramConfig, NgramDrafter


def answers(run: RunResult) -> dict[str, str]:
    return {r.id: r.texts.get(0, "") for r in run.records}


def start(logs: Path, name: str, extra: list[str]) -> ManagedServer:
    (logs / name).mkdir(parents=True, exist_ok=True)
    return radixserve_server(logs / name, extra=extra).start(timeout=900)


def drafting_cost(sequences: int = 200, length: int = 1000, request: int = 4000, calls: int = 200) -> dict[str, float]:
    """Mean µs of one proposal for a ``request``-token request against a store of ``sequences`` finished
    sequences of ``length`` tokens (random tokens over a 500-token vocabulary, so matches are short and many)."""
    g = torch.Generator().manual_seed(0)
    drafter = NgramDrafter(NgramConfig(capacity=1 << 22))
    t = time.perf_counter()
    for _ in range(sequences):
        drafter.remember(array("i", torch.randint(0, 500, (length,), generator=g).tolist()), None)
    remember_us = 1e6 * (time.perf_counter() - t) / (sequences * length)
    mine = array("i", torch.randint(0, 500, (request,), generator=g).tolist())
    t = time.perf_counter()
    for i in range(calls):
        mine[-1] = i  # a different suffix each call
        drafter.propose(mine, None, 4)
    return {"propose_us": 1e6 * (time.perf_counter() - t) / calls, "remember_us_per_token": remember_us,
            "store_tokens": sequences * length, "request_tokens": request}


def compare(runs: dict[str, list[RunResult]], algorithms: list[str]) -> dict[str, Any]:
    """Per algorithm: tokens/s of each repeat, the ratios to the plain server's, their median, what speculation
    did, and how many answers differ from the plain run of the same repeat."""
    plain = [summarize(r, "plain") for r in runs["plain"]]
    row: dict[str, Any] = {"plain": {"output_tok_per_s": [s["output_tok_per_s"] for s in plain]}}
    for alg in algorithms:
        spec = [summarize(r, alg) for r in runs[alg]]
        ratios = [s["output_tok_per_s"] / p["output_tok_per_s"] for s, p in zip(spec, plain)]
        row[alg] = {"output_tok_per_s": [s["output_tok_per_s"] for s in spec], "speedups": ratios,
                    "speedup_median": statistics.median(ratios), "speculation": [s["speculation"] for s in spec],
                    "answers_differing": [sum(1 for k, v in answers(r).items() if answers(p).get(k) != v)
                                          for r, p in zip(runs[alg], runs["plain"])],
                    "answers": len(runs[alg][0].records), "errors": sum(s["errors"] for s in spec + plain)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["agent", "multiturn"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each workload and concurrency on each server")
    ap.add_argument("--algorithms", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    ap.add_argument("--draft-model", help="the draft model for --algorithms draft")
    ap.add_argument("--server-args", nargs="*", default=[], help="extra flags for every server (e.g. --dtype float32)")
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    if "draft" in a.algorithms and not a.draft_model:
        ap.error("--algorithms draft needs --draft-model")
    flags = {"ngram": ["--speculative-algorithm", "ngram"],
             "draft": ["--speculative-algorithm", "draft", "--speculative-draft-model", str(a.draft_model)]}
    logs = Path(tempfile.mkdtemp(prefix="radixserve-spec-"))
    result: dict[str, Any] = {"cpu": cpu_simd(), "threads": torch.get_num_threads(), "server_args": a.server_args,
                              "repeats": a.repeats, "drafting": drafting_cost(), "runs": []}
    servers = {"plain": start(logs, "plain", a.server_args)}
    try:
        for alg in a.algorithms:
            servers[alg] = start(logs, alg, a.server_args + flags[alg])
        for workload in a.workloads:
            wl = make_workload(workload)
            for conc in a.concurrency:
                runs: dict[str, list[RunResult]] = {name: [] for name in servers}
                for i in range(a.repeats):
                    for name, server in servers.items():
                        runs[name].append(run_workload(server.url, wl, concurrency=conc, flush=True,
                                                       label=f"{name} {workload} c{conc} #{i + 1}"))
                row = {"workload": workload, "concurrency": conc, **compare(runs, a.algorithms)}
                result["runs"].append(row)
                print({k: v for k, v in row.items() if k != "plain"}, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    emit(result, a.json)


if __name__ == "__main__":
    main()
