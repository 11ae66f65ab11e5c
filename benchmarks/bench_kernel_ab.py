"""This checkout's CPU kernels against another revision's, both loaded in one process and timed alternately.

On a shared VM the memory bandwidth moves by 10-20% from one minute to the next, so two benchmark runs a minute
apart can differ by more than a kernel change does. Here the kernel set ``fastcpu`` of ``--base`` (its
``runtime/kernels`` files, read with ``git show``) is built beside this checkout's, and every case runs on both
builds in turn, ``--rounds`` times, on the same inputs (the order flips every round). Each case reports both
medians and their ratio. A case that one of the builds cannot run (a kernel it lacks, an older signature) is
reported as such and skipped.

Cases, on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, bf16 pool and queries):

- decode attention over 1,065 positions for batches of 1 and 8, 30 layers' pools (read from memory), and one
  layer's pool 30 times (in cache); the same over int8 KV pools (``--kv-cache-dtype int8``'s format) and over fp32
  pools with fp32 queries (an fp32 model's: the portable kernel); batch 8 under a 1,050-slot prefix every row's
  table shares (a few-shot batch without a cascade group), over fp32 and int8 pools;
- a cascade group's shared part: 1, 4, 8 and 16 decode rows against a kept 1,050-key pack, 30 layers;
- prefill chunks through the same kernel (packed per call): a ~20-token question after a 1,050-token block, 170
  tokens after it, a cold 1,024-token chunk;
- the shared part (1 and 8 rows) and the three chunks over int8 KV pools, each build packing the prefix with its own
  ``pack_prefix`` (a pack's format is the build's own business);
- a cascade group's merge of the two parts into 8 and 160 bf16 rows (a decode batch; 7 few-shot questions), 30 layers;
- the linear layers of 30 decoder layers (qkv, o, gate/up, down), bf16 and int8, at 1 and 8 rows (int8 also at
  169, a few-shot prefill's rows), where the host has the instructions, and fp32 (the portable kernel) at 1 and 8;
- the whole decode stack (every layer's norms, linears, rotary, KV store, attention and merge in one native call) at
  batch 8 under a kept 1,050-key shared block with ~40 own positions per row (a few-shot batch), bf16 and int8
  weights over a bf16 pool, and int8 weights over an int8 pool; at batch 1, bf16 weights, and int8 weights over
  an int8 pool; on CPUs without AVX512_BF16 (no cascade groups there), batches of 1 and 8 over 1,091 own positions
  each, fp32 weights and activations over an fp32 pool (the default format there) and int8 weights over an int8
  pool, and batch 8 under a 1,050-slot prefix in every row's table (a few-shot batch, no group) in both formats;
- the sampler's greedy argmax of 8 logits rows over 49,152 tokens (``torch.max`` for a build without
  ``argmax_rows``);
- the element-wise kernels of 30 layers (two RMSNorms and one SiLU·mul each) at 1, 8 and 1,024 rows.

    python benchmarks/bench_kernel_ab.py --base REV [--rounds 16] [--threads 2] [--only TEXT] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from bench_attention_kernels import DIM, HEADS, KV_HEADS, LAYERS, SCALE, decode_step, pools
from engine_steps import cpu_simd, emit

from runtime.kernels.build import HERE, build_kernels, load_kernels
from runtime.models.packed import pack_weight

CONTEXT, VOCAB = 1065, 49152
LINEAR_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate/up, down: [N, K]

Case = Callable[[ModuleType], Any]


def kernels_at(rev: str, folder: Path) -> ModuleType:
    """The fastcpu kernels of git revision ``rev``, built from its files copied into ``folder``."""
    repo = HERE.parents[1]
    kernel_dir = HERE.relative_to(repo).as_posix()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{kernel_dir}"], cwd=repo, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".cpp", ".h")):
            data = subprocess.run(["git", "show", f"{rev}:{kernel_dir}/{name}"], cwd=repo, check=True,
                                  capture_output=True).stdout
            (folder / name).write_bytes(data)
    return build_kernels("fastcpu", folder)


def decode_case(batch: int, layers: int, repeats: int, g: torch.Generator, fmt: str = "bfloat16",
                shared: int = 0) -> Case:
    step = decode_step(batch, CONTEXT, layers, g, fmt, shared)

    def run(k: ModuleType) -> None:
        for _ in range(repeats):
            step(k)

    return run


def shared_case(g: torch.Generator, rows: int = 8, fmt: str = "bfloat16") -> Case:
    """A cascade group's ``rows`` decode rows against its kept 1,050-key pack over ``fmt`` pools, 30 layers."""
    prefix, slots = 1050, 4096
    layer_pools = [pools(slots, g, fmt) for _ in range(LAYERS)]
    index = torch.randperm(slots, generator=g)[:prefix].sort().values
    # each build's own packs, made once (an int8 pool's may be in another format per build)
    packs = functools.cache(lambda k: [k.pack_prefix(kp, vp, index, KV_HEADS, DIM) for kp, vp in layer_pools])
    q = torch.randn(rows, HEADS, DIM, generator=g).bfloat16()
    lengths = torch.full((rows,), prefix, dtype=torch.int64)

    def run(k: ModuleType) -> None:
        for (kp, vp), pack in zip(layer_pools, packs(k)):
            k.extend_attention(q, kp, vp, index, lengths, SCALE, KV_HEADS, pack)

    return run


