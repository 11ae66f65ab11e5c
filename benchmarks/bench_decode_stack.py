"""The native decode stack against the layer-by-layer path, on one Engine per weight format.

Decode steps at batch 1 and 8 over ~1k-token contexts, and at batch 8 under one shared block of all but the last
50 tokens (one cascade group), as whole scheduler steps (median), with the model's ``decode_stack`` in place and
set aside, alternated ``--rounds`` times so both see the same moments of the host; the greedy tokens of both must be
the same (the stack promises the layer-by-layer bits).

    python benchmarks/bench_decode_stack.py [--formats float32 bfloat16 int8] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
from functools import partial
from typing import Any

from bench_cpu_forward import FORMATS
from engine_steps import cpu_simd, decode_step_ms, emit

from runtime.engine import Engine


def measure(fmt: str, context: int, rounds: int) -> dict[str, Any]:
    eng = Engine(model="default", max_total_tokens=10 * (context + 64) + 2048, log_level="warning", **FORMATS[fmt])
    rng = random.Random(0)
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = {f"b{b}": [[rng.randrange(3, 49000) for _ in range(context)] for _ in range(b)] for b in (1, 8)}
    # eight requests under one cached block (a few-shot batch): their decode rows form one cascade group
    block = [rng.randrange(3, 49000) for _ in range(context - 50)]
    prompts["b8_shared"] = [block + [rng.randrange(3, 49000) for _ in range(50)] for _ in range(8)]
    times: dict[str, list[float]] = {}
    tokens: dict[str, Any] = {}
    try:
        stack = eng.inspect(lambda s: s.runner.model.decode_stack)
        if stack is None:
            return {"decode_stack": False}

        def use(obj: Any) -> None:
            eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", obj))

        for _ in range(rounds):
            for name, obj in (("stack", stack), ("layers", None)):
                use(obj)
                for case, ps in prompts.items():
                    eng.flush_cache()
                    ms, outs = decode_step_ms(eng, len(ps), partial(eng.generate, input_ids=ps, sampling_params=sp))
                    times.setdefault(f"{name}_{case}_ms", []).append(ms)
                    tokens.setdefault(name, []).append([o["output_ids"] for o in outs])
    finally:
        eng.shutdown()
    out: dict[str, Any] = {"decode_stack": True, "same_tokens": tokens["stack"] == tokens["layers"]}
    for key, values in times.items():
        out[key] = statistics.median(values)
        out[key.replace("_ms", "_all_ms")] = [round(v, 2) for v in values]
    for case in prompts:
        out[f"speedup_{case}"] = out[f"layers_{case}_ms"] / out[f"stack_{case}_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    result: dict[str, Any] = {"cpu": cpu_simd(), "context": a.context, "rounds": a.rounds, "formats": {}}
    for fmt in a.formats:
        result["formats"][fmt] = measure(fmt, a.context, a.rounds)
    emit(result, a.json)


if __name__ == "__main__":
    main()
