"""Prometheus metrics of one server (prometheus-client, a registry per server).

Per memory tier (label ``tier``: ``device``, and ``host`` / ``disk`` when those tiers are on) the scheduler's
status carries cumulative figures (``SchedulerStatus.tiers``, from ``runtime.scheduler.results.tier_report``).
Those that only grow (hit tokens, bytes moved, loads, load seconds) are exported as counters advanced by the
difference from the last status seen, so they stay monotonic however often /metrics is scraped; a figure
that went down (the cache's counters were reset) counts from zero again, as Prometheus' own counter-reset
rule would. What a tier holds now (cached tokens) is a gauge. Load latency is a seconds counter with a load
counter beside it (rate(seconds) / rate(loads) is the mean wait), because the cache keeps sums, not buckets.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runtime.core.messages import SchedulerStatus
from runtime.server.tokenizer_manager import ReqHandle

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# tier_report key -> (counter, its extra labels); each counter advances by the key's growth
TIER_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "hit_tokens": ("hit_tokens", {}),
    "bytes_written": ("bytes", {"direction": "in"}),
    "bytes_read": ("bytes", {"direction": "out"}),
    "loads": ("loads", {}),
    "load_seconds": ("load_seconds", {}),
}


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model = model_name

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"radixserve_{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"radixserve_{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Any:
            return Histogram(f"radixserve_{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("num_running_reqs", "Requests in the running batch")
        self.queued = gauge("num_queue_reqs", "Requests waiting for admission")
        self.token_usage = gauge("token_usage", "Share of KV capacity held by requests and locked prefixes")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the radix cache / prompt tokens")
        self.gen_throughput = gauge("gen_throughput", "Decode tokens per second (recent)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the cache")
        self.requests = counter("requests", "Finished requests")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (streaming requests)")
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens (streaming requests)")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.spec_accept_length = gauge("spec_accept_length", "Speculative decoding: tokens emitted per decode "
                                        "step that verified a draft (1 + accepted drafts), since start")
        self.spec_accept_rate = gauge("spec_accept_rate", "Speculative decoding: accepted / verified draft tokens, "
                                      "since start")
        tier = ["model_name", "tier"]
        self.tier_counters: dict[str, Counter] = {
            "hit_tokens": Counter("radixserve_cache_tier_hit_tokens", "Prompt tokens of recorded cache hits, by "
                                  "the tier they were served from (the tiers add up to the cache's hits)", tier,
                                  registry=r),
            "bytes": Counter("radixserve_cache_tier_bytes", "KV bytes copied into a tier from the device "
                             "(direction=in) or out of it back to the device (direction=out)",
                             [*tier, "direction"], registry=r),
            "loads": Counter("radixserve_cache_tier_loads", "Admissions that loaded KV from a tier", tier,
                             registry=r),
            "load_seconds": Counter("radixserve_cache_tier_load_seconds", "Time admissions waited for their "
                                    "loads from a tier, summed (divide by loads for the mean)", tier, registry=r),
        }
        self.tier_cached = Gauge("radixserve_cache_tier_cached_tokens", "Tokens whose KV a tier holds", tier,
                                 registry=r)
        self._tier_seen: dict[tuple[str, str], float] = {}  # (tier, tier_report key) -> last cumulative value

    def on_output(self, handle: ReqHandle, before: int, now: float) -> None:
        state = handle.state
        new = state.completion_tokens - before
        if new > 0:
            self.generation_tokens.inc(new)
            if handle.stream:
                gap = handle.token_gap(now)
                if gap is None:
                    self.ttft.observe(now - state.created)
                else:
                    for _ in range(new):
                        self.itl.observe(gap / new)
        if state.finished is not None:
            self.requests.inc()
            self.prompt_tokens.inc(state.prompt_tokens)
            self.cached_tokens.inc(state.cached_tokens)
            self.e2e.observe(time.perf_counter() - state.created)

    def render(self, status: SchedulerStatus | None) -> bytes:
        if status is not None:
            self.running.set(status.num_running)
            self.queued.set(status.num_waiting)
            self.token_usage.set(status.token_usage)
            self.cache_hit_rate.set(status.cache_hit_rate)
            self.gen_throughput.set(status.decode_throughput)
            if status.spec_verifications:
                self.spec_accept_length.set(1 + status.spec_accepted_tokens / status.spec_verifications)
                self.spec_accept_rate.set(status.spec_accepted_tokens / max(1, status.spec_draft_tokens))
            self._update_tiers(status.tiers)
        return generate_latest(self.registry)

    def _update_tiers(self, tiers: dict[str, dict[str, Any]]) -> None:
        for tier, figures in tiers.items():
            cached = _number(figures.get("cached_tokens"))
            if cached is not None:
                self.tier_cached.labels(self.model, tier).set(cached)
            for key, (name, extra) in TIER_COUNTERS.items():
                value = _number(figures.get(key))
                if value is None:
                    continue
                last = self._tier_seen.get((tier, key), 0.0)
                self._tier_seen[(tier, key)] = value
                grown = value - last if value >= last else value  # it went down: the source was reset
                counter = self.tier_counters[name].labels(self.model, tier, *extra.values())
                if grown > 0:
                    counter.inc(grown)


def _number(x: Any) -> float | None:
    """``x`` as a float if it is a number (a tier's report also holds a path, a flag, a None capacity)."""
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None
