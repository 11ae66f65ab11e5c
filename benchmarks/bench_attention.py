"""Decode and prefill step time of the real model with shared-prefix ("cascade") attention on and off.

SmolLM2-135M (30 layers, 9 query heads, 3 KV heads, head_dim 64), fp32, the default cached model. The KV
pool is filled with random values and request rows are written the way the radix cache writes them
(requests under one cached prefix hold the same slots), so no prompt has to be prefilled first: attention
cost depends on shapes and slot layout, not on the values. Workloads:

- decode, distinct 512: every request has its own 512-token context (no sharing: must not regress);
- decode, shared 1000+50: every request sits under one cached 1,000-token prefix with 50 tokens of its own;
- decode, distinct 50: short private contexts only, the floor a shared-prefix step can approach;
- prefill: 63 requests each adding a 30-token suffix over one cached 1,000-token prefix (one batch).

Each step runs the model forward (plan + 30 layers) and the logits of the sampled rows. Cascade on and off
alternate step by step on the same growing contexts, so machine noise hits both alike; the table reports
medians. ``--scatter`` hands out KV pages in random order (a long-running pool), which makes the shared
prefix a gather instead of an in-place read.

Usage: python benchmarks/bench_attention.py [--batches 8 32 64] [--steps 12] [--scatter] [--json out.json]
       python benchmarks/bench_attention.py --threads 1 --clock cpu   # on a busy machine
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from radix import PagedAllocator, ReqToTokenPool
from radix.kv_storage import KVShape, KVStorage
from runtime.attention.cascade import CascadePolicy
from runtime.attention.torch_native import TorchNativeBackend
from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.models.folders import resolve_model_path
from runtime.models.llama import LlamaForCausalLM
from runtime.models.loader import attention_shape, load_config, load_model


class Pool:
    """KV pool + request table for one workload; requests are rows, contexts grow a token per step."""

    def __init__(self, model: LlamaForCausalLM, capacity: int, max_requests: int, scatter: bool):
        arch = model.arch
        self.alloc = PagedAllocator(capacity, 1)
        if scatter:
            random.Random(0).shuffle(self.alloc._free_pages)  # a long-running pool's free-list order
        self.table = ReqToTokenPool(max_requests, 4096)
        shape = KVShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, model.dtype)
        self.kv = KVStorage(shape, self.alloc.total_slots)
        # Random KV, tiled from one 4k-slot block per buffer (filling GBs with randn takes too long).
        gen = torch.Generator().manual_seed(0)
        for buf in (self.kv.k_buffer, self.kv.v_buffer):
            block = torch.randn(4096, *buf.shape[2:], generator=gen)
            for layer in buf:
                for start in range(0, layer.shape[0], 4096):
                    part = layer[start : start + 4096]
                    part.copy_(block[: part.shape[0]])
        self.rows: list[int] = []
        self.lens: list[int] = []

    def add(self, length: int, share_from: int | None = None, shared: int = 0) -> int:
        """A request with ``length`` cached tokens, the first ``shared`` in request ``share_from``'s slots."""
        row = self.table.alloc()
        if share_from is not None:
            self.table.write(row, 0, self.table.table[self.rows[share_from], :shared].clone())
        own = self.alloc.alloc(length - shared)
        self.table.write(row, shared, own)
        self.rows.append(row)
        self.lens.append(length)
        return len(self.rows) - 1

    def batch(self, reqs: list[int], extend: int) -> ForwardBatch:
        """Each request in ``reqs`` adds ``extend`` tokens (slots allocated and written to the table)."""
        slots = []
        for r in reqs:
            s = self.alloc.alloc(extend)
            self.table.write(self.rows[r], self.lens[r], s)
            slots.append(s)
        prefix = [self.lens[r] for r in reqs]
        for r in reqs:
            self.lens[r] += extend
        ids = [[random.randrange(1000, 20000) for _ in range(extend)] for _ in reqs]
        return build_forward_batch(ids, prefix, [self.rows[r] for r in reqs], torch.cat(slots), self.kv,
                                   self.table.table)


CLOCK: Callable[[], float] = time.perf_counter


