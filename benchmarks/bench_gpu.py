"""GPU throughput: decode tokens/s against the HBM-bandwidth roofline, prefill tokens/s, FlashInfer vs
torch_native, and Hugging Face transformers on the same GPU as the baseline. CUDA only (``--help`` works
anywhere).

What is measured, per model (default: SmolLM2-135M-Instruct and ``random:llama3-8b``, bf16):

1. **decode, model step** — ``ModelRunner`` alone: ``B`` requests of ``--ctx`` tokens of KV decode
   ``--steps`` steps (CUDA graph replay when it fits, lm_head, on-device argmax); no scheduler. Against
   the roofline ``B / (bytes per step / bandwidth)``, bytes per step = every weight once + the KV of all
   ``B`` requests (K and V, every layer). Bandwidth: the device's datasheet figure from the table below
   (``--bandwidth`` overrides) and a measured device-to-device copy, both printed.
2. **decode, engine** — the in-process ``Engine`` end to end (scheduler, overlap, sampling, stop checks):
   ``B`` prompts of ``--ctx`` tokens, ``--engine-new`` greedy tokens each with ``ignore_eos``; decode
   tokens/s = ``B * (new - 1) / (total time - time to first token of the batch)``.
3. **prefill** — one forward over ``--prefill-batch`` prompts of ``--prefill-len`` tokens (no cache hit).
4. **flashinfer vs torch_native** — (1) and (3) with ``--attention-backend torch_native`` (no graphs:
   it cannot be captured), plus one attention layer alone over a decode batch.
5. **transformers** — ``AutoModelForCausalLM.generate`` (bf16, greedy, dynamic cache) on the same prompts:
   decode tokens/s = ``B * (new - 1) / (t(new) - t(1))``.

Usage (on the GPU machine, after ``pip install -e '.[serve,gpu]'``)::

    python benchmarks/bench_gpu.py --out bench_gpu.json          # everything, ~10-20 min with JIT
    python benchmarks/bench_gpu.py --models default --batches 1,16 --skip-hf --skip-torch-native  # quick

Timings: CUDA events / synchronised host clocks after warm-up; every KV value random (never zeros).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

HBM_BANDWIDTH = {  # bytes/s, datasheet; matched against torch.cuda.get_device_name() in this order
    "GH200": 4.0e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    "H200": 4.8e12,
    "H20": 4.0e12,
    "B200": 8.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10G": 0.6e12,
    "A10": 0.6e12,
    "RTX 4090": 1.008e12,
}


def datasheet_bandwidth(name: str) -> float | None:
    for key, bw in HBM_BANDWIDTH.items():
        if key in name:
            return bw
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,random:llama3-8b", help="comma-separated --model values")
    p.add_argument("--batches", default="1,16,64,256", help="decode batch sizes")
    p.add_argument("--ctx", type=int, default=512, help="KV tokens per request when decoding starts")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps (model-step benchmark)")
    p.add_argument("--engine-new", type=int, default=128, help="new tokens per request (engine benchmark)")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--bandwidth", type=float, default=None, help="HBM bytes/s (default: datasheet table)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--skip-torch-native", action="store_true", help="skip the torch_native comparison")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- helpers (CUDA)
def measured_copy_bandwidth(torch: Any) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 10)."""
    n = 1 << 29  # 512 Mi bf16 elements = 1 GiB
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n * 2 / statistics.median(times[2:])


def make_runner(model: str, backend: str, max_bs: int) -> Any:
    from runtime.config import ServerArgs
    from runtime.executor.model_runner import ModelRunner

    args = ServerArgs(model=model, device="cuda", dtype="bfloat16", attention_backend=backend,
                      max_running_requests=max(max_bs, 1), cuda_graph_max_bs=max_bs, log_level="warning",
                      disable_cuda_graph=backend != "flashinfer").resolve()
    runner = ModelRunner(args)
    runner.kv.k_buffer.normal_()  # never time on zeros
    runner.kv.v_buffer.normal_()
    return runner


def step_bytes(runner: Any, bs: int, kv_len: float) -> float:
    from runtime.models.random_model import weight_bytes

    w = weight_bytes(runner.hf_config, runner.args.torch_dtype)
    return w + bs * kv_len * runner.kv.shape.bytes_per_token


