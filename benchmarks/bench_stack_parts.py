"""What a decode stack's time is made of: its arithmetic, and the reads it waits for.

One batch of 8 decode rows under a kept shared block of ``--prefix`` keys (a few-shot batch: one cascade group,
~40 own positions a row), SmolLM2's 30 layers with ``--fmt`` weights over a pool in the activations' dtype or int8
(``--kv``), run through ``DecodeStack`` in five variants, alternated ``--rounds`` times in one process:

- every layer its own weights and kept pack: a real step's reads (the weights, the packs, the rows' own KV);
- every layer reading layer 0's pack: the packs' reads then come from the caches;
- every layer reading layer 0's weights and pack: only the rows' own KV comes from memory, so this is the
  stack's arithmetic and its waits on the caches;
- the same two without the cascade group (the rows attend only their own positions).

The differences between them are what the reads add over the arithmetic, and what the shared part adds. Each
variant's median and its phases (DecodeStack's clock, ms per run) are printed.

    python benchmarks/bench_stack_parts.py [--fmt int8] [--kv int8] [--prefix 1015] [--rounds 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from bench_attention_kernels import DIM, KV_HEADS, LAYERS, pools
from bench_kernel_ab import LINEAR_SHAPES, decode_stack, own_table, step_inputs
from engine_steps import cpu_simd, emit

from runtime.kernels.build import load_kernels
from runtime.models.packed import pack_weight

BATCH, OWN = 8, 40
LAYOUTS = {"int8": "vnni", "bfloat16": "bf16pair"}


Variant = dict[str, tuple[Any, list[Any]]]


def variants(k: Any, fmt: str, kv: str, prefix: int, g: torch.Generator) -> tuple[Variant, tuple[Any, ...]]:
    """Each variant's stack and cascade groups over the same pools, weights and packs; and (the K and V buffers,
    the prefix, each row's own length)."""
    act = torch.bfloat16
    weights = [[pack_weight(torch.randn(n, kk, generator=g) * 0.05, fmt, LAYOUTS[fmt]) for n, kk in LINEAR_SHAPES]
               for _ in range(LAYERS)]
    norms = [(torch.ones(LINEAR_SHAPES[0][1], dtype=act), torch.ones(LINEAR_SHAPES[0][1], dtype=act))] * LAYERS
    length = OWN + 1
    slots = prefix + BATCH * length + 64
    layer_pools = [pools(slots, g, kv) for _ in range(LAYERS)]
    k_buf, v_buf = (torch.stack([p[i] for p in layer_pools]).view(LAYERS, slots, KV_HEADS, -1) for i in (0, 1))
    shared = torch.arange(prefix)
    packs = [list(k.pack_prefix(k_buf[i].view(slots, -1), v_buf[i].view(slots, -1), shared, KV_HEADS, DIM))
             for i in range(LAYERS)]

    def group(layer_packs: list[list[torch.Tensor]]) -> list[Any]:
        return [k.SharedGroup(0, BATCH, shared, torch.full((BATCH,), prefix, dtype=torch.int64), layer_packs)]

    own_weights, first_weights = decode_stack(k, weights, norms), decode_stack(k, [weights[0]] * LAYERS, norms)
    return {
        "own weights, own packs": (own_weights, group(packs)),
        "own weights, layer 0's pack": (own_weights, group([packs[0]] * LAYERS)),
        "layer 0's weights and pack": (first_weights, group([packs[0]] * LAYERS)),
        "own weights, no group": (own_weights, []),
        "layer 0's weights, no group": (first_weights, []),
    }, (k_buf, v_buf, prefix, length)


@torch.inference_mode()  # as the model runs its forward (see bench_kernel_ab.measure)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", default="int8", choices=sorted(LAYOUTS), help="weight format (default int8)")
    ap.add_argument("--kv", default="int8", choices=["int8", "bfloat16"], help="KV pool format (default int8)")
    ap.add_argument("--prefix", type=int, default=1015, help="keys of the shared block (default 1015)")
    ap.add_argument("--rounds", type=int, default=60, help="alternations of the five variants (default 60)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    k = load_kernels("fastcpu")
    if not k.bf16_dot():
        raise SystemExit("kept packs need the bf16 GEMM kernel (a CPU with AVX512_BF16)")
    g = torch.Generator().manual_seed(0)
    runs, (k_buf, v_buf, prefix, length) = variants(k, a.fmt, a.kv, a.prefix, g)
    kv_index = own_table(BATCH, prefix, length)
    lengths, new_slots, cos, sin, x = step_inputs(kv_index, g, torch.bfloat16)

    def run(name: str) -> float:
        s, groups = runs[name]
        t = time.perf_counter()
        s.run(x.clone(), cos, sin, new_slots, kv_index, lengths, k_buf, v_buf, groups)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {name: [] for name in runs}
    for name in runs:  # warm-up
        run(name)
    for r in range(a.rounds):
        for name in runs if r % 2 == 0 else reversed(runs):
            times[name].append(run(name))
    result: dict[str, Any] = {"cpu": cpu_simd(), "threads": a.threads, "fmt": a.fmt, "kv": a.kv, "prefix": prefix}
    for name, (s, groups) in runs.items():
        s.time_phases(True)
        s.take_phase_times()
        for _ in range(max(10, a.rounds // 2)):
            s.run(x.clone(), cos, sin, new_slots, kv_index, lengths, k_buf, v_buf, groups)
        phases = s.take_phase_times()
        s.time_phases(False)
        n = phases.pop("runs")
        result[name] = {"ms": round(1000 * statistics.median(times[name]), 3),
                        "phases_ms": {p: round(1000 * v / n, 3) for p, v in sorted(phases.items())}}
    emit(result, a.json)


if __name__ == "__main__":
    main()
