"""Prefill chunks over a cached prefix, and cascade groups over their shared prefix, on a bf16 KV pool: the GEMM
kernel (``extend_attention``) against the decode kernel and SDPA, alone and in whole scheduler steps, in one run.

1. Whole prefill steps of the default model in bf16 (an in-process Engine): a 1,000-token prompt is cached,
   then prompts that extend it by E tokens run with the GEMM kernel on and off (alternating, so machine
   noise hits both alike); the median forward time of each step.
2. One layer's attention (SmolLM2's 9 query heads, 3 KV heads, head dim 64; random bf16 pool, scattered
   slots) for chunks of E new tokens over a P-token prefix: SDPA over the gathered KV with the causal-with-
   prefix mask, the decode kernel (``decode_attention``, tokens of one request attended together) and
   ``extend_attention``; medians of ``--repeats`` calls.
3. A cascade group: 8 requests under the cached 1,000-token prompt, each adding 25 tokens and decoding 16; its
   batch-8 decode steps with the kernel on (the shared part through it) and off (through SDPA), alternating;
   then one layer's shared part alone for groups of 2, 8 and 32 decode rows.

Needs a CPU with AVX512_BF16 (where the kernel is built).

    python benchmarks/bench_extend.py [--tokens 16 32 64 130 300 1024] [--prefix 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from engine_steps import cpu_simd, decode_step_ms, emit, median_ms

from runtime.attention.cascade import attention_with_lse
from runtime.attention.torch_native import TorchNativeBackend
from runtime.engine import Engine
from runtime.kernels.build import load_kernels

HEADS, KV_HEADS, DIM = 9, 3, 64


def layer_row(kernels: Any, k_pool: torch.Tensor, v_pool: torch.Tensor, e: int, prefix: int, repeats: int,
              g: torch.Generator) -> dict[str, Any]:
    """One layer's attention for ``e`` new tokens over ``prefix`` scattered slots, three ways."""
    s, group, scale = prefix + e, HEADS // KV_HEADS, DIM**-0.5
    index = torch.randperm(k_pool.shape[0], generator=g)[:s]
    q = torch.randn(e, HEADS, DIM, generator=g).bfloat16()
    lengths = torch.arange(prefix + 1, s + 1)
    hidden = torch.arange(s)[None, :] > (prefix + torch.arange(e))[:, None]
    mask = torch.zeros(e, s).masked_fill_(hidden, float("-inf")).bfloat16()

    def sdpa() -> torch.Tensor:
        k = k_pool.index_select(0, index).view(s, KV_HEADS, DIM).transpose(0, 1)
        v = v_pool.index_select(0, index).view(s, KV_HEADS, DIM).transpose(0, 1)
        q4 = q.reshape(e, KV_HEADS, group, DIM).permute(1, 2, 0, 3)
        return F.scaled_dot_product_attention(q4, k.unsqueeze(1).expand(KV_HEADS, group, s, DIM),
                                              v.unsqueeze(1).expand(KV_HEADS, group, s, DIM), attn_mask=mask,
                                              scale=scale)

    def decode() -> Any:
        return kernels.decode_attention(q.float(), k_pool, v_pool, index.view(1, -1),
                                        torch.zeros(e, dtype=torch.int64), lengths, scale, KV_HEADS)

    def extend() -> Any:
        return kernels.extend_attention(q.float(), k_pool, v_pool, index, lengths, scale, KV_HEADS)

    row = {"tokens": e, "prefix": prefix, "sdpa_ms": median_ms(sdpa, repeats),
           "decode_kernel_ms": median_ms(decode, repeats), "extend_ms": median_ms(extend, repeats)}
    row["vs_sdpa"] = row["sdpa_ms"] / row["extend_ms"]
    return row


def one_layer(tokens: list[int], prefix: int, repeats: int) -> list[dict[str, Any]]:
    kernels = load_kernels("fastcpu")
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(40000, KV_HEADS * DIM, generator=g).bfloat16()
    v_pool = torch.randn(40000, KV_HEADS * DIM, generator=g).bfloat16()
    rows = []
    for e in tokens:
        rows.append(layer_row(kernels, k_pool, v_pool, e, prefix, repeats, g))
        print(rows[-1], flush=True)
    return rows


def use_gemm(engine: Engine, on: bool) -> None:
    """Switch the engine's GEMM attention kernel on or off (between steps, on the scheduler thread)."""
    def switch(scheduler: Any) -> None:
        backend = scheduler.runner.attn_backend
        assert isinstance(backend, TorchNativeBackend) and backend.paged is not None
        backend.paged.bf16_gemm = on

    engine.inspect(switch)


def prefill_ms(engine: Engine, prompt: list[int]) -> float:
    """The forward time of ``prompt``'s one step (a single new token: the prefill is the request's only step)."""
    before = engine.inspect(lambda s: (s.stats.steps, s.stats.forward_seconds))
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    steps, seconds = engine.inspect(lambda s: (s.stats.steps, s.stats.forward_seconds))
    assert steps == before[0] + 1, "the prompt took more than one step"
    return 1000 * (seconds - before[1])


