"""Overload: thousands of concurrent streaming requests against a server whose KV pool is far too small and
whose waiting queue is bounded. Every request must either complete or get a 429, nothing else; no KV may
leak; and every completed answer must agree with the same request sent alone (the float-aware oracle of
tests/oracle.py, fp32).

    python benchmarks/bench_overload.py [--requests 2000] [--max-queued 256] [--pool-ratio 10] [--json out.json]

The pool holds 1/--pool-ratio of the tokens all requests together need. The requests share a few system
prompts (so the radix cache works under pressure too) and stream through /generate with their top-2 logprobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from engine_steps import cpu_simd, emit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.bench.servers import radixserve_server
from tests.oracle import WITH_TOP2, Greedy, check_greedy

SYSTEMS = ["You are a careful assistant. Answer briefly.", "Translate the user's words into French.",
           "List three facts about the topic.", "Reply with a short poem about the subject."]
TOPICS = ["rivers", "glass", "the moon", "bread", "trains", "owls", "copper", "tea", "maps", "snow", "bees"]


def make_requests(n: int, new_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(3, 30)))
        out.append({"rid": f"load-{i}", "text": f"{rng.choice(SYSTEMS)}\nUser: {words}\nAssistant:",
                    "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
                    **WITH_TOP2})
    return out


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """{"status", "final"} of one streamed request (final: the last frame, or the error body)."""
    try:
        async with session.post(url + "/generate", json={**body, "stream": True}) as resp:
            if resp.status != 200:
                return {"status": resp.status, "final": await resp.json(content_type=None),
                        "retry_after": resp.headers.get("Retry-After")}
            last: dict[str, Any] | None = None
            lps: list[Any] = []
            tops: list[Any] = []
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
                    meta = last["meta_info"]  # a frame carries only the logprobs not sent before
                    lps += meta.get("output_token_logprobs", [])
                    tops += meta.get("output_top_logprobs", [])
            if last is not None:
                last["meta_info"].update(output_token_logprobs=lps, output_top_logprobs=tops)
            return {"status": 200, "final": last}
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"status": f"client error: {type(exc).__name__}: {exc}", "final": None}


async def burst(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return await asyncio.gather(*(stream_one(session, url, b) for b in bodies))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-queued", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--pool-ratio", type=float, default=10.0, help="total demand / KV pool size")
    ap.add_argument("--check-alone", type=int, default=200, help="completed answers re-sent alone and compared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    bodies = make_requests(args.requests, args.new_tokens, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        # size the pool from the real prompt lengths: one server start to count, then the measured one
        probe_pool = 65536
        server = radixserve_server(Path(tmp), args.model, extra=[
            "--dtype", "float32", "--max-total-tokens", str(probe_pool)])
        with server:
            lengths = [httpx.post(server.url + "/generate", timeout=600, json={
                "text": b["text"], "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]["prompt_tokens"]
                for b in bodies[:100]]
        demand = sum(lengths) / len(lengths) * args.requests + args.new_tokens * args.requests
        pool = int(demand / args.pool_ratio)
        flags = ["--dtype", "float32", "--max-total-tokens", str(pool), "--max-queued-requests",
                 str(args.max_queued), "--max-running-requests", str(args.max_running)]
        server = radixserve_server(Path(tmp), args.model, extra=flags)
        with server:
            t0 = time.perf_counter()
            results = asyncio.run(burst(server.url, bodies))
            wall = time.perf_counter() - t0
            info = httpx.get(server.url + "/get_server_info", timeout=60).json()
            completed = [(b, r) for b, r in zip(bodies, results) if r["status"] == 200]
            statuses = Counter(str(r["status"]) for r in results)
            incomplete = [r for _, r in completed
                          if (r["final"] or {}).get("meta_info", {}).get("finish_reason", {}).get("type") != "length"]
            bad_429 = [r for r in results if r["status"] == 429
                       and (r["final"]["error"]["type"] != "rate_limit_error" or not r.get("retry_after"))]
            # the same requests alone, one at a time, as references
            rng = random.Random(args.seed)
            sample = rng.sample(completed, min(args.check_alone, len(completed)))
            disagreements = []
            for body, res in sample:
                alone = httpx.post(server.url + "/generate", timeout=600, json={**body, "rid": body["rid"] + "-alone"})
                problem = check_greedy(Greedy.from_native(alone.json()), Greedy.from_native(res["final"]))
                if problem:
                    disagreements.append(f"{body['rid']}: {problem}")
            info_after = httpx.get(server.url + "/get_server_info", timeout=60).json()
    kv = info_after["kv"]
    report = {
        "cpu": cpu_simd(), "requests": args.requests, "max_queued_requests": args.max_queued,
        "max_running_requests": args.max_running, "kv_pool_tokens": pool, "token_demand": int(demand),
        "statuses": dict(statuses), "completed": len(completed), "incomplete_streams": len(incomplete),
        "bad_429s": len(bad_429), "retractions": info["scheduler"]["retractions"],
        "kv_after": {k: kv[k] for k in ("private", "protected")}, "wall_s": round(wall, 1),
        "checked_alone": len(sample), "disagreements": disagreements[:10], "num_disagreements": len(disagreements),
    }
    ok = (set(statuses) <= {"200", "429"} and not incomplete and not bad_429 and kv["private"] == 0
          and kv["protected"] == 0 and not disagreements)
    report["ok"] = ok
    emit(report, args.json)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
