"""What a quantised KV pool would cost in output quality: a study before building one.

A decode step over long distinct contexts reads every row's KV besides the weights: at batch 8 over ~1k tokens
that is 196 MB in bf16 against 135 MB of int8 weights, so no kernel can bring that step within 2x of the
weights' streaming floor while the pool holds bf16 (docs/benchmarks.md). A pool of 8-bit values would halve
that read. This script measures what each 8-bit encoding would do to the answers before any kernel reads one.

How: the model runs layer by layer (the native decode stack off) with the torch-native attention backend, and
each layer's new K and V are rounded the way a pool of the encoding would store them, before they are written
to the (unchanged) pool. Every later read of those tokens then sees the rounded values, as it would read them
back from a quantised pool. Encodings:

- ``fp8_e4m3`` / ``fp8_e5m2``: one float8 value per element, no scale (values past the format's range
  saturate);
- ``int8``: symmetric int8 with one fp32 scale per token and KV head (max|x| / 127 over the head's values).

Quality as ``radixserve bench quality`` measures it (runtime/bench/quality.py): greedy agreement with the
float32 model's unrounded answers over the same prompts, and perplexity of the shipped text.

    python benchmarks/bench_kv_quant_quality.py [--weights float32 bfloat16 int8] [--prompts 64]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from runtime.attention.torch_native import TorchNativeBackend
from runtime.bench import quality
from runtime.models.decode_stack import DecodeStack

Rounding = Callable[[torch.Tensor], torch.Tensor]


def float8(dtype: torch.dtype) -> Rounding:
    top = torch.finfo(dtype).max

    def rnd(x: torch.Tensor) -> torch.Tensor:
        return x.float().clamp(-top, top).to(dtype).to(x.dtype)

    return rnd


def int8_per_head(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return ((xf / scale).round().clamp(-127, 127) * scale).to(x.dtype)


ENCODINGS: dict[str, Rounding | None] = {"none": None, "fp8_e4m3": float8(torch.float8_e4m3fn),
                                         "fp8_e5m2": float8(torch.float8_e5m2), "int8": int8_per_head}


def run(weights: list[str], prompts: int, new_tokens: int) -> list[dict[str, Any]]:
    from runtime.engine import Engine

    current: list[Rounding | None] = [None]
    plain_forward = TorchNativeBackend.forward

    def rounded_forward(self: TorchNativeBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        layer_id: int, batch: Any) -> torch.Tensor:
        rnd = current[0]
        return plain_forward(self, q, k, v, layer_id, batch) if rnd is None else \
            plain_forward(self, q, rnd(k), rnd(v), layer_id, batch)

    TorchNativeBackend.forward = rounded_forward  # type: ignore[method-assign]
    DecodeStack.build = classmethod(lambda cls, model: None)  # type: ignore[method-assign,assignment]
    text = quality.TEXT.read_text()
    rows: list[dict[str, Any]] = []
    ref: list[list[int]] = []
    ref_ppl = 0.0
    runs = [("float32", "none")] + [(w, e) for w in weights for e in ENCODINGS if (w, e) != ("float32", "none")]
    for weight, encoding in runs:
        current[0] = ENCODINGS[encoding]
        engine = Engine(model="default", log_level="warning", attention_backend="torch_native",
                        **quality.FORMATS[weight])
        try:
            outs = quality.greedy(engine, quality.quality_prompts(engine.tokenizer, prompts), new_tokens)
            ppl = quality.perplexity(engine, text)
        finally:
            engine.shutdown()
        if not ref:
            ref, ref_ppl = outs, ppl
        identical, agreeing = quality.agreement(ref, outs)
        rows.append({"weights": weight, "kv": encoding, "identical": identical, "agreeing_tokens": agreeing,
                     "perplexity": ppl, "perplexity_change": ppl / ref_ppl - 1})
        print(f"{weight:9} KV {encoding:9} identical {identical:6.1%}  agreeing tokens {agreeing:6.1%}  "
              f"perplexity {ppl:.3f} ({ppl / ref_ppl - 1:+.2%})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", nargs="+", default=["float32", "bfloat16", "int8"], choices=list(quality.FORMATS),
                    help="weight formats, each run with every KV encoding (float32 with none is the reference)")
    ap.add_argument("--prompts", type=int, default=64, help="greedy prompts per run (default 64)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per greedy answer (default 32)")
    ap.add_argument("--json", help="also save the rows here")
    args = ap.parse_args()
    rows = run(args.weights, args.prompts, args.new_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
