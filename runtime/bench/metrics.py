"""From a run's records to its figures: throughput, TTFT and latency percentiles, errors, hit rate vs optimum,
and (for radixserve) what each memory tier served during the run."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from runtime.bench.client import RunResult
from runtime.bench.optimum import OptimumResult


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# what the per-tier report of a run holds: the growth of these cache.tiers figures over the run
TIER_FIGURES = ("hit_tokens", "bytes_written", "bytes_read", "loads", "load_seconds")


def _rate(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def summarize(run: RunResult, system: str, optimum: OptimumResult | None = None,
              prompt_mismatches: int | None = None) -> dict[str, Any]:
    """One summary line per (system, workload): what ``bench run`` prints and ``compare`` saves."""
    ok = [r for r in run.records if r.ok]
    errs = [r for r in run.records if not r.ok]
    methods: set[str] = set()
    out_tokens = 0
    for r in ok:
        if r.output_tokens is not None:
            out_tokens += r.output_tokens
            methods.add("usage")
        else:  # no usage block: one streamed chunk is about one token
            out_tokens += r.chunks
            methods.add("chunks")
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    lats = [r.latency for r in ok if r.latency is not None]
    sequences = sum(max(len(r.texts), 1) if r.n > 1 else 1 for r in ok)
    with_usage = [r for r in ok if r.prompt_tokens is not None]
    with_cached = [r for r in with_usage if r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in with_usage) if with_usage else None
    hit_rate = None
    if ok and len(with_cached) == len(ok):  # only when every answer reported its cached tokens
        hit_rate = _rate(sum(r.cached_tokens or 0 for r in with_cached), sum(r.prompt_tokens or 0 for r in with_cached))
    s: dict[str, Any] = {
        "system": system,
        "workload": run.workload,
        "params": run.params,
        "description": run.description,
        "target": run.target,
        "requests": len(run.records),
        "ok": len(ok),
        "errors": len(errs),
        "error_samples": [f"{r.id}: {r.error or 'no answer'}"[:300] for r in errs[:5]],
        "sequences": sequences,
        "short_choices": sum(1 for r in ok if r.n > 1 and len(r.texts) < r.n),
        "wall_s": run.wall_s,
        "requests_per_s": _rate(len(ok), run.wall_s),
        "sequences_per_s": _rate(sequences, run.wall_s),
        "output_tokens": out_tokens,
        "output_tokens_method": "+".join(sorted(methods)) or "none",
        "output_tok_per_s": _rate(out_tokens, run.wall_s),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else math.nan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "latency_mean_s": statistics.fmean(lats) if lats else math.nan,
        "latency_p50_s": percentile(lats, 50),
        "latency_p99_s": percentile(lats, 99),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens or 0 for r in with_cached) if with_cached else None,
        "hit_rate": hit_rate,
        "server_hit_rate": server_hit_rate(run),
        "server_tiers": server_tiers(run),
        "speculation": server_speculation(run),
        "optimum_hit_rate": optimum.rate if optimum is not None and optimum.prompt_tokens else None,
        "optimum_prompt_tokens": optimum.prompt_tokens if optimum is not None else None,
        "prompt_token_mismatches": prompt_mismatches,
    }
    opt_rate = s["optimum_hit_rate"]
    s["hit_vs_optimum"] = hit_rate / opt_rate if hit_rate is not None and opt_rate else None
    return s


def server_hit_rate(run: RunResult) -> float | None:
    """Hit rate from radixserve's own counters over the run. It counts every sequence (an ``n = 8`` request
    counts its prompt 8 times, 7 of them nearly all hits), so it is higher than the usage-based figure for
    parallel sampling; the usage-based one is the one compared with the optimum."""
    if run.server_before is None or run.server_after is None:
        return None
    b, a = run.server_before["cache"], run.server_after["cache"]
    hit = a.get("hit_tokens", 0) - b.get("hit_tokens", 0)
    miss = a.get("miss_tokens", 0) - b.get("miss_tokens", 0)
    return hit / (hit + miss) if hit + miss > 0 else None


def server_tiers(run: RunResult) -> dict[str, dict[str, float | None]] | None:
    """What each memory tier did during the run, from radixserve's ``cache.tiers`` counters before and after
    (as ``server_hit_rate``): per tier the growth of ``TIER_FIGURES``, ``hit_share`` (the tier's part of the
    run's hit tokens) and ``mean_load_ms`` (per load from a lower tier). Like ``server_hit_rate`` it counts
    every sequence. None for servers without the figures."""
    if run.server_before is None or run.server_after is None:
        return None
    before = run.server_before["cache"].get("tiers") or {}
    after = run.server_after["cache"].get("tiers") or {}
    if not after:
        return None
    out: dict[str, dict[str, float | None]] = {}
    for tier, figures in after.items():
        prev = before.get(tier, {})
        grown: dict[str, float | None] = {k: figures[k] - prev.get(k, 0) for k in TIER_FIGURES
                                          if isinstance(figures.get(k), int | float)}
        loads, seconds = grown.get("loads"), grown.get("load_seconds")
        if loads is not None and seconds is not None:
            grown["mean_load_ms"] = 1e3 * seconds / loads if loads > 0 else None
        out[tier] = grown
    hits = sum(t.get("hit_tokens") or 0 for t in out.values())
    for t in out.values():
        t["hit_share"] = (t.get("hit_tokens") or 0) / hits if hits > 0 else None
    return out


def server_speculation(run: RunResult) -> dict[str, float] | None:
    """What speculative decoding did during the run, from radixserve's scheduler counters before and after:
    verifying steps, draft tokens, accepted tokens, the acceptance rate (accepted / drafted) and the tokens
    emitted per verifying step. None where the server reports no such counters or drafted nothing."""
    if run.server_before is None or run.server_after is None:
        return None
    b, a = run.server_before.get("scheduler") or {}, run.server_after.get("scheduler") or {}
    grown = {k: a.get(k, 0) - b.get(k, 0) for k in ("spec_verifications", "spec_draft_tokens", "spec_accepted_tokens")}
    if grown["spec_draft_tokens"] <= 0:
        return None
    return {"verifications": grown["spec_verifications"], "draft_tokens": grown["spec_draft_tokens"],
            "accepted_tokens": grown["spec_accepted_tokens"],
            "accept_rate": grown["spec_accepted_tokens"] / grown["spec_draft_tokens"],
            "accept_length": 1 + grown["spec_accepted_tokens"] / max(1, grown["spec_verifications"])}


def format_tiers(tiers: dict[str, dict[str, Any]]) -> list[str]:
    """One summary line per memory tier: hit tokens and share, loads and their mean wait, bytes each way."""
    lines = []
    for name, t in tiers.items():
        share = t.get("hit_share")
        line = f"   tier {name}: {int(t.get('hit_tokens') or 0)} hit tokens"
        line += f" ({100 * share:.1f}% of hits)" if share is not None else ""
        if t.get("loads") is not None:
            line += f", {int(t['loads'])} loads (mean {_f(t.get('mean_load_ms'), '.2f')} ms)"
        if t.get("bytes_written") is not None:
            line += f", {t['bytes_written'] / 1e6:.1f} MB in, {(t.get('bytes_read') or 0) / 1e6:.1f} MB out"
        lines.append(line)
    return lines


def _f(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"== {s['system']} / {s['workload']} ({s['description']})",
             f"   requests {s['ok']}/{s['requests']} ok, errors {s['errors']}, sequences {s['sequences']}, "
             f"wall {s['wall_s']:.1f}s",
             f"   throughput {_f(s['requests_per_s'])} req/s, {_f(s['sequences_per_s'])} seq/s, "
             f"{_f(s['output_tok_per_s'], '.1f')} output tok/s ({s['output_tokens']} tokens via "
             f"{s['output_tokens_method']})",
             f"   TTFT p50 {_f(s['ttft_p50_s'])}s p99 {_f(s['ttft_p99_s'])}s   "
             f"e2e latency p50 {_f(s['latency_p50_s'])}s p99 {_f(s['latency_p99_s'])}s"]
    hit = f"   cache hit rate {_f(s['hit_rate'])} (usage)"
    if s.get("server_hit_rate") is not None:
        hit += f", {_f(s['server_hit_rate'])} (server counters, per sequence)"
    hit += f"; optimum {_f(s['optimum_hit_rate'])}"
    if s.get("hit_vs_optimum") is not None:
        hit += f"; {100 * s['hit_vs_optimum']:.1f}% of the optimum"
    lines.append(hit)
    if s.get("server_tiers") and len(s["server_tiers"]) > 1:  # the device alone says nothing new
        lines += format_tiers(s["server_tiers"])
    spec = s.get("speculation")
    if spec:
        lines.append(f"   speculation: {int(spec['accepted_tokens'])} of {int(spec['draft_tokens'])} draft tokens "
                     f"accepted ({100 * spec['accept_rate']:.1f}%), "
                     f"{spec['accept_length']:.2f} tokens per verifying step")
    if s.get("prompt_token_mismatches"):
        lines.append(f"   note: {s['prompt_token_mismatches']} prompts tokenize differently from the server's "
                     "usage figure; the optimum is approximate")
    if s.get("short_choices"):
        lines.append(f"   WARNING: {s['short_choices']} requests returned fewer choices than n")
    lines += [f"   error: {e}" for e in s["error_samples"]]
    return "\n".join(lines)
