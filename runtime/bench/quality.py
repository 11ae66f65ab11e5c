"""``radixserve bench quality``: what a faster weight format costs in output quality, against float32.

For each format (bfloat16 weights, int8 weight-only quantization, either with the int8 KV cache) the same prompts
run greedily through an in-process Engine and are compared with float32's answers:

- **greedy agreement**: the share of prompts whose whole continuation equals float32's, and the mean share
  of tokens that agree before the first difference;
- **perplexity** of a fixed text shipped with the package (``data/quality_text.txt``, ~900 tokens), from the
  model's own prompt logprobs, and its relative change from float32.

Prompts come from the built-in workloads (few-shot questions, chat turns, story prompts, agent tasks), so
the check covers the text the benchmarks serve. Targets (docs/benchmarks.md): perplexity within 1% of
float32 for bfloat16 and within 3% for int8.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.bench.workloads import make
from runtime.models.tokenizer import tokenize

TEXT = Path(__file__).parent / "data" / "quality_text.txt"
FORMATS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
           "int8": {"quantization": "int8"},  # as --quantization int8 alone: activations and KV in the default dtype
           # the same with the KV cache in the int8 format (--kv-cache-dtype int8); targets as their weights'
           "bfloat16+kv8": {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
           "int8+kv8": {"quantization": "int8", "kv_cache_dtype": "int8"}}


@dataclass
class FormatQuality:
    name: str
    prompts: int
    identical: float  # share of prompts with float32's exact continuation
    agreeing_tokens: float  # mean share of tokens equal before the first difference
    perplexity: float
    perplexity_change: float  # relative to float32 (0.01 = 1% higher)


def quality_prompts(tokenizer: Any, count: int) -> list[str]:
    """``count`` prompts drawn round-robin from the four built-in workloads (chat ones rendered with the
    model's chat template)."""
    pools: list[list[str]] = []
    fs = make("fewshot", questions=count, examples=2)
    pools.append([r["body"]["prompt"] for r in fs["requests"]])
    for name in ("multiturn", "agent"):
        wl = make(name)
        pools.append([tokenizer.apply_chat_template(s["messages"] + s["steps"][0]["append"], tokenize=False,
                                                    add_generation_prompt=True) for s in wl["sessions"]])
    par = make("parallel", prompts=count)
    pools.append([tokenizer.apply_chat_template(r["body"]["messages"], tokenize=False, add_generation_prompt=True)
                  for r in par["requests"]])
    out: list[str] = []
    i = 0
    while len(out) < count:
        pool = pools[i % len(pools)]
        if i // len(pools) < len(pool):
            out.append(pool[i // len(pools)])
        elif all(i // len(pools) >= len(p) for p in pools):
            break
        i += 1
    return out


def perplexity(engine: Any, text: str) -> float:
    ids = tokenize(engine.tokenizer, text)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    lps = [lp for lp, _tok, *_ in out["meta_info"]["input_token_logprobs"] if lp is not None]
    return math.exp(-sum(lps) / len(lps))


def greedy(engine: Any, prompts: list[str], new_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompts, {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "temperature": 0})
    return [o["output_ids"] for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    identical = sum(a == b for a, b in zip(ref, got)) / len(ref)
    prefix = []
    for a, b in zip(ref, got):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(same / max(1, len(a)))
    return identical, sum(prefix) / len(prefix)


def measure(model: str, formats: list[str], count: int = 64, new_tokens: int = 32,
            engine_args: dict[str, Any] | None = None) -> list[FormatQuality]:
    """float32 first (the reference), then each of ``formats``; one Engine at a time."""
    from runtime.engine import Engine

    text = TEXT.read_text()
    results: list[FormatQuality] = []
    ref: list[list[int]] = []
    ref_ppl = 0.0
    for name in ["float32", *[f for f in formats if f != "float32"]]:
        engine = Engine(model=model, log_level="warning", **FORMATS[name], **(engine_args or {}))
        try:
            prompts = quality_prompts(engine.tokenizer, count)
            outs = greedy(engine, prompts, new_tokens)
            ppl = perplexity(engine, text)
        finally:
            engine.shutdown()
        if name == "float32":
            ref, ref_ppl = outs, ppl
        identical, agreeing = agreement(ref, outs)
        results.append(FormatQuality(name, len(prompts), identical, agreeing, ppl, ppl / ref_ppl - 1))
    return results


def report(results: list[FormatQuality]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
