"""The CPU forward pass against its floor and against transformers, per weight format, in one run.

For float32, bfloat16 and int8 (weight-only) weights, the latter two also over the int8 KV cache (``+kv8``), on
the default model:

- the weight-streaming floor of a decode step (bytes of weights read / streaming bandwidth measured now);
- decode step ms at batch 1, 8 and 32 over ~1k-token contexts (whole scheduler steps) and the ratio to
  the floor; at batch 1 and 8 where the step goes: linear layers, attention, everything else (Python, small
  ops), the latter layer by layer and with the native decode stack;
- prefill tokens/s of one 1,024-token prompt.

Then transformers (fp32, the same weights): one padded batch of 32 decoding over the same contexts
(ms/step) and a 1,024-token prefill.

Threads: everything that runs torch before the Engines (the bandwidth probe, the Engine's model load) runs on
a short-lived thread. libgomp gives every thread that starts a parallel region its own team, and once more
of its threads exist than cores it stops spinning between regions (each wakes by futex): a team left on the
main thread next to the scheduler thread's made every decode step ~2x slower. A thread's team ends with it,
so the scheduler thread's team is the only one, as in the server's scheduler process.

    python benchmarks/bench_cpu_forward.py [--context 1000] [--formats float32 bfloat16 int8 int8+kv8 ...]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from engine_steps import cpu_simd, decode_step_ms, emit

from runtime.bench.floor import stream_bandwidth, weight_bytes, weight_floor
from runtime.bench.quality import FORMATS
from runtime.config import cpu_has_native_bf16
from runtime.engine import Engine
from runtime.models.folders import resolve_model_path

T = TypeVar("T")



class Timers:
    """Wraps the model's linear ops and attention forward with accumulating timers (a profiling pass); only
    calls of ``rows`` rows count, i.e. the decode steps of that batch size (a prefill's rows come many at a
    time, and the ramp-up and tail steps of a batch have fewer rows)."""

    def __init__(self, model: Any, rows: int):
        self.rows = rows
        self.totals = {"linear": 0.0, "attention": 0.0}
        self.attention_calls = 0
        self.layers = model.arch.num_layers
        self.undo: list[Callable[[], None]] = []
        for name in ("linear", "add_linear_"):
            self._wrap(model.ops, name, "linear")
        self._wrap(model.attn_backend, "forward", "attention")

    def _wrap(self, obj: Any, name: str, bucket: str) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            rows = a[0].shape[0] if bucket == "attention" else a[1 if name == "add_linear_" else 0].shape[0]
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                if rows == self.rows:
                    self.totals[bucket] += time.perf_counter() - t
                    self.attention_calls += bucket == "attention"

        setattr(obj, name, timed)
        self.undo.append(lambda: delattr(obj, name))

    def close(self) -> None:
        for u in self.undo:
            u()


def on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that exits afterwards, taking its OpenMP team with it (module docstring)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            box.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def measure_format(fmt: str, context: int, batches: list[int]) -> dict[str, Any]:
    eng = on_own_thread(lambda: Engine(model="default", max_total_tokens=34 * (context + 64) + 2048,
                                       log_level="warning", **FORMATS[fmt]))
    model = eng.scheduler.runner.model
    rng = random.Random(0)
    out: dict[str, Any] = {"weight_bytes": weight_bytes(model)}
    try:
        prompt = [rng.randrange(3, 49000) for _ in range(1024)]
        eng.generate(input_ids=prompt[:64], sampling_params={"max_new_tokens": 2})  # warm-up
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
        out["prefill_tok_s"] = 1024 / (time.perf_counter() - t0)
        sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        for b in batches:
            eng.flush_cache()
            prompts = [[rng.randrange(3, 49000) for _ in range(context)] for _ in range(b)]
            # long enough that the first admitted requests still decode once the last prompt is in
            spb = {**sp, "max_new_tokens": 16 + b * context // 1024}
            ms, _ = decode_step_ms(eng, b, lambda ps=prompts, spb=spb: eng.generate(input_ids=ps, sampling_params=spb))
            out[f"decode_b{b}_ms"] = ms
        # where a batch-1 and a batch-8 step go (separate passes: the timers cost a little themselves). The timers
        # wrap the Python calls of the layer-by-layer path, so the native decode stack is set aside for them:
        # "other" is what that path spends besides the kernels, "other_stack" what is left of it with the stack
        # (the step measured above less the same kernels' time).
        stack = eng.inspect(lambda s: s.runner.model.decode_stack)
        for b in [b for b in batches if b <= 8]:
            eng.flush_cache()
            prompts = [[rng.randrange(3, 49000) for _ in range(context)] for _ in range(b)]
            eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", None))
            timers = eng.inspect(lambda s, b=b: Timers(s.runner.model, b))
            ms, _ = decode_step_ms(eng, b, lambda ps=prompts: eng.generate(input_ids=ps, sampling_params={
                **sp, "max_new_tokens": 24}))
            eng.inspect(lambda s, t=timers: t.close())
            eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", stack))
            forwards = timers.attention_calls / timers.layers
            per_step = {k: 1e3 * v / forwards for k, v in timers.totals.items()}
            kernels = sum(per_step.values())
            out[f"b{b}_breakdown_ms"] = {**per_step, "other": max(0.0, ms - kernels), "step": ms,
                                         "decode_stack": stack is not None,
                                         "other_stack": max(0.0, out[f"decode_b{b}_ms"] - kernels)}
    finally:
        eng.shutdown()
    return out


def measure_transformers(context: int, batch: int, steps: int = 8) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("default"), dtype=torch.float32).eval()
    rng = random.Random(1)
    out: dict[str, float] = {}
    with torch.inference_mode():
        ids = torch.tensor([[rng.randrange(3, 49000) for _ in range(1024)]])
        model(ids[:, :64])
        t0 = time.perf_counter()
        model(ids)
        out["prefill_tok_s"] = 1024 / (time.perf_counter() - t0)
        ids = torch.tensor([[rng.randrange(3, 49000) for _ in range(context)] for _ in range(batch)])
        res = model(ids, use_cache=True)
        past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            res = model(nxt, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t)
            past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
        out[f"decode_b{batch}_ms"] = 1e3 * statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    # probed before each format and at the end; every floor uses the fastest reading (runtime/bench/floor.py)
    probes: list[float] = []
    result: dict[str, Any] = {"cpu": cpu_simd(), "native_bf16": cpu_has_native_bf16(),
                              "threads": torch.get_num_threads(), "context": a.context, "formats": {}}
    for fmt in a.formats:
        probes.append(on_own_thread(stream_bandwidth))
        result["formats"][fmt] = measure_format(fmt, a.context, a.batches)
    probes.append(on_own_thread(stream_bandwidth))
    result["stream_gb_s"], result["stream_probes_gb_s"] = max(probes) / 1e9, [round(p / 1e9, 1) for p in probes]
    for r in result["formats"].values():
        floor = weight_floor(r.pop("weight_bytes"), probes)
        r["weight_mb"], r["floor_ms"] = floor["weight_mb"], floor["floor_ms"]
        for b in a.batches:
            r[f"decode_b{b}_over_floor"] = r[f"decode_b{b}_ms"] / r["floor_ms"]
    if not a.no_transformers:
        hf = measure_transformers(a.context, max(a.batches))
        result["transformers"] = hf
        for r in result["formats"].values():
            b = max(a.batches)
            r[f"vs_transformers_decode_b{b}"] = hf[f"decode_b{b}_ms"] / r[f"decode_b{b}_ms"]
            r["vs_transformers_prefill"] = r["prefill_tok_s"] / hf["prefill_tok_s"]
    emit(result, a.json)


if __name__ == "__main__":
    main()