def runner_decode(torch: Any, runner: Any, bs: int, ctx: int, steps: int, warmup: int = 5) -> float:
    """Decode tokens/s of the model step alone (see the module docstring, 1)."""
    from runtime.core.forward_batch import build_forward_batch

    total = ctx + warmup + steps
    rows = [runner.req_to_token.alloc() for _ in range(bs)]
    slots = [runner.allocator.alloc(total) for _ in range(bs)]
    for r, s in zip(rows, slots):
        runner.req_to_token.write(r, 0, s)
    table = runner.req_to_token.table
    rows_t = torch.tensor(rows, device=runner.device)
    logit_rows = torch.arange(bs)
    ids = [[int(x)] for x in torch.randint(10, 30000, (bs,))]

    def step(i: int) -> Any:
        pre = ctx + i
        fb = build_forward_batch(ids, [pre] * bs, rows, table[rows_t, pre], runner.kv, table, runner.device)
        return runner.forward_device(fb, logit_rows).argmax(-1)

    try:
        for i in range(warmup):
            step(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            out = step(i)
        out.tolist()
        dt = time.perf_counter() - t0
    finally:
        for r, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_to_token.free(r)
    return bs * steps / dt


def runner_prefill(torch: Any, runner: Any, batch: int, length: int, reps: int = 5) -> float:
    from runtime.core.forward_batch import build_forward_batch

    rows = [runner.req_to_token.alloc() for _ in range(batch)]
    slots = [runner.allocator.alloc(length) for _ in range(batch)]
    for r, s in zip(rows, slots):
        runner.req_to_token.write(r, 0, s)
    ids = [torch.randint(10, 30000, (length,)).tolist() for _ in range(batch)]
    out_loc = torch.cat(slots)
    last = torch.arange(1, batch + 1) * length - 1
    times = []
    try:
        for _ in range(reps + 1):
            fb = build_forward_batch(ids, [0] * batch, rows, out_loc, runner.kv, runner.req_to_token.table,
                                     runner.device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.forward_device(fb, last).argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
    finally:
        for r, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_to_token.free(r)
    return batch * length / statistics.median(times[1:])


def attention_layer(torch: Any, runner: Any, bs: int, ctx: int, reps: int = 50) -> float:
    """Microseconds of one attention layer (plan excluded) over a decode batch of ``bs`` x ``ctx``."""
    from runtime.core.forward_batch import build_forward_batch

    rows = [runner.req_to_token.alloc() for _ in range(bs)]
    slots = [runner.allocator.alloc(ctx + 1) for _ in range(bs)]
    for r, s in zip(rows, slots):
        runner.req_to_token.write(r, 0, s)
    shape = runner.attn_backend.shape
    dt = runner.args.torch_dtype
    try:
        out_loc = torch.stack([s[ctx] for s in slots]).to(runner.device)
        fb = build_forward_batch([[1]] * bs, [ctx] * bs, rows, out_loc, runner.kv, runner.req_to_token.table,
                                 runner.device)
        runner.attn_backend.plan(fb)
        q = torch.randn(bs, shape.num_heads, shape.head_dim, device="cuda", dtype=dt)
        k = torch.randn(bs, shape.num_kv_heads, shape.head_dim, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        # as ModelRunner.forward calls it: a backend's scratch buffers are inference tensors, written in place
        with torch.inference_mode():
            for _ in range(3):
                runner.attn_backend.forward(q, k, v, 0, fb)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                runner.attn_backend.forward(q, k, v, 0, fb)
            b.record()
            b.synchronize()
        return a.elapsed_time(b) * 1e3 / reps
    finally:
        for r, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_to_token.free(r)


def engine_decode(model: str, bs: int, ctx: int, new: int) -> dict[str, float]:
    import torch

    from runtime.engine import Engine

    prompts = [torch.randint(10, 30000, (ctx,)).tolist() for _ in range(bs)]
    with Engine(model=model, device="cuda", max_running_requests=max(bs, 1), log_level="warning") as e:
        e.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": 4, "ignore_eos": True})  # warm-up
        e.flush_cache()
        t0 = time.perf_counter()
        e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0})
        ttft = time.perf_counter() - t0
        e.flush_cache()
        t0 = time.perf_counter()
        e.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0,
                                                       "ignore_eos": True})
        total = time.perf_counter() - t0
    return {"ttft_s": ttft, "total_s": total, "decode_tok_s": bs * (new - 1) / max(total - ttft, 1e-9)}


