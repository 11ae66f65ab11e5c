"""What a saved comparison run's arithmetic takes at the CPU's instruction roof, against the time it took.

A batch-8 decode step is compared with its weight-streaming floor (``radixserve bench profile``); a whole served
run has no such floor, because most of its steps are bound by arithmetic. This counts the multiply-adds the
radixserve server had to do for the requests of a ``radixserve bench compare`` output folder (its
``records.jsonl``: per request the prompt tokens, the cached ones the server did not compute, the output tokens)
and divides them by the roof of the instruction that does them, measured now with ``bench_compute_peak.py``'s
probe on ``--threads`` threads (the best of several):

- the linear layers of every computed prompt token and every decode row (an output token but the last is fed
  back), at the ``vpdpbusd`` roof for ``--format int8`` and the ``vdpbf16ps`` roof for ``bfloat16``;
- the output projection, one row per output token (a prompt's last position gives the first), at the same roof;
- attention, scores and weighted values, for every query position over the positions up to it (cached ones
  included), at the ``vdpbf16ps`` roof (the CPU kernels score bf16 and int8 pools in bf16 dot products).

Norms, RoPE, the softmax's exponentials, the KV store, sampling and everything outside the forward count for
nothing, and the reading of weights is assumed to hide under the arithmetic, so the time at the roof is a bound
no implementation on this CPU can beat, not an estimate. The report gives the run's wall time as a multiple of
it, and, where the folder holds a llama.cpp run of the same workload, the multiple a given ratio (``--ratio``,
the issue's 10x) would allow. The folder's last comparison is used (a folder reused by several comparisons
keeps every run's records).

    python benchmarks/bench_run_roof.py OUT_DIR [--workload fewshot] [--format int8] [--threads 2] [--ratio 10]
        [--json out.json]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_compute_peak import KINDS, probe_module, roof_macs
from engine_steps import cpu_simd, emit

from runtime.bench.report import load_results
from runtime.models.folders import resolve_model_path
from runtime.models.llama import LlamaForCausalLM
from runtime.models.loader import load_config


@dataclass(frozen=True)
class Shapes:
    """Multiply-adds of one token through the model, by kind."""

    linear: int  # every decoder layer's qkv, o, gate/up and down
    head: int  # the output projection
    attention_per_key: int  # scores and weighted values of one query position against one key, all layers

    @classmethod
    def of_model(cls, model: str) -> Shapes:
        arch = LlamaForCausalLM.arch_from_config(load_config(resolve_model_path(model)))
        h, d = arch.hidden_size, arch.head_dim
        q, kv, inter = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
        return cls(arch.num_layers * per_layer, h * arch.vocab_size, arch.num_layers * arch.num_heads * d * 2)


def positions_sum(start: int, stop: int) -> int:
    """Keys attended by query positions start .. stop - 1 (position p attends p + 1 keys)."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


def run_macs(records: list[dict[str, Any]], shapes: Shapes) -> dict[str, int]:
    """Multiply-adds by kind for a run's requests (each with prompt_tokens, cached_tokens, output_tokens)."""
    linear = head = attention = 0
    for r in records:
        prompt, cached, out = r["prompt_tokens"], r["cached_tokens"] or 0, r["output_tokens"]
        fed_back = max(out - 1, 0)
        linear += (prompt - cached + fed_back) * shapes.linear
        head += out * shapes.head
        attention += (positions_sum(cached, prompt) + positions_sum(prompt, prompt + fed_back)) * \
            shapes.attention_per_key
    return {"linear": linear, "head": head, "attention": attention}


def last_runs(folder: Path, workload: str) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each system's result for ``workload`` in the folder's last comparison (what its report shows), and the
    records of radixserve's run of it (records.jsonl keeps every comparison's: the last ones are this run's)."""
    summary, every_record = load_results(folder)
    results = {r["system"]: r for r in summary["results"] if r["workload"] == workload}
    if "radixserve" not in results:
        raise SystemExit(f"{folder} holds no radixserve run of {workload!r}")
    ours = [r for r in every_record if r["system"] == "radixserve" and r["workload"] == workload]
    records = ours[-results["radixserve"]["requests"]:]
    if any(r.get("error") or r.get("cached_tokens") is None for r in records):
        raise SystemExit("radixserve's last run has failed requests or no cached-token counts")
    return results, records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="A `radixserve bench compare --out` folder.")
    ap.add_argument("--workload", default="fewshot", help="The workload to count.")
    ap.add_argument("--format", choices=["int8", "bfloat16"], default="int8",
                    help="The weight format the server ran (its linears' instruction).")
    ap.add_argument("--model", default="default", help="The model the server ran (its shapes).")
    ap.add_argument("--threads", type=int, default=2, help="Threads of the roof probe (the server's).")
    ap.add_argument("--ratio", type=float, default=10.0, help="The ratio to llama.cpp's server to size against.")
    ap.add_argument("--json", help="Also save the result here.")
    args = ap.parse_args()
    results, records = last_runs(args.folder, args.workload)
    macs = run_macs(records, Shapes.of_model(args.model))
    probe = probe_module()
    linear_kind = KINDS[args.format]
    roof = {kind: roof_macs(probe, kind, args.threads) for kind in (linear_kind, "vdpbf16ps")}
    seconds = {"linear": macs["linear"] / roof[linear_kind], "head": macs["head"] / roof[linear_kind],
               "attention": macs["attention"] / roof["vdpbf16ps"]}
    at_roof = sum(seconds.values())
    ours = results["radixserve"]
    out: dict[str, Any] = {
        "cpu": cpu_simd(), "threads": args.threads, "workload": args.workload, "format": args.format,
        "requests": len(records),
        "computed_prompt_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in records),
        "output_tokens": sum(r["output_tokens"] for r in records),
        "g_mac": {k: round(v / 1e9, 1) for k, v in macs.items()},
        "roof_g_mac_s": {k: round(v / 1e9, 1) for k, v in roof.items()},
        "seconds_at_roof": {k: round(v, 3) for k, v in seconds.items()} | {"total": round(at_roof, 3)},
        "seq_s_at_roof": round(ours["sequences"] / at_roof, 2),
        "radixserve": {"wall_s": round(ours["wall_s"], 3), "seq_s": round(ours["sequences_per_s"], 3),
                       "wall_over_roof": round(ours["wall_s"] / at_roof, 2)},
    }
    peer = results.get("llamacpp")
    if peer:
        allowed = ours["sequences"] / (args.ratio * peer["sequences_per_s"])
        out["llamacpp"] = {"seq_s": round(peer["sequences_per_s"], 3),
                           "ratio": round(ours["sequences_per_s"] / peer["sequences_per_s"], 2),
                           f"wall_s_for_{args.ratio:g}x": round(allowed, 3),
                           f"wall_over_roof_for_{args.ratio:g}x": round(allowed / at_roof, 2)}
    emit(out, args.json)


if __name__ == "__main__":
    main()