def chunk_case(tokens: int, prefix: int, g: torch.Generator, fmt: str = "bfloat16") -> Case:
    """A prefill chunk of ``tokens`` new tokens over ``prefix`` cached ones (token i sees prefix + i + 1 slots),
    packed in the call as a chunk is, 30 layers' ``fmt`` pools."""
    slots = 4096
    layer_pools = [pools(slots, g, fmt) for _ in range(LAYERS)]
    index = torch.randperm(slots, generator=g)[: prefix + tokens].sort().values
    q = torch.randn(tokens, HEADS, DIM, generator=g).bfloat16()
    lengths = torch.arange(prefix + 1, prefix + tokens + 1)

    def run(k: ModuleType) -> None:
        for kp, vp in layer_pools:
            k.extend_attention(q, kp, vp, index, lengths, SCALE, KV_HEADS)

    return run


def merge_case(rows: int, g: torch.Generator) -> Case:
    """A cascade group's merge of its shared part into its own parts' bf16 rows, ``rows`` rows, 30 layers."""
    own = [torch.randn(rows, HEADS, DIM, generator=g).bfloat16() for _ in range(LAYERS)]
    lse = torch.randn(rows, HEADS, generator=g)
    shared = torch.randn(rows, HEADS, DIM, generator=g)
    lse_shared = torch.randn(rows, HEADS, generator=g)

    def run(k: ModuleType) -> None:
        for out in own:
            k.merge_attention(out, lse, shared, lse_shared)

    return run


def linear_case(fmt: str, rows: int, g: torch.Generator, layers: int = LAYERS, act_block: int = 32,
                layout: str | None = None) -> Case:
    """``layers`` decoder layers' linear layers at ``rows`` rows, run by the kernel module it is given;
    ``act_block``: int8's activation block (the runtime's is 32; 0: one scale per row); ``layout``: the packed
    layout, which picks the kernel (None: the format's dot-product one; "kmajor": weights widened to fp32)."""
    layout = layout or {"int8": "vnni", "bfloat16": "bf16pair", "float32": "kmajor"}[fmt]
    weights = [pack_weight(torch.randn(n, k, generator=g) * 0.05, fmt, layout)
               for _ in range(layers) for n, k in LINEAR_SHAPES]
    # an fp32 model's activations are fp32 (the portable kernel, every host's --dtype float32); the others' bf16
    xs = {k: torch.randn(rows, k, generator=g).to(torch.float32 if fmt == "float32" else torch.bfloat16)
          for _, k in LINEAR_SHAPES}
    built: dict[int, list[Any]] = {}

    def run(k: ModuleType) -> None:
        if id(k) not in built:  # each build's own PackedLinear objects over the same packed weights
            built[id(k)] = [k.PackedLinear(w.layout, w.data, w.out_features, w.scale, act_block) for w in weights]
        for lin, w in zip(built[id(k)], weights):
            lin.run(xs[w.in_features], None, None)

    return run


