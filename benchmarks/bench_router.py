"""Routing policies compared on one set of workers: throughput and aggregate cache hit rate.

Starts N workers itself (``radixserve serve`` subprocesses, each publishing its cache events so exact mode
works, one torch thread each, a KV pool of ``--kv-tokens``), then for every policy: a router on that
policy, caches flushed, and two workloads run through the router's OpenAI API:

(a) ``groups``: G groups x R requests. Each group has its own long shared prefix (a procedurally written
    handbook: a different text per group), each request adds its own question; all G x R requests are
    shuffled together (many tenants at once) and sent ``--concurrency`` at a time via /v1/completions.
(b) ``multiturn``: the built-in multi-turn chat workload (``runtime.bench.workloads``; sessions run at once,
    every turn re-sends the history) via /v1/chat/completions.

The per-worker KV pool is what makes routing matter: a cache-aware router gives each worker a third of
the groups, which fit; a cache-blind one makes every worker hold every group, which do not. Hit rate is
sum(cached_tokens) / sum(prompt_tokens) over the answers (``usage.prompt_tokens_details``); throughput is
requests per second of wall time. Ratios are against round_robin.

Usage:
  python benchmarks/bench_router.py [--model default|PATH] [--policies cache_aware exact round_robin
      shortest_queue] [--groups 16 --per-group 16 --prefix-words 400] [--out bench_router.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parent.parent

TOWNS = ["Brookhaven", "Millbridge", "Eastwick", "Larkspur", "Stonefield", "Riverton", "Ashford", "Pinecrest",
         "Harborview", "Westmoor", "Oakridge", "Silverlake", "Thornbury", "Cedar Falls", "Fairbanks", "Glenrock"]
TRADES = ["beekeepers", "clockmakers", "glassblowers", "ferry pilots", "bookbinders", "cheesemakers",
          "lighthouse keepers", "weavers", "organ builders", "cartographers", "potters", "brewers",
          "stonemasons", "rope makers", "lens grinders", "bell founders"]
NOUNS = ["ledger", "workshop", "apprentice", "inspection", "toolkit", "delivery", "festival", "permit",
         "warehouse", "guild hall", "quarterly fee", "safety drill", "training course", "market stall"]
VERBS = ["must be signed by", "is reviewed every month by", "can be borrowed from", "is stored next to",
         "is paid for by", "has to be reported to", "is shared with", "is scheduled by"]
ROLES = ["the senior member", "the treasurer", "the night warden", "each new apprentice", "the quartermaster",
         "the visiting inspector", "the guild secretary", "the harbour office"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


# --------------------------------------------------------------------------- workloads
def groups_workload(seed: int, groups: int, per_group: int, prefix_words: int, max_tokens: int) -> list[dict]:
    """G handbooks (one per group, ~prefix_words words each) x R questions, shuffled together."""
    rng = random.Random(f"router-groups-{seed}")
    reqs = []
    for g in range(groups):
        town, trade = TOWNS[g % len(TOWNS)], TRADES[(g * 7 + seed) % len(TRADES)]
        lines = [f"Handbook {g + 1} of the {trade} of {town}. Read it carefully before you answer.\n"]
        words = 0
        rule = 0
        while words < prefix_words:
            rule += 1
            sentence = (f"Rule {rule}: the {rng.choice(NOUNS)} {rng.choice(VERBS)} {rng.choice(ROLES)} "
                        f"on {rng.choice(DAYS)}, unless the {rng.choice(NOUNS)} {rng.choice(VERBS)} "
                        f"{rng.choice(ROLES)} first.")
            lines.append(sentence)
            words += len(sentence.split())
        doc = "\n".join(lines)
        for q in range(per_group):
            question = (f"\n\nQuestion {q + 1}: who is responsible for the {rng.choice(NOUNS)} on "
                        f"{rng.choice(DAYS)}, and what happens to the {rng.choice(NOUNS)}?\nAnswer:")
            reqs.append({"id": f"g{g:02d}-{q:02d}", "group": g, "endpoint": "completions",
                         "body": {"prompt": doc + question, "max_tokens": max_tokens, "temperature": 0.0}})
    rng.shuffle(reqs)
    return reqs


def multiturn_workload(**params: Any) -> dict:
    from runtime.bench.workloads import multiturn

    return multiturn(**params)


# --------------------------------------------------------------------------- client
class Client:
    def __init__(self, base: str, concurrency: int):
        self.base = base.rstrip("/")
        self.sem = asyncio.Semaphore(concurrency)
        self.records: list[dict] = []

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.session.close()

    async def send(self, rid: str, endpoint: str, body: dict) -> dict:
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        async with self.sem:
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"id": rid, "ok": False}
            try:
                async with self.session.post(self.base + path, json=body) as resp:
                    data = await resp.json(content_type=None)
                    rec["worker"] = resp.headers.get("x-radixserve-worker")
                    rec["route"] = resp.headers.get("x-radixserve-route")
                    if resp.status != 200:
                        rec["error"] = f"HTTP {resp.status}: {str(data)[:200]}"
                    else:
                        usage = data["usage"]
                        rec.update(ok=True, prompt=usage["prompt_tokens"], completion=usage["completion_tokens"],
                                   cached=usage["prompt_tokens_details"]["cached_tokens"],
                                   text=(data["choices"][0].get("text") if endpoint == "completions"
                                         else data["choices"][0]["message"]["content"]))
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as exc:
                rec["error"] = repr(exc)[:200]
            rec["latency"] = time.perf_counter() - t0
            self.records.append(rec)
            return rec

    async def run_independent(self, reqs: list[dict]) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(self.send(r["id"], r["endpoint"], r["body"]) for r in reqs))
        return time.perf_counter() - t0

    async def run_sessions(self, sessions: list[dict]) -> float:
        async def one(sess: dict) -> None:
            history = list(sess["messages"])
            for i, step in enumerate(sess["steps"]):
                history = history + list(step["append"])
                rec = await self.send(f"{sess['id']}/{i}", "chat", {**step["body"], "messages": history})
                if not rec["ok"]:
                    return
                history = history + [{"role": "assistant", "content": rec["text"]}]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in sessions))
        return time.perf_counter() - t0


def summarize(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["ok"]]
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    per_worker: dict[str, int] = {}
    for r in ok:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
    return {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
            "error_samples": [r.get("error") for r in records if not r["ok"]][:3],
            "wall_s": round(wall, 2), "req_per_s": round(len(ok) / wall, 3) if wall else 0.0,
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_prompt_tokens": prompt - cached,
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "output_tokens": sum(r["completion"] for r in ok),
            "requests_per_worker": sorted(per_worker.values(), reverse=True)}


# --------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not become healthy in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def start_workers(args: argparse.Namespace, log_dir: Path) -> list[tuple[str, subprocess.Popen]]:
    out = []
    for i in range(args.workers):
        port = free_port()
        cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-total-tokens", str(args.kv_tokens), "--num-threads", str(args.threads),
               "--kv-events-port", str(free_port()), "--log-level", "warning"]
        log = open(log_dir / f"worker-{i}.log", "w")  # noqa: SIM115 - lives as long as the worker
        out.append((f"http://127.0.0.1:{port}", subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log,
                                                                 start_new_session=True)))
    for i, (url, proc) in enumerate(out):
        wait_healthy(url, proc, 900, f"worker {i}")
    return out


def start_router(policy: str, urls: list[str], log_dir: Path, extra: list[str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [sys.executable, "-m", "router", "--policy", policy, "--port", str(port), "--worker-urls", *urls,
           "--log-level", "warning", *extra]
    log = open(log_dir / f"router-{policy}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 300, f"router ({policy})")
    if policy == "exact":  # wait until every worker's event feed has its snapshot
        deadline = time.time() + 60
        while time.time() < deadline:
            ws = httpx.get(url + "/workers").json()["workers"]
            if all((w.get("kv_feed") or {}).get("synced") for w in ws):
                break
            time.sleep(0.2)
    return url, proc


# --------------------------------------------------------------------------- main
async def run_policy(url: str, groups: list[dict], multiturn: dict, concurrency: int) -> dict:
    r = httpx.post(url + "/flush_cache", timeout=60)
    r.raise_for_status()
    out = {}
    async with Client(url, concurrency) as c:
        wall = await c.run_independent(groups)
        out["groups"] = summarize(c.records, wall)
    async with Client(url, concurrency) as c:
        wall = await c.run_sessions(multiturn["sessions"])
        out["multiturn"] = summarize(c.records, wall)
    g, m = out["groups"], out["multiturn"]
    prompt, cached = g["prompt_tokens"] + m["prompt_tokens"], g["cached_tokens"] + m["cached_tokens"]
    wall = g["wall_s"] + m["wall_s"]
    out["total"] = {"requests": g["ok"] + m["ok"], "errors": g["errors"] + m["errors"], "wall_s": round(wall, 2),
                    "req_per_s": round((g["ok"] + m["ok"]) / wall, 3), "hit_rate": round(cached / prompt, 4),
                    "computed_prompt_tokens": prompt - cached}
    info = httpx.get(url + "/workers", timeout=30).json()
    out["router"] = {"imbalance_guard_overrides": info.get("imbalance_guard_overrides", 0),
                     "estimated_hit_rate": [w.get("estimated_hit_rate") for w in info["workers"]]}
    return out


def print_table(results: dict[str, dict]) -> list[str]:
    base = results.get("round_robin")
    lines = ["| policy | workload | requests | wall s | req/s | hit rate | prompt tokens computed | "
             "req/s vs RR | hit rate vs RR | requests per worker |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for policy, res in results.items():
        for wl in ("groups", "multiturn", "total"):
            s = res[wl]
            ratio_t = f"{s['req_per_s'] / base[wl]['req_per_s']:.2f}x" if base else "-"
            ratio_h = (f"{s['hit_rate'] / base[wl]['hit_rate']:.2f}x" if base and base[wl]["hit_rate"]
                       else "-")
            per = "/".join(map(str, s.get("requests_per_worker", []))) or "-"
            lines.append(f"| {policy} | {wl} | {s['requests']} | {s['wall_s']:.1f} | {s['req_per_s']:.2f} | "
                         f"{s['hit_rate']:.3f} | {s['computed_prompt_tokens']} | {ratio_t} | {ratio_h} | {per} |")
    print("\n".join(lines))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="worker model: default (SmolLM2-135M) or a folder")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=4096, help="KV pool of each worker, in tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "exact", "round_robin", "shortest_queue"])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-words", type=int, default=400, help="words in each group's shared prefix")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=8, help="multiturn sessions")
    ap.add_argument("--turns", type=int, default=4, help="multiturn turns per session")
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-args", default="", help="extra router flags, e.g. '--balance-abs-threshold 4'")
    ap.add_argument("--out", type=Path, default=Path("bench_router.json"))
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "bench_router")
    args = ap.parse_args()

    args.log_dir.mkdir(parents=True, exist_ok=True)
    groups = groups_workload(args.seed, args.groups, args.per_group, args.prefix_words, args.max_tokens)
    multiturn = multiturn_workload(seed=args.seed, sessions=args.sessions, turns=args.turns)
    print(f"starting {args.workers} workers ({args.model}, KV pool {args.kv_tokens} tokens each) ...", flush=True)
    t0 = time.perf_counter()
    workers = start_workers(args, args.log_dir)
    urls = [u for u, _ in workers]
    print(f"workers ready in {time.perf_counter() - t0:.0f} s: {', '.join(urls)}", flush=True)
    results: dict[str, dict] = {}
    try:
        for policy in args.policies:
            url, router = start_router(policy, urls, args.log_dir, args.router_args.split())
            try:
                print(f"== {policy}", flush=True)
                results[policy] = asyncio.run(run_policy(url, groups, multiturn, args.concurrency))
                for wl in ("groups", "multiturn"):
                    s = results[policy][wl]
                    print(f"   {wl}: {s['ok']}/{s['requests']} ok, {s['wall_s']:.1f} s, {s['req_per_s']:.2f} req/s, "
                          f"hit rate {s['hit_rate']:.3f}, per worker {s['requests_per_worker']}", flush=True)
            finally:
                stop(router)
    finally:
        for _, proc in workers:
            stop(proc)
    lines = print_table(results)
    report = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "params": vars(args) | {
        "out": str(args.out), "log_dir": str(args.log_dir)},
        "results": results, "table": lines}
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
