"""The memory hierarchy on a working set larger than the KV pool: multi-turn chat whose histories are ~4x the
device pool, served with the host tier and without it, in one run.

    python benchmarks/bench_hicache.py [--sessions 32] [--turns 4] [--concurrency 8] [--pool-share 0.25]
                                       [--host-ratio 4] [--host-workloads short,document] [--json out.json]

Steps 1-3 run for each host-tier workload: ``short`` (the built-in multi-turn chat: ~350-token histories,
32 new tokens a turn, so decoding dominates) and ``document`` (the same conversations, each opening with a
pasted ~1,000-token document, so a turn whose history was dropped recomputes ~1,000+ tokens).

1. **Sizing**: the workload runs once on a server whose pool holds everything; the tokens its tree holds at
   the end are the working set W, and the hit rate there is the unbounded optimum.
2. **Flat**: ``--max-total-tokens`` = ``pool-share`` x W, no host tier: a session's history is evicted while
   the other sessions take their turns and is recomputed at its next turn.
3. **Hierarchical**: the same pool plus ``--enable-hierarchical-cache --hicache-ratio R``: evicted histories
   wait in the host pool and are loaded back.

Reported: hit rate (cached / prompt tokens, from the answers' usage), its share of the unbounded optimum,
output tokens/s, and the host tier's hits and bytes moved from /get_server_info. Outputs are greedy; the
flat and hierarchical runs' texts are compared too (default mode: near-ties may differ; the count says).

4. **Warm restart** (``--restart-sessions N``, 32 by default): a server with the disk tier
   (``--hicache-storage-backend file``) serves the first two turns of N conversations (each opening with a
   pasted ~1,000-token document), waits until its
   writer has stored them, and stops; a new server on the same directory then takes each conversation's
   third turn, one at a time, and its time to first token is compared with a cold server's (no disk tier)
   on the same requests, outputs compared too.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from engine_steps import cpu_simd, emit

from runtime.bench.client import RunResult, run_workload
from runtime.bench.metrics import summarize
from runtime.bench.servers import radixserve_server
from runtime.bench.workloads import make_workload


def run_server(log_dir: Path, name: str, extra: list[str], wl: dict[str, Any], concurrency: int,
               model: str) -> tuple[RunResult, dict[str, Any]]:
    server = radixserve_server(log_dir / name, model, extra=extra)
    (log_dir / name).mkdir(parents=True, exist_ok=True)
    server.start(timeout=900)
    try:
        result = run_workload(server.url, wl, concurrency=concurrency, label=name)
        info = httpx.get(server.url + "/get_server_info", timeout=60).json()
    finally:
        server.stop()
    return result, info


def chat(url: str, messages: list[dict[str, str]], max_tokens: int = 32) -> tuple[str, float, int, int]:
    """One streamed greedy chat turn: (answer, time to first token, cached prompt tokens, prompt tokens)."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, text, cached, prompt = time.perf_counter(), None, "", 0, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text += delta
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                prompt = usage.get("prompt_tokens", 0)
    return text, (first or time.perf_counter()) - t0, cached, prompt


DOCUMENT_WORDS = 700  # about 1,000 tokens of history per conversation before the restart
NOTE_WORDS = ["river", "stone", "lamp", "north", "quiet", "harbour", "seven", "glass", "wind", "rope", "market",
              "winter", "letter", "garden", "engine", "bridge", "orange", "silver", "window", "morning"]


def with_documents(wl: dict[str, Any]) -> dict[str, Any]:
    """The multi-turn workload with each conversation opening with a pasted ~1,000-token document, as chats
    often do (seeded: the same text every run)."""
    rng = random.Random(7)
    for sess in wl["sessions"]:
        first_turn = sess["steps"][0]["append"][0]
        notes = " ".join(rng.choice(NOTE_WORDS) for _ in range(DOCUMENT_WORDS))
        first_turn["content"] = f"Here are my notes:\n{notes}\n\n{first_turn['content']}"
    wl["description"] = wl.get("description", "multiturn") + ", each opening with a ~1,000-token document"
    return wl


