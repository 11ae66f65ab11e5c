"""Engine vs Hugging Face transformers on one machine, in one run.

1. Throughput on the built-in few-shot workload (runtime/bench/workloads.py: one ~1,000-token block of
   examples + 64 questions, greedy, 16 new tokens): the in-process Engine gets all requests at once;
   transformers runs ``generate`` on each request in turn (no sharing) — the naive baseline.
2. Decode ms/step at batch 1, 8 and 32 over distinct 512-token prompts, for both. For the Engine this is
   the whole scheduler step (admission, batch building, forward, sampling, stop checks); for
   transformers one ``model(...)`` call with its KV cache.

Usage: python benchmarks/bench_engine.py [--quick] [--json out.json]
       (--quick: 16 few-shot questions and fewer decode steps)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from engine_steps import decode_step_ms, emit
from tqdm import tqdm

from runtime.bench.workloads import fewshot
from runtime.engine import Engine
from runtime.models.folders import resolve_model_path

EOS = (0, 2)


def hf_model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def fewshot_engine(engine: Engine, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, {"max_new_tokens": max_tokens, "temperature": 0})
    return time.perf_counter() - t0, sum(o["meta_info"]["completion_tokens"] for o in outs)


@torch.inference_mode()
def fewshot_hf(tok, model, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    produced = 0
    for p in tqdm(prompts, desc="transformers few-shot", unit="req"):
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=list(EOS), pad_token_id=2)
        produced += out.shape[1] - ids.shape[1]
    return time.perf_counter() - t0, produced


def decode_engine(engine: Engine, batch: int, ctx: int, steps: int) -> float:
    prompts = [[(1000 + 97 * b + i) % 49000 + 3 for i in range(ctx)] for b in range(batch)]
    params = {"max_new_tokens": steps + 1, "temperature": 0, "ignore_eos": True}
    return decode_step_ms(engine, batch, lambda: engine.generate(input_ids=prompts, sampling_params=params))[0]


@torch.inference_mode()
def decode_hf(model, batch: int, ctx: int, steps: int) -> float:
    ids = torch.tensor([[(1000 + 97 * b + i) % 49000 + 3 for i in range(ctx)] for b in range(batch)])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 questions, fewer decode steps")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    wl = fewshot(questions=16 if args.quick else 64)
    prompts = [r["body"]["prompt"] for r in wl["requests"]]
    max_tokens = wl["params"]["max_tokens"]
    steps = 8 if args.quick else 24
    path = resolve_model_path("default")

    engine = Engine(model="default", max_total_tokens=100_000, log_level="warning")
    engine.generate("warm up", {"max_new_tokens": 2})
    e_wall, e_tokens = fewshot_engine(engine, prompts, max_tokens)
    e_decode = {b: decode_engine(engine, b, args.ctx, steps) for b in tqdm(args.batches, desc="engine decode")}
    engine.shutdown()

    tok, model = hf_model(path)
    h_wall, h_tokens = fewshot_hf(tok, model, prompts, max_tokens)
    h_decode = {b: decode_hf(model, b, args.ctx, steps) for b in tqdm(args.batches, desc="transformers decode")}

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "fewshot_requests": len(prompts),
        "engine_wall_s": round(e_wall, 2), "engine_req_per_s": round(len(prompts) / e_wall, 3),
        "hf_wall_s": round(h_wall, 2), "hf_req_per_s": round(len(prompts) / h_wall, 3),
        "throughput_ratio": round(h_wall / e_wall, 1),
        "engine_tokens": e_tokens, "hf_tokens": h_tokens,
        "decode_ms": {b: {"engine": round(e_decode[b], 1), "hf": round(h_decode[b], 1),
                          "engine_tok_s": round(b * 1000 / e_decode[b], 1),
                          "hf_tok_s": round(b * 1000 / h_decode[b], 1)} for b in args.batches},
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
