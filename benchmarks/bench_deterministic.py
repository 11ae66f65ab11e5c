"""What ``--enable-deterministic-inference`` costs: decode step at batch 1, 8 and 32 and prefill tokens/s,
default kernels vs batch-invariant ones (both float32), on the default model, one Engine after the other in
one run.

    python benchmarks/bench_deterministic.py [--context 1000] [--json det.json]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from engine_steps import cpu_simd, decode_step_ms, emit

from runtime.engine import Engine


def measure(deterministic: bool, context: int, batches: list[int], prefill_len: int) -> dict[str, Any]:
    # float32 both ways: the cost of invariance, not of a wider type
    eng = Engine(model="default", max_total_tokens=48 * (context + 80), log_level="warning", dtype="float32",
                 enable_deterministic_inference=deterministic)
    rng = random.Random(0)
    out: dict[str, Any] = {}
    try:
        # prefill: distinct prompts of prefill_len tokens, cache flushed, one request at a time
        prompt = [rng.randrange(3, 49000) for _ in range(prefill_len)]
        eng.generate(input_ids=prompt[:64], sampling_params={"max_new_tokens": 1})  # warm-up
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
        out["prefill_tok_s"] = prefill_len / (time.perf_counter() - t0)
        for b in batches:
            eng.flush_cache()
            prompts = [[rng.randrange(3, 49000) for _ in range(context)] for _ in range(b)]
            # long enough that the first admitted requests still decode once the last prompt is in
            sp = {"max_new_tokens": 12 + b * context // 1024, "temperature": 0, "ignore_eos": True}
            ms, _ = decode_step_ms(eng, b, lambda ps=prompts, sp=sp: eng.generate(input_ids=ps, sampling_params=sp))
            out[f"decode_b{b}_ms"] = ms
    finally:
        eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1000, help="tokens of context per decoding request")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    default = measure(False, a.context, a.batches, a.prefill_len)
    det = measure(True, a.context, a.batches, a.prefill_len)
    ratio = {k: (det[k] / default[k] if k.endswith("_ms") else default[k] / det[k]) for k in default}
    emit({"cpu": cpu_simd(), "threads": torch.get_num_threads(), "context": a.context, "default": default,
          "deterministic": det, "cost_x": ratio}, a.json)


if __name__ == "__main__":
    main()