def decode_stack(k: ModuleType, weights: list[list[Any]], norms: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Build ``k``'s ``DecodeStack`` of SmolLM2's shape over packed ``weights`` (qkv, o, gate/up, down per layer) and
    each layer's two RMSNorm weights, without biases."""
    stack = k.DecodeStack(HEADS, KV_HEADS, DIM, 1e-5, SCALE)
    for layer, (n1, n2) in zip(weights, norms):
        stack.add_layer(n1, n2, [k.PackedLinear(w.layout, w.data, w.out_features, w.scale, 32) for w in layer],
                        [None] * 4)
    return stack


def own_table(batch: int, prefix: int, length: int) -> torch.Tensor:
    """``[batch, length]`` slots: row r's own positions, consecutive, after a ``prefix`` of shared slots."""
    return torch.stack([prefix + r * length + torch.arange(length) for r in range(batch)])


def step_inputs(kv_index: torch.Tensor, g: torch.Generator,
                act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``DecodeStack.run`` takes per step for rows reading all of ``kv_index`` [B, L]: their lengths, their new
    tokens' slots (each row's last), the RoPE tables and the hidden rows (in ``act``)."""
    batch = kv_index.shape[0]
    lengths = torch.full((batch,), kv_index.shape[1], dtype=torch.int64)
    new_slots = kv_index[:, -1].contiguous()
    angle = torch.rand(batch, DIM, generator=g)
    cos, sin = angle.cos().to(act), angle.sin().to(act)
    x = (torch.randn(batch, LINEAR_SHAPES[0][1], generator=g) * 0.1).to(act)
    return lengths, new_slots, cos, sin, x


def stack_case(fmt: str, g: torch.Generator, batch: int = 8, prefix: int = 1050, own: int = 40,
               kv: str = "bfloat16", rows: str = "group") -> Case:
    """Every decoder layer of a decode batch in one ``DecodeStack.run`` call: ``batch`` rows with ``own`` positions
    each under one shared ``prefix``, either as a cascade group (``rows="group"``: the prefix packed once per build,
    as the backend keeps it) or in each row's table (``"shared"``: no group, the rows' slots for the prefix the
    same, as a CPU without the GEMM kernel runs them), or with ``prefix`` positions of their own more (``"own"``);
    ``fmt`` weights, a ``kv`` pool. Activations in bf16 under a group (a bf16 model's, where the GEMM kernel is
    built), else in fp32 (the model of a CPU without AVX512_BF16), with a pool in the activations' dtype or int8."""
    layout = {"int8": "vnni", "bfloat16": "bf16pair", "float32": "kmajor"}[fmt]
    grouped = rows == "group"
    act = torch.bfloat16 if grouped else torch.float32
    hidden = LINEAR_SHAPES[0][1]
    weights = [[pack_weight(torch.randn(n, kk, generator=g) * 0.05, fmt, layout) for n, kk in LINEAR_SHAPES]
               for _ in range(LAYERS)]
    norms = [(torch.ones(hidden, dtype=act), torch.ones(hidden, dtype=act)) for _ in range(LAYERS)]
    length = prefix + own + 1 if rows == "own" else own + 1  # each row's own positions
    slots = prefix + batch * length + 64
    layer_pools = [pools(slots, g, kv) for _ in range(LAYERS)]
    # [layers, slots, kv_heads, row] as KVStorage holds them (row: DIM, or DIM + 4 for the int8 format)
    k_buf, v_buf = (torch.stack([p[i] for p in layer_pools]).view(LAYERS, slots, KV_HEADS, -1) for i in (0, 1))
    shared_index = torch.arange(prefix)
    packs = functools.cache(lambda k: [k.pack_prefix(k_buf[i].view(slots, -1), v_buf[i].view(slots, -1), shared_index,
                                                     KV_HEADS, DIM) for i in range(LAYERS)])
    kv_index = own_table(batch, prefix, length)
    if rows == "shared":
        kv_index = torch.cat([shared_index.expand(batch, prefix), kv_index], 1)
    lengths, new_slots, cos, sin, x = step_inputs(kv_index, g, act)
    built: dict[int, Any] = {}

    def run(k: ModuleType) -> None:
        if id(k) not in built:  # each build's own stack over the same packed weights
            stack = decode_stack(k, weights, norms)
            groups = [k.SharedGroup(0, batch, shared_index, torch.full((batch,), prefix, dtype=torch.int64),
                                    [list(p) for p in packs(k)])] if grouped else []
            built[id(k)] = (stack, groups)
        stack, groups = built[id(k)]
        stack.run(x.clone(), cos, sin, new_slots, kv_index, lengths, k_buf, v_buf, groups)

    return run


