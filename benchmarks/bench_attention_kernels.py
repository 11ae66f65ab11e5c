"""The CPU attention kernels alone, on SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64), bf16 pool and
bf16 queries as the default format runs them: medians of repeated calls, no model around them.

- ``extend_attention``: one layer, a cold causal prefill of ``--prefill`` tokens, and a chunk of ``--chunk`` new
  tokens over a ``--prefix``-token cached prefix (the prefix packed per call, as a prefill chunk does);
- ``decode_attention``: 30 layers' pools (so the KV is read from memory, as in a decode step) for batches of 1 and 8
  rows over ``--context`` positions each; and one layer for the batch of 8 on one thread with its KV in cache
  (the kernel's arithmetic alone).

Needs a CPU with AVX512_BF16 for the extend kernel (skipped without it).

    python benchmarks/bench_attention_kernels.py [--prefill 1024] [--chunk 22] [--prefix 1050] [--context 1065]
                                                 [--json out.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from engine_steps import cpu_simd, emit, median_ms

from radix.kv_int8 import quantize
from runtime.kernels.build import load_kernels

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30
SCALE = DIM ** -0.5


def pools(slots: int, g: torch.Generator, fmt: str = "bfloat16") -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pools in ``fmt``: "bfloat16", "float32" (an fp32 model's) or "int8" (the int8 KV format,
    radix/kv_int8.py)."""
    k = torch.randn(slots, KV_HEADS, DIM, generator=g) * 0.5
    v = torch.randn(slots, KV_HEADS, DIM, generator=g)
    if fmt == "int8":
        return quantize(k).view(slots, -1), quantize(v).view(slots, -1)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[fmt]
    return k.view(slots, -1).to(dtype), v.view(slots, -1).to(dtype)


def extend(k: Any, new: int, prefix: int, g: torch.Generator) -> dict[str, float]:
    """One layer: ``new`` tokens after ``prefix`` cached ones, at scattered slots of a pool."""
    slots = 4 * (new + prefix) + 64
    kp, vp = pools(slots, g)
    index = torch.randperm(slots, generator=g)[: new + prefix].sort().values
    q = torch.randn(new, HEADS, DIM, generator=g).bfloat16()
    lengths = torch.arange(prefix + 1, prefix + new + 1)
    ms = median_ms(lambda: k.extend_attention(q, kp, vp, index, lengths, SCALE, KV_HEADS, None),
                   max(15, 6000 // new), warmup=3)
    macs = int(lengths.sum()) * HEADS * DIM * 2  # scores and the value sum
    return {"layer_ms": ms, "layers_ms": LAYERS * ms, "g_mac_s": macs / ms / 1e6}


def decode_step(batch: int, context: int, layers: int, g: torch.Generator,
                fmt: str = "bfloat16", shared: int = 0) -> Callable[[Any], None]:
    """A decode step's attention over ``layers`` layers' own pools in ``fmt`` (see :func:`pools`): ``batch`` rows
    of ``context`` positions, the first ``shared`` of them the same slots in every row (requests under one cached
    prefix), run by the kernel module it is given (bench_kernel_ab.py hands it two builds in turn). Queries are
    fp32 over an fp32 pool, bf16 otherwise (a bf16 model's)."""
    own = context - shared
    layer_pools = [pools(shared + batch * own + 64, g, fmt) for _ in range(layers)]
    index = torch.stack([torch.cat([torch.arange(shared), shared + r * own + torch.arange(own)]) for r in range(batch)])
    lengths = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, DIM, generator=g)
    q = q if fmt == "float32" else q.bfloat16()

    def step(k: Any) -> None:
        for kp, vp in layer_pools:
            k.decode_attention(q, kp, vp, index, None, lengths, SCALE, KV_HEADS)

    return step


def decode(k: Any, batch: int, context: int, g: torch.Generator) -> dict[str, float]:
    """30 layers' pools read once each, as one decode step does."""
    step = decode_step(batch, context, LAYERS, g)
    ms = median_ms(lambda: step(k), 15, warmup=3)
    kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * DIM * 2
    return {"step_ms": ms, "kv_mb": kv_bytes / 1e6, "gb_s": kv_bytes / ms / 1e6}


def decode_in_cache_one_thread(k: Any, batch: int, context: int, g: torch.Generator) -> float:
    """One layer, called again and again (its KV stays in cache), on one thread: the kernel's arithmetic alone."""
    step = decode_step(batch, context, 1, g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return median_ms(lambda: step(k), 200, warmup=3)
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=22)
    ap.add_argument("--prefix", type=int, default=1050)
    ap.add_argument("--context", type=int, default=1065)
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    k = load_kernels("fastcpu")
    g = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"cpu": cpu_simd(), "threads": torch.get_num_threads()}
    if k.bf16_dot():
        result[f"extend_prefill_{a.prefill}"] = extend(k, a.prefill, 0, g)
        result[f"extend_chunk_{a.chunk}_over_{a.prefix}"] = extend(k, a.chunk, a.prefix, g)
    for b in (1, 8):
        result[f"decode_b{b}_{a.context}"] = decode(k, b, a.context, g)
    result[f"decode_b8_{a.context}_one_layer_one_thread_in_cache_ms"] = decode_in_cache_one_thread(k, 8, a.context, g)
    emit(result, a.json)


if __name__ == "__main__":
    main()
