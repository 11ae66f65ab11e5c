"""Speculative decoding on the served default model: the agent and multi-turn workloads at concurrency 1 and 8,
with and without speculation, in one run.

    python benchmarks/bench_speculative.py [--workloads agent multiturn] [--concurrency 1 8]
        [--algorithms ngram] [--draft-model PATH] [--json out.json]

For each workload and concurrency, a plain server and one server per speculative algorithm run the same
requests (the built-in workloads are greedy), one after the other on the same machine. Reported per pair:
output tokens/s, its ratio to the plain server's, the acceptance rate and tokens per verifying step from the
server's own counters (``/get_server_info``), and how many answers differ from the plain server's (greedy
answers are identical with speculation up to float near-ties of a different batch shape).

Also measured, in-process: what one n-gram proposal costs against a store of finished sequences.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import torch
from engine_steps import cpu_simd, emit

from runtime.bench.client import RunResult, run_workload
from runtime.bench.metrics import summarize
from runtime.bench.servers import radixserve_server
from runtime.bench.workloads import make_workload
from runtime.speculative.ngram import NgramConfig, NgramDrafter


def answers(run: RunResult) -> dict[str, str]:
    return {r.id: r.texts.get(0, "") for r in run.records}


def serve_and_run(logs: Path, name: str, extra: list[str], wl: dict[str, Any], concurrency: int) -> RunResult:
    server = radixserve_server(logs / name, extra=extra)
    (logs / name).mkdir(parents=True, exist_ok=True)
    server.start(timeout=900)
    try:
        return run_workload(server.url, wl, concurrency=concurrency, label=f"{name} c{concurrency}")
    finally:
        server.stop()


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["agent", "multiturn"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
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
                              "drafting": drafting_cost(), "runs": []}
    for workload in a.workloads:
        wl = make_workload(workload)
        for conc in a.concurrency:
            plain = serve_and_run(logs, "plain", a.server_args, wl, conc)
            base = summarize(plain, "radixserve")
            row: dict[str, Any] = {"workload": workload, "concurrency": conc,
                                   "plain": {"output_tok_per_s": base["output_tok_per_s"], "wall_s": base["wall_s"]}}
            for alg in a.algorithms:
                run = serve_and_run(logs, alg, a.server_args + flags[alg], wl, conc)
                s = summarize(run, f"radixserve {alg}")
                same = answers(plain)
                row[alg] = {"output_tok_per_s": s["output_tok_per_s"], "wall_s": s["wall_s"],
                            "speedup": s["output_tok_per_s"] / base["output_tok_per_s"],
                            "speculation": s["speculation"],
                            "answers_differing": sum(1 for k, v in answers(run).items() if same.get(k) != v),
                            "answers": len(run.records), "errors": s["errors"] + base["errors"]}
            result["runs"].append(row)
            print(row)
    emit(result, a.json)


if __name__ == "__main__":
    main()