def small_ops_case(rows: int, g: torch.Generator) -> Case:
    """The element-wise kernels of 30 layers at ``rows`` rows of SmolLM2's widths: two RMSNorms, one SiLU·mul."""
    x = torch.randn(rows, 576, generator=g)
    weight = torch.randn(576, generator=g)
    gate_up = torch.randn(rows, 3072, generator=g)

    def run(k: ModuleType) -> None:
        for _ in range(LAYERS):
            k.rms_norm(x, weight, 1e-5)
            k.rms_norm(x, weight, 1e-5)
            k.silu_mul(gate_up)

    return run


def argmax_case(g: torch.Generator) -> Case:
    """The sampler's greedy pick with each build: its argmax_rows, or torch.max where the build has none."""
    logits = torch.randn(8, VOCAB, generator=g)

    def run(k: ModuleType) -> Any:
        kernel = getattr(k, "argmax_rows", None)
        return kernel(logits) if kernel is not None else torch.max(logits, dim=-1).indices

    return run


def cases(k_this: ModuleType, g: torch.Generator) -> dict[str, Case]:
    out = {
        "decode attention, batch 1, 30 layers from memory": decode_case(1, LAYERS, 1, g),
        "decode attention, batch 8, 30 layers from memory": decode_case(8, LAYERS, 1, g),
        "decode attention, batch 1, one layer x30 in cache": decode_case(1, 1, LAYERS, g),
        "decode attention over an int8 pool, batch 1, 30 layers from memory": decode_case(1, LAYERS, 1, g, "int8"),
        "decode attention over an int8 pool, batch 8, 30 layers from memory": decode_case(8, LAYERS, 1, g, "int8"),
        "decode attention over an int8 pool, batch 8, one layer x30 in cache": decode_case(8, 1, LAYERS, g, "int8"),
        "decode attention over a float32 pool, batch 1, 30 layers from memory": decode_case(1, LAYERS, 1, g, "float32"),
        "decode attention over a float32 pool, batch 8, 30 layers from memory": decode_case(8, LAYERS, 1, g, "float32"),
        "decode attention over a float32 pool, batch 1, one layer x30 in cache":
            decode_case(1, 1, LAYERS, g, "float32"),
    }
    for fmt, pool in (("float32", "a float32 pool"), ("int8", "an int8 pool")):  # a few-shot batch, no group
        out[f"decode attention over {pool}, batch 8 under a 1,050-slot shared prefix, 30 layers"] = decode_case(
            8, LAYERS, 1, g, fmt, shared=1050)
    for rows in (8, 160):  # 160: 7 few-shot questions prefilled after their shared block
        out[f"cascade merge, {rows} rows, 30 layers"] = merge_case(rows, g)
    if k_this.bf16_dot():
        for rows in (1, 4, 8, 16):
            out[f"shared part, {rows} row(s) x 1,050 kept keys, 30 layers"] = shared_case(g, rows)
        for tokens, prefix in ((20, 1050), (170, 1050), (1024, 0)):  # a question alone, 7 of them, a cold chunk
            out[f"prefill chunk, {tokens} tokens over {prefix} cached, 30 layers"] = chunk_case(tokens, prefix, g)
        for rows in (1, 8):
            out[f"shared part over an int8 pool, {rows} row(s) x 1,050 kept keys, 30 layers"] = shared_case(
                g, rows, "int8")
        for tokens, prefix in ((20, 1050), (170, 1050), (1024, 0)):
            out[f"prefill chunk over an int8 pool, {tokens} tokens over {prefix} cached, 30 layers"] = chunk_case(
                tokens, prefix, g, "int8")
        for rows in (1, 2, 4, 8, 16):
            out[f"bf16 linear layers, {rows} row(s)"] = linear_case("bfloat16", rows, g)
    for rows in (1, 8):  # the portable kernel (fp32 weights k-major): an AVX2 host's default format
        out[f"fp32 linear layers, {rows} row(s)"] = linear_case("float32", rows, g)
    if k_this.int8_dot():
        for rows in (1, 8, 169):  # 169: a few-shot step's prefill rows, where the products are compute-bound
            out[f"int8 linear layers, {rows} row(s)"] = linear_case("int8", rows, g)
    if k_this.bf16_dot():
        out["decode stack, batch 1 under a 1,050-key shared block, bf16 weights"] = stack_case("bfloat16", g, 1)
        out["decode stack, batch 8 under a 1,050-key shared block, bf16 weights"] = stack_case("bfloat16", g)
        if k_this.int8_vnni():
            out["decode stack, batch 8 under a 1,050-key shared block, int8 weights"] = stack_case("int8", g)
            out["decode stack, batch 8 under a 1,050-key shared block, int8 weights, int8 pool"] = stack_case(
                "int8", g, kv="int8")
            out["decode stack, batch 1 under a 1,050-key shared block, int8 weights, int8 pool"] = stack_case(
                "int8", g, 1, kv="int8")
    if not k_this.bf16_dot():  # no cascade groups: each row attends its 1,091 positions in the pool
        for batch in (1, 8):
            out[f"decode stack, batch {batch} over 1,091 own positions, fp32 weights, fp32 pool"] = stack_case(
                "float32", g, batch, kv="float32", rows="own")
            if k_this.int8_dot():
                out[f"decode stack, batch {batch} over 1,091 own positions, int8 weights, int8 pool"] = stack_case(
                    "int8", g, batch, kv="int8", rows="own")
        out["decode stack, batch 8 under a 1,050-slot shared prefix, no group, fp32 weights, fp32 pool"] = stack_case(
            "float32", g, kv="float32", rows="shared")
        if k_this.int8_dot():
            out["decode stack, batch 8 under a 1,050-slot shared prefix, no group, int8 weights, int8 pool"] = (
                stack_case("int8", g, kv="int8", rows="shared"))
    out["greedy argmax, 8 x 49,152 logits"] = argmax_case(g)
    for rows in (1, 8, 1024):
        out[f"RMSNorm x2 and SiLU·mul of 30 layers, {rows} row(s)"] = small_ops_case(rows, g)
    return out