def whole_steps(tokens: list[int], prefix: int, repeats: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    cached = [rng.randrange(100, 40000) for _ in range(prefix)]
    rows = []
    with Engine("default", dtype="bfloat16", log_level="warning") as engine:
        engine.generate(input_ids=cached, sampling_params={"max_new_tokens": 1})
        for e in tokens:
            times: dict[str, list[float]] = {"gemm": [], "decode_kernel_or_sdpa": []}
            for _ in range(repeats):
                for mode in times:
                    use_gemm(engine, mode == "gemm")
                    times[mode].append(prefill_ms(engine, cached + [rng.randrange(100, 40000) for _ in range(e)]))
            row: dict[str, Any] = {"tokens": e, "prefix": prefix,
                                   **{f"{m}_ms": statistics.median(t) for m, t in times.items()}}
            row["speedup"] = row["decode_kernel_or_sdpa_ms"] / row["gemm_ms"]
            rows.append(row)
            print(row, flush=True)
    return rows


def group_steps(prefix: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(1)
    cached = [rng.randrange(100, 40000) for _ in range(prefix)]
    times: dict[str, list[float]] = {}
    with Engine("default", dtype="bfloat16", log_level="warning") as engine:
        engine.generate(input_ids=cached, sampling_params={"max_new_tokens": 1})
        for _ in range(repeats):
            for mode in ("gemm", "sdpa"):
                use_gemm(engine, mode == "gemm")
                prompts = [cached + [rng.randrange(100, 40000) for _ in range(25)] for _ in range(8)]
                run = functools.partial(engine.generate, input_ids=prompts,
                                        sampling_params={"max_new_tokens": 16, "ignore_eos": True})
                decode, _ = decode_step_ms(engine, 8, run)
                times.setdefault(f"{mode}_decode_b8", []).append(decode)
    out: dict[str, Any] = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    out["decode_speedup"] = out["sdpa_decode_b8_ms"] / out["gemm_decode_b8_ms"]
    print(out, flush=True)
    return out


def shared_row(kernels: Any, k_pool: torch.Tensor, v_pool: torch.Tensor, n: int, prefix: int,
               repeats: int, g: torch.Generator) -> dict[str, Any]:
    """One layer's shared part for ``n`` decode rows over ``prefix`` contiguous slots: SDPA and the kernel."""
    group, scale = HEADS // KV_HEADS, DIM**-0.5
    q = torch.randn(n, HEADS, DIM, generator=g).bfloat16()
    index = torch.arange(64, 64 + prefix)
    lengths = torch.full((n,), prefix)

    def sdpa() -> Any:
        k, v = k_pool.narrow(0, 64, prefix), v_pool.narrow(0, 64, prefix)
        q4 = q.reshape(n, KV_HEADS, group, DIM).transpose(0, 1).reshape(1, KV_HEADS, n * group, DIM)
        return attention_with_lse(q4, k.view(1, prefix, KV_HEADS, DIM).transpose(1, 2),
                                  v.view(1, prefix, KV_HEADS, DIM).transpose(1, 2), None, False, scale)

    def extend() -> Any:
        return kernels.extend_attention(q.float(), k_pool, v_pool, index, lengths, scale, KV_HEADS)

    row = {"rows": n, "prefix": prefix, "sdpa_ms": median_ms(sdpa, repeats), "extend_ms": median_ms(extend, repeats)}
    row["vs_sdpa"] = row["sdpa_ms"] / row["extend_ms"]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", nargs="+", type=int, default=[16, 32, 64, 130, 300, 1024])
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    kernels = load_kernels("fastcpu")
    if not kernels.bf16_dot():
        raise SystemExit("extend_attention is built only for CPUs with AVX512_BF16; this one has: " + cpu_simd())
    # The Engine first: torch work on this thread before it would leave a second OpenMP thread team beside the
    # scheduler thread's (see bench_cpu_forward.py), which slows every step.
    steps = whole_steps(a.tokens, a.prefix, a.repeats)
    group = group_steps(a.prefix, max(2, a.repeats // 2))
    result = {"cpu": cpu_simd(), "threads": torch.get_num_threads(), "prefill_steps": steps, "group_steps": group,
              "one_layer": one_layer(a.tokens, a.prefix, a.repeats)}
    g = torch.Generator().manual_seed(1)
    k_pool = torch.randn(a.prefix + 64, KV_HEADS * DIM, generator=g).bfloat16()
    v_pool = torch.randn(a.prefix + 64, KV_HEADS * DIM, generator=g).bfloat16()
    result["shared_one_layer"] = [shared_row(kernels, k_pool, v_pool, n, a.prefix, a.repeats, g) for n in (2, 8, 32)]
    emit(result, a.json)


if __name__ == "__main__":
    main()