def restart(log_dir: Path, model: str, sessions: int, common: list[str]) -> dict[str, Any]:
    """Warm restart from the disk tier vs a cold restart: TTFT of each conversation's third turn."""
    wl = with_documents(make_workload("multiturn", overrides={"sessions": sessions, "turns": 3}))
    store = log_dir / "kv-store"
    disk = [*common, "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-dir", str(store)]
    histories = []
    first = radixserve_server(log_dir / "first", model, extra=disk)
    (log_dir / "first").mkdir(parents=True, exist_ok=True)
    first.start(timeout=900)
    try:
        for sess in wl["sessions"]:
            history = list(sess["messages"])
            for step in sess["steps"][:2]:
                history = history + step["append"]
                answer, *_ = chat(first.url, history)
                history = history + [{"role": "assistant", "content": answer}]
            histories.append(history + sess["steps"][2]["append"])
        for _ in range(600):  # the writer stores blocks in the background: wait until its queue is empty
            disk_info = httpx.get(first.url + "/get_server_info", timeout=60).json()["cache"]["tiers"]["disk"]
            if disk_info["queued_blocks"] == 0:
                break
            time.sleep(0.5)
    finally:
        first.stop()
    out: dict[str, Any] = {"blocks_on_disk": disk_info["blocks_stored"]}
    answers = {}
    for name, extra in (("warm", disk), ("cold", common)):
        server = radixserve_server(log_dir / name, model, extra=extra)
        (log_dir / name).mkdir(parents=True, exist_ok=True)
        server.start(timeout=900)
        try:
            chat(server.url, [{"role": "user", "content": "warm-up"}], 4)
            got = [chat(server.url, h) for h in histories]
            tiers = httpx.get(server.url + "/get_server_info", timeout=60).json()["cache"].get("tiers", {})
        finally:
            server.stop()
        answers[name] = [g[0] for g in got]
        ttft = [g[1] for g in got]
        out[name] = {"ttft_mean_s": round(statistics.mean(ttft), 4), "ttft_median_s": round(statistics.median(ttft), 4),
                     "cached_tokens_mean": round(statistics.mean(g[2] for g in got), 1),
                     "prompt_tokens_mean": round(statistics.mean(g[3] for g in got), 1)}
        if "disk" in tiers:  # what loading the stored prefixes cost, next to the time to first token
            out[name]["disk_loads"] = tiers["disk"]["loads"]
            out[name]["disk_mean_load_ms"] = tiers["disk"]["mean_load_ms"]
    out["ttft_speedup_warm_vs_cold"] = round(out["cold"]["ttft_mean_s"] / out["warm"]["ttft_mean_s"], 2)
    out["answers_differing"] = sum(a != b for a, b in zip(answers["warm"], answers["cold"]))
    return out


def texts(result: RunResult) -> dict[str, str]:
    return {r.id: r.texts.get(0, "") for r in result.records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pool-share", type=float, default=0.25, help="KV pool as a share of the working set")
    ap.add_argument("--host-ratio", type=float, default=4.0, help="host pool as a multiple of the KV pool")
    ap.add_argument("--restart-sessions", type=int, default=32, help="conversations in the warm-restart part")
    ap.add_argument("--skip-host", action="store_true", help="run only the warm-restart part")
    ap.add_argument("--host-workloads", default="short,document",
                    help="comma-separated host-tier workloads: 'short' (the built-in multi-turn chat) and/or "
                         "'document' (the same conversations, each opening with a ~1,000-token document)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-hicache-"))
    common = ["--dtype", "float32"]  # the same arithmetic in every run, on every host

    result: dict[str, Any] = {"model": args.model, "cpu_simd": cpu_simd()}
    if not args.skip_host:
        result["host_tier"] = {}
        for name in args.host_workloads.split(","):
            wl = make_workload("multiturn", overrides={"sessions": args.sessions, "turns": args.turns})
            if name == "document":
                wl = with_documents(wl)
            result["host_tier"][name] = host_tier(args, wl, log_dir / name, common)
    if args.restart_sessions:
        result["warm_restart"] = restart(log_dir, args.model, args.restart_sessions, common)
    emit(result, args.json)


def host_tier(args: Any, wl: dict[str, Any], log_dir: Path, common: list[str]) -> dict[str, Any]:
    sizing, info = run_server(log_dir, "unbounded", [*common, "--max-total-tokens", "131072"], wl,
                              args.concurrency, args.model)
    working_set = int(info["cache"]["cached_tokens"])
    pool = max(4096, int(working_set * args.pool_share))
    sized = ["--max-total-tokens", str(pool)]
    flat, flat_info = run_server(log_dir, "flat", [*common, *sized], wl, args.concurrency, args.model)
    tiered, tiered_info = run_server(
        log_dir, "hierarchical",
        [*common, *sized, "--enable-hierarchical-cache", "--hicache-ratio", str(args.host_ratio)],
        wl, args.concurrency, args.model)

    rows = {name: summarize(r, name) for name, r in (("unbounded", sizing), ("flat", flat),
                                                     ("hierarchical", tiered))}
    optimum = rows["unbounded"]["hit_rate"]
    t_flat, t_tier = texts(flat), texts(tiered)
    return {
        "workload": wl["description"],
        "concurrency": args.concurrency, "working_set_tokens": working_set, "kv_pool_tokens": pool,
        "host_pool_tokens": int(pool * args.host_ratio),
        "runs": {name: {"hit_rate": s["hit_rate"], "hit_rate_of_optimum": round(s["hit_rate"] / optimum, 4),
                        "output_tok_per_s": s["output_tok_per_s"], "wall_s": round(s["wall_s"], 1),
                        "errors": s["errors"]} for name, s in rows.items()},
        "throughput_hierarchical_vs_flat": round(rows["hierarchical"]["output_tok_per_s"]
                                                 / rows["flat"]["output_tok_per_s"], 2),
        "host_tier": tiered_info["cache"]["tiers"].get("host"),
        "flat_evicted_tokens": flat_info["cache"]["evicted_tokens"],
        "answers_differing_flat_vs_hierarchical": sum(t_flat[k] != t_tier.get(k) for k in t_flat),
    }


if __name__ == "__main__":
    main()