@torch.inference_mode()
def measure(builds: dict[str, ModuleType], case: Case, rounds: int) -> dict[str, float] | str:
    """Each build's median time on ``case``. Under inference mode, as the model runs its forward: outside it every
    tensor the kernels make or view carries autograd's bookkeeping, which made the batch-8 decode stack 3-5% slower."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    try:
        for k in builds.values():  # warm-up, and a build that cannot run the case says so here
            case(k)
    except (AttributeError, TypeError, RuntimeError) as exc:
        return f"not comparable: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    order = list(builds)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            case(builds[name])
            times[name].append(time.perf_counter() - t)
    return {name: 1000 * statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision whose kernels are compared with this checkout's")
    ap.add_argument("--rounds", type=int, default=16, help="alternations per case (default 16)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    ap.add_argument("--only", default="", metavar="TEXT", help="run only the cases whose name contains TEXT")
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": kernels_at(a.base, Path(tmp)), "this": load_kernels("fastcpu")}
    g = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"cpu": cpu_simd(), "threads": a.threads, "base": a.base, "rounds": a.rounds}
    for name, case in cases(builds["this"], g).items():
        if a.only not in name:
            continue
        ms = measure(builds, case, a.rounds)
        result[name] = ms if isinstance(ms, str) else {"base_ms": round(ms["base"], 4), "this_ms": round(ms["this"], 4),
                                                        "this_vs_base": round(ms["this"] / ms["base"], 3)}
    emit(result, a.json)


if __name__ == "__main__":
    main()
