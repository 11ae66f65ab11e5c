"""The dashboard's live figures: one sample a second from the scheduler, with rates and latency percentiles.

A sample is the scheduler's cheap counters (``runtime.server.dashboard_queries.live_stats``: KV pool, cache hit
counters, token counts) plus what the main process measures itself (the TTFT and inter-token latency
histograms of ``http/metrics.py``). Rates are differences between consecutive samples. The hub samples only
while someone asks (an open page, ``radixserve top``); every viewer shares the same samples, so ten open
pages cost the scheduler one control query a second, and a page that opens late gets the recent history.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Any

from runtime.core.messages import DashboardStatsQuery
from runtime.http.dashboard_files import FRESH
from runtime.http.metrics import ServerMetrics
from runtime.server.tokenizer_manager import TokenizerManager

HISTORY = 600  # samples kept (10 minutes at one a second)
LATENCY_WINDOW = 60.0  # seconds of latency observations the percentiles cover
QUANTILES = (0.5, 0.9, 0.99)
HISTOGRAMS = {"ttft": "radixserve_time_to_first_token_seconds", "itl": "radixserve_inter_token_latency_seconds"}

Buckets = list[tuple[float, float]]  # (upper bound, cumulative count), ending with +inf


def histogram_buckets(metrics: ServerMetrics) -> dict[str, Buckets]:
    """The cumulative bucket counts of the latency histograms (prometheus-client's public collect())."""
    out: dict[str, Buckets] = {k: [] for k in HISTOGRAMS}
    names = {v: k for k, v in HISTOGRAMS.items()}
    for family in metrics.registry.collect():
        key = names.get(family.name)
        if key is None:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out[key].append((float(s.labels["le"]), s.value))
    return out


def quantile(buckets: Buckets, q: float) -> float | None:
    """Prometheus's histogram_quantile: linear inside the bucket holding the q-th observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound  # beyond the last finite bucket: its bound is all we know
            span = count - lo_count
            return lo_bound + (bound - lo_bound) * ((rank - lo_count) / span if span else 1.0)
        lo_bound, lo_count = bound, count
    return lo_bound


def _minus(now: Buckets, then: Buckets) -> Buckets:
    if len(now) != len(then):
        return now
    return [(b, c - c0) for (b, c), (_, c0) in zip(now, then)]


class StatsHub:
    def __init__(self, tm: TokenizerManager, metrics: ServerMetrics):
        self.tm = tm
        self.metrics = metrics
        # (monotonic time, public sample, latency buckets) of recent samples
        self._history: deque[tuple[float, dict[str, Any], dict[str, Buckets]]] = deque(maxlen=HISTORY)
        self._lock = asyncio.Lock()

    def history(self) -> list[dict[str, Any]]:
        return [s for _, s, _ in self._history]

    async def sample(self, max_age: float = FRESH) -> dict[str, Any]:
        """The latest sample, taken now unless another viewer took one less than ``max_age`` seconds ago."""
        async with self._lock:
            if self._history and time.monotonic() - self._history[-1][0] < max_age:
                return self._history[-1][1]
            reply = await self.tm.control(DashboardStatsQuery())
            if not reply.ok:
                raise RuntimeError(reply.data.get("message", "the scheduler did not answer"))
            now = time.monotonic()
            buckets = histogram_buckets(self.metrics)
            sample = {**reply.data, "rates": self._rates(reply.data, now),
                      "latency": self._latency(buckets, now)}
            self._history.append((now, sample, buckets))
            return sample

    def _rates(self, cur: dict[str, Any], now: float) -> dict[str, float | None]:
        """Tokens per second since the previous sample, and the hit rate of the prompts admitted meanwhile."""
        out: dict[str, float | None] = {"prompt_tokens_per_s": 0.0, "cached_tokens_per_s": 0.0,
                                        "computed_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0,
                                        "hit_rate": None}
        if not self._history:
            return out
        then, prev, _ = self._history[-1]
        dt = now - then
        if dt <= 0:
            return out
        hit = cur["cache"]["hit_tokens"] - prev["cache"]["hit_tokens"]
        miss = cur["cache"]["miss_tokens"] - prev["cache"]["miss_tokens"]
        if hit < 0 or miss < 0:  # the counters restarted (never today; cheap to guard)
            return out
        out["prompt_tokens_per_s"] = round((hit + miss) / dt, 2)
        out["cached_tokens_per_s"] = round(hit / dt, 2)
        out["computed_tokens_per_s"] = round(
            (cur["scheduler"]["prefill_tokens"] - prev["scheduler"]["prefill_tokens"]) / dt, 2)
        out["decode_tokens_per_s"] = round(
            (cur["scheduler"]["decode_tokens"] - prev["scheduler"]["decode_tokens"]) / dt, 2)
        out["hit_rate"] = round(hit / (hit + miss), 4) if hit + miss else None
        return out

    def _latency(self, buckets: dict[str, Buckets], now: float) -> dict[str, Any]:
        """Percentiles of the observations since the newest sample at least LATENCY_WINDOW seconds old (since
        the start while the hub has no sample that old; ``window_s`` null)."""
        base: dict[str, Buckets] | None = None
        since: float | None = None
        for t, _, b in self._history:
            if now - t < LATENCY_WINDOW:
                break
            base, since = b, t
        out: dict[str, Any] = {"window_s": None if since is None else round(now - since, 1)}
        for key, cur in buckets.items():
            win = _minus(cur, base[key]) if base is not None else cur
            stats: dict[str, float | None] = {}
            for q in QUANTILES:
                v = quantile(win, q)
                stats[f"p{round(q * 100)}"] = None if v is None else round(v, 6)
            stats["count"] = win[-1][1] if win else 0
            out[key] = stats
        return out