def hf_decode(torch: Any, model: str, bs: int, ctx: int, new: int) -> float:
    from transformers import AutoModelForCausalLM

    from runtime.models.folders import is_random_model, resolve_model_path
    from runtime.models.random_model import random_model_config

    if is_random_model(model):
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(random_model_config(model), dtype=torch.bfloat16)
    else:
        hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.bfloat16).cuda()
    hf.eval()
    ids = torch.randint(10, 30000, (bs, ctx), device="cuda")
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(2)
    t1, tn = gen(1), gen(new)
    return bs * (new - 1) / max(tn - t1, 1e-9)


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    name = torch.cuda.get_device_name()
    measured = measured_copy_bandwidth(torch)
    bw = args.bandwidth or datasheet_bandwidth(name) or measured
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {"device": name, "datasheet_bw": datasheet_bandwidth(name), "measured_copy_bw": measured,
                               "roofline_bw": bw, "ctx": args.ctx, "models": {}}
    print(f"device: {name}; roofline bandwidth {bw / 1e12:.2f} TB/s (measured copy {measured / 1e12:.2f} TB/s)")
    backends = ["flashinfer"] + ([] if args.skip_torch_native else ["torch_native"])
    for model in args.models.split(","):
        res: dict[str, Any] = {"decode": {}, "prefill_tok_s": {}, "attention_us": {}}
        for backend in backends:
            runner = make_runner(model, backend, max(batches))
            if runner.graph_runner is not None:
                res["graph_capture_s"] = runner.graph_runner.capture_seconds
            kv_len = args.ctx + 5 + args.steps / 2
            for bs in batches:
                tps = runner_decode(torch, runner, bs, args.ctx, args.steps)
                roof = bs / (step_bytes(runner, bs, kv_len) / bw)
                res["decode"].setdefault(str(bs), {})[backend] = {"tok_s": tps, "roofline_tok_s": roof,
                                                                  "fraction": tps / roof}
                print(f"{model:>20} {backend:>12} decode bs={bs:<4} {tps:12.0f} tok/s  "
                      f"roofline {roof:12.0f}  ({100 * tps / roof:5.1f}%)")
            res["prefill_tok_s"][backend] = runner_prefill(torch, runner, args.prefill_batch, args.prefill_len)
            res["attention_us"][backend] = {str(bs): attention_layer(torch, runner, bs, 1024) for bs in batches}
            print(f"{model:>20} {backend:>12} prefill {res['prefill_tok_s'][backend]:12.0f} tok/s; attention "
                  f"layer us: {res['attention_us'][backend]}")
            del runner
            gc.collect()
            torch.cuda.empty_cache()
        if not args.skip_engine:
            # each Engine gives its memory back when it stops (Engine.shutdown), so the next one gets all of it
            res["engine"] = {str(bs): engine_decode(model, bs, args.ctx, args.engine_new) for bs in batches}
            for bs, r in res["engine"].items():
                print(f"{model:>20}       engine decode bs={bs:<4} {r['decode_tok_s']:12.0f} tok/s")
        if not args.skip_hf:
            res["transformers_decode_tok_s"] = {}
            for bs in batches:
                try:
                    res["transformers_decode_tok_s"][str(bs)] = hf_decode(torch, model, bs, args.ctx, 33)
                except torch.cuda.OutOfMemoryError:
                    res["transformers_decode_tok_s"][str(bs)] = None
                gc.collect()
                torch.cuda.empty_cache()
            print(f"{model:>20} transformers decode tok/s: {res['transformers_decode_tok_s']}")
        results["models"][model] = res
    print_summary(results, batches)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


def print_summary(results: dict[str, Any], batches: list[int]) -> None:
    print("\nsummary (decode tok/s, model step; % of roofline; flashinfer / torch_native; engine; transformers)")
    for model, res in results["models"].items():
        for bs in map(str, batches):
            d = res["decode"].get(bs, {})
            fi, tn = d.get("flashinfer", {}), d.get("torch_native", {})
            ratio = fi.get("tok_s", 0) / tn["tok_s"] if tn.get("tok_s") else float("nan")
            eng = res.get("engine", {}).get(bs, {}).get("decode_tok_s")
            hf = res.get("transformers_decode_tok_s", {}).get(bs)
            print(f"{model:>20} bs={bs:<4} {fi.get('tok_s', 0):10.0f} {100 * fi.get('fraction', 0):5.1f}%  "
                  f"x{ratio:5.2f}  engine {eng or 0:10.0f}  hf {hf or 0:10.0f}")


if __name__ == "__main__":
    main()