def step_ms(model: LlamaForCausalLM, fb: ForwardBatch) -> float:
    t0 = CLOCK()
    hidden = model.forward(fb)
    model.compute_logits(hidden.index_select(0, fb.last_token_rows()))
    return (CLOCK() - t0) * 1e3


def alternate(model: LlamaForCausalLM, policy: CascadePolicy, make_batch: Callable[[], ForwardBatch],
              steps: int, warmup: int = 2) -> tuple[float, float]:
    """Median ms per step with cascade on and off, steps interleaved."""
    backend = model.attn_backend
    assert isinstance(backend, TorchNativeBackend)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(warmup + steps):
        for on in (True, False) if i % 2 == 0 else (False, True):
            backend.cascade = policy if on else None
            ms = step_ms(model, make_batch())
            if i >= warmup:
                times[on].append(ms)
    backend.cascade = policy
    return statistics.median(times[True]), statistics.median(times[False])


DECODE_KINDS = {"distinct 512": 512, "shared 1000+50": 50, "distinct 50": 50}  # kind -> own tokens


def decode_case(model: LlamaForCausalLM, policy: CascadePolicy, batch: int, kind: str, steps: int,
                scatter: bool) -> tuple[float, float]:
    own = DECODE_KINDS[kind]
    pool = Pool(model, 1000 + batch * (own + 2 * (steps + 2) + 8), batch + 2, scatter)
    if kind.startswith("shared"):
        root = pool.add(1050)
        reqs = [root] + [pool.add(1050, root, 1000) for _ in range(batch - 1)]
    else:
        reqs = [pool.add(own) for _ in range(batch)]
    return alternate(model, policy, lambda: pool.batch(reqs, 1), steps)


def prefill_case(model: LlamaForCausalLM, policy: CascadePolicy, steps: int, scatter: bool) -> tuple[float, float]:
    pool = Pool(model, 4096, 70, scatter)
    root = pool.add(1000)
    reqs = [pool.add(1000, root, 1000) for _ in range(63)]
    fb = pool.batch(reqs, 30)

    def same_batch() -> ForwardBatch:  # rewrite the same suffix slots every time
        fb.attn_metadata = None
        return fb

    return alternate(model, policy, same_batch, steps, warmup=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per setting (each on and off)")
    ap.add_argument("--prefill-steps", type=int, default=3, help="timed prefill batches (0: skip the prefill)")
    ap.add_argument("--kinds", nargs="+", default=list(DECODE_KINDS), choices=list(DECODE_KINDS),
                    help="decode workloads to run")
    ap.add_argument("--scatter", action="store_true", help="random page order: the shared prefix is gathered")
    ap.add_argument("--min-prefix", type=int, default=CascadePolicy.min_prefix)
    ap.add_argument("--min-saved", type=int, default=CascadePolicy.min_saved_tokens)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (with --threads 1, robust to other load on the machine)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path("default")
    policy = CascadePolicy(args.min_prefix, args.min_saved)
    backend = TorchNativeBackend(attention_shape(load_config(folder)), cascade=policy)
    model, _ = load_model(folder, torch.float32, "cpu", backend)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, policy {policy}, "
          f"{'scattered' if args.scatter else 'contiguous'} pages, {args.clock} clock", flush=True)
    rows: list[dict[str, Any]] = []
    print(f"{'workload':<34} {'batch':>5} {'cascade on':>11} {'off':>9} {'off/on':>7}")
    for kind in args.kinds:
        for b in args.batches:
            on, off = decode_case(model, policy, b, kind, args.steps, args.scatter)
            rows.append(dict(workload=f"decode, {kind}", batch=b, on_ms=on, off_ms=off))
            print(f"{'decode ms/step, ' + kind:<34} {b:>5} {on:>11.1f} {off:>9.1f} {off / on:>7.2f}", flush=True)
    if args.prefill_steps:
        on, off = prefill_case(model, policy, args.prefill_steps, args.scatter)
        rows.append(dict(workload="prefill 63x30 over cached 1000", batch=63, on_ms=on, off_ms=off))
        print(f"{'prefill ms, 63 x 30 over 1000':<34} {63:>5} {on:>11.1f} {off:>9.1f} {off / on:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), scatter=args.scatter,
                           clock=args.clock, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
