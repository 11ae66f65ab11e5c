"""Tensor parallelism on this CPU: decode step time at tp 1/2/3 and the share of it rank 0 spends inside
collectives (waiting for the other ranks included), driving the ``ModelRunner`` directly.

    python benchmarks/bench_tp.py [--tp 1 2 3] [--batch 1 8] [--prompt 64] [--steps 24] [--json out.json]

Each tp size gets its own runner (default model, ``--dtype float32``, threads split between the ranks, gloo
over loopback). Per batch size: ``batch`` prompts of ``--prompt`` tokens are prefilled, then ``--steps``
decode steps are timed one by one (median). Also reported per decode token: the bytes rank 0 handed to
collectives (all-reduces, the logits gather, the step's broadcast), from ``TPComm``'s counters.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from engine_steps import cpu_simd, emit

from runtime.config import ServerArgs
from runtime.core.forward_batch import build_forward_batch
from runtime.executor.model_runner import ModelRunner


def decode_steps(runner: ModelRunner, batch: int, prompt: int, steps: int) -> dict[str, float]:
    table = runner.req_to_token.table
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (prompt,), generator=g).tolist() for _ in range(batch)]
    rows = list(range(batch))
    slots = runner.allocator.alloc(batch * (prompt + steps))
    for r in rows:
        table[r, : prompt + steps] = slots[r * (prompt + steps): (r + 1) * (prompt + steps)]
    loc = torch.cat([table[r, :prompt] for r in rows])
    fb = build_forward_batch(prompts, [0] * batch, rows, loc, runner.kv, table, runner.device)
    tokens = runner.forward(fb, fb.last_token_rows()).argmax(-1).tolist()
    comm = runner.tp.comm if runner.tp is not None else None
    times, comm_s, comm_b = [], 0.0, 0
    for i in range(steps):
        pos = prompt + i
        loc = torch.stack([table[r, pos] for r in rows])
        fb = build_forward_batch([[t] for t in tokens], [pos] * batch, rows, loc, runner.kv, table, runner.device)
        s0, b0 = (comm.comm_seconds, comm.comm_bytes) if comm else (0.0, 0)
        t = time.perf_counter()
        tokens = runner.forward(fb, fb.last_token_rows()).argmax(-1).tolist()
        times.append(time.perf_counter() - t)
        if comm:
            comm_s += comm.comm_seconds - s0
            comm_b += comm.comm_bytes - b0
    runner.allocator.free(slots)
    step = statistics.median(times)
    out = {"step_ms": round(1e3 * step, 2), "tokens_per_s": round(batch / step, 1)}
    if comm:
        out["collective_ms"] = round(1e3 * comm_s / steps, 2)
        out["collective_share"] = round(comm_s / sum(times), 3)
        out["collective_bytes_per_token"] = int(comm_b / (steps * batch))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--model", default="default")
    ap.add_argument("--json")
    a = ap.parse_args()
    result: dict[str, Any] = {"cpu": cpu_simd(), "threads": torch.get_num_threads(), "model": a.model, "runs": []}
    for tp in a.tp:
        runner = ModelRunner(ServerArgs(model=a.model, tp_size=tp, dtype="float32", log_level="warning",
                                        max_total_tokens=max(4096, 2 * max(a.batch) * (a.prompt + a.steps))))
        try:
            for b in a.batch:
                row = {"tp": tp, "batch": b, **decode_steps(runner, b, a.prompt, a.steps)}
                result["runs"].append(row)
                print(row, flush=True)
        finally:
            runner.close()
    emit(result, a.json)


if __name__ == "__main__":
    main()
