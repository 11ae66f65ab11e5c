"""Cost of constrained decoding: decode step time with a JSON-schema constraint vs without, and compile time.

1. Decode ms/step at batch 1 and 16 (default model, in-process Engine, greedy): the same prompts decode
   once unconstrained and once under a JSON schema whose long string field keeps every request decoding
   for the whole measurement. Only steps whose batch is exactly the requested size count; the figure is
   the median, so the first (prefill) step and the tail where requests finish are left out. The
   constrained step includes what the constraint adds: filling each row's token bitmask, applying it to
   the logits and advancing each matcher.
2. Grammar compile time for the first schema, for new schemas that differ only in their title (xgrammar
   reuses the compiled pieces), and for the same schema again (the cache), through the backend the
   scheduler uses (``GrammarBackend``), after its one-time tokenizer set-up (reported too).

Usage: python benchmarks/bench_grammar.py [--batches 1 16] [--steps 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from engine_steps import decode_step_ms, emit
from tqdm import tqdm

from runtime.constrained.grammar import GrammarBackend
from runtime.engine import Engine
from runtime.models.folders import load_tokenizer, resolve_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "biography": {"type": "string", "minLength": 400},
    },
    "required": ["name", "age", "biography"],
    "additionalProperties": False,
}
PEOPLE = ["a baker", "a pilot", "a violinist", "a farmer", "a chemist", "a sailor", "a judge", "a nurse",
          "a poet", "a miner", "a tailor", "a chef", "an architect", "a librarian", "a painter", "a diver"]


def prompt(i: int) -> str:
    who = PEOPLE[i % len(PEOPLE)]
    return (f"<|im_start|>user\nInvent {who} number {i} and describe them as JSON with a name, an age and a "
            f"long biography.<|im_end|>\n<|im_start|>assistant\n")


def decode_ms(engine: Engine, batch: int, steps: int, constrained: bool) -> float:
    params: dict = {"max_new_tokens": steps + 1, "temperature": 0, "ignore_eos": not constrained}
    if constrained:
        params["json_schema"] = json.dumps(SCHEMA)
    ms, outs = decode_step_ms(engine, batch, lambda: engine.generate([prompt(i) for i in range(batch)], params))
    if constrained:
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "length", "a request finished early"
    return ms


def compile_times(repeats: int = 4) -> dict[str, float]:
    path = resolve_model_path("default")
    tok = load_tokenizer(path)
    t0 = time.perf_counter()
    backend = GrammarBackend(tok, 49152, [0, 2])
    setup = time.perf_counter() - t0
    firsts, cached = [], []
    for r in range(repeats):
        schema = dict(SCHEMA, title=f"Person{r}")  # a new schema text each round: a cache miss
        text = json.dumps(schema)
        t0 = time.perf_counter()
        backend.compile_async("json_schema", text).result()
        firsts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        backend.compile_async("json_schema", text).result()
        cached.append(time.perf_counter() - t0)
    backend.shutdown()
    # xgrammar reuses compiled pieces across schemas, so only the very first compile pays in full.
    return {"tokenizer_setup_ms": 1000 * setup, "first_ms": 1000 * firsts[0],
            "new_similar_schema_ms": 1000 * statistics.median(firsts[1:]),
            "cached_ms": 1000 * statistics.median(cached)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=48, help="decode steps per measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(model="default", max_total_tokens=60_000, log_level="warning", num_threads=args.threads)
    engine.generate("warm up", {"max_new_tokens": 2, "json_schema": json.dumps(SCHEMA)})
    rows = {}
    for b in tqdm(args.batches, desc="decode with and without the schema"):
        # Alternate twice so slow drift of the machine hits both alike; keep the better of each.
        free = min(decode_ms(engine, b, args.steps, False) for _ in range(2))
        json_ms = min(decode_ms(engine, b, args.steps, True) for _ in range(2))
        rows[b] = {"unconstrained_ms": round(free, 1), "json_schema_ms": round(json_ms, 1),
                   "overhead_pct": round(100 * (json_ms / free - 1), 1),
                   "unconstrained_tok_s": round(b * 1000 / free, 1), "json_schema_tok_s": round(b * 1000 / json_ms, 1)}
    engine.shutdown()
    result = {"date": time.strftime("%Y-%m-%d"), "decode": rows,
              "compile": {k: round(v, 2) for k, v in compile_times().items()}}
    emit(result, args.json)


if __name__ == "__main__":
    main()
