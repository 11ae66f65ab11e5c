"""The router's Prometheus metrics (prometheus-client, a registry of its own).

Two hit rates, on purpose: the *estimated* one is what the policy predicted when it routed (predicted
match / prompt length, in the policy's unit: bytes for text trees, tokens otherwise); the *actual* one
is what the workers reported in their answers (``usage.prompt_tokens_details.cached_tokens`` or
``meta_info.cached_tokens`` over prompt tokens). A large gap between them says the policy's picture of
the caches is wrong (trees too large or small, evictions it does not see).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.workers import WorkerRegistry

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _rate(num: float, den: float) -> float:
    return num / den if den else 0.0


class RouterMetrics:
    def __init__(self, policy: str):
        self.policy = policy
        self.registry = r = CollectorRegistry()
        p = "radixserve_router_"
        self.inflight = Gauge(p + "worker_inflight_requests", "Requests in flight on the worker, routed by us",
                              ["worker"], registry=r)
        self.healthy = Gauge(p + "worker_healthy", "1 if the worker takes requests", ["worker"], registry=r)
        self.routed = Counter(p + "requests_routed", "Requests sent to a worker (retries included)",
                              ["worker", "policy", "reason"], registry=r)
        self.retries = Counter(p + "retries", "Requests retried on another worker after this one failed",
                               ["worker"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused by the router (429 saturated, "
                                "503 no worker / queue timeout)", ["status"], registry=r)
        self.queued = Gauge(p + "queued_requests", "Requests waiting for a worker slot", registry=r)
        self.est_match = Counter(p + "estimated_match_units", "Predicted cached prefix of routed requests",
                                 ["worker", "policy"], registry=r)
        self.est_prompt = Counter(p + "estimated_prompt_units", "Prompt length of routed requests (same unit)",
                                  ["worker", "policy"], registry=r)
        self.est_rate = Gauge(p + "estimated_hit_rate", "Predicted match / prompt length", ["policy"],
                              registry=r)
        self.cached = Counter(p + "cached_tokens", "Prompt tokens the workers served from their caches",
                              ["worker"], registry=r)
        self.prompt = Counter(p + "prompt_tokens", "Prompt tokens the workers reported", ["worker"], registry=r)
        self.actual_rate = Gauge(p + "actual_hit_rate", "Cached / prompt tokens reported by the workers "
                                 "('all' = every worker)", ["worker"], registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "Time from arrival to the end of the response",
                                 ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.guard = Gauge(p + "imbalance_guard_overrides", "Times the load guard overruled the cache",
                           registry=r)
        # Plain sums as well, for the rates and for GET /workers.
        self.sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def on_routed(self, worker: str, reason: str, match: int, prompt_units: int) -> None:
        self.routed.labels(worker, self.policy, reason).inc()
        if prompt_units > 0:
            self.est_match.labels(worker, self.policy).inc(match)
            self.est_prompt.labels(worker, self.policy).inc(prompt_units)
            s = self.sums[worker]
            s["est_match"] += match
            s["est_prompt"] += prompt_units

    def on_usage(self, worker: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt.labels(worker).inc(prompt_tokens)
        self.cached.labels(worker).inc(cached_tokens)
        s = self.sums[worker]
        s["prompt_tokens"] += prompt_tokens
        s["cached_tokens"] += cached_tokens

    def worker_stats(self, worker: str) -> dict[str, Any]:
        s = self.sums.get(worker, {})
        return {"estimated_hit_rate": round(_rate(s.get("est_match", 0), s.get("est_prompt", 0)), 4),
                "actual_hit_rate": round(_rate(s.get("cached_tokens", 0), s.get("prompt_tokens", 0)), 4),
                "prompt_tokens": int(s.get("prompt_tokens", 0)), "cached_tokens": int(s.get("cached_tokens", 0))}

    def totals(self) -> dict[str, float]:
        keys = ("est_match", "est_prompt", "prompt_tokens", "cached_tokens")
        return {k: sum(s.get(k, 0.0) for s in self.sums.values()) for k in keys}

    def forget(self, worker: str) -> None:
        for g in (self.inflight, self.healthy):
            with contextlib.suppress(KeyError):
                g.remove(worker)

    def render(self, registry: WorkerRegistry, queued: int, guard_overrides: int) -> bytes:
        for w in registry:
            self.inflight.labels(w.url).set(w.load)
            self.healthy.labels(w.url).set(1 if w.healthy else 0)
            self.actual_rate.labels(w.url).set(self.worker_stats(w.url)["actual_hit_rate"])
        t = self.totals()
        self.queued.set(queued)
        self.guard.set(guard_overrides)
        self.est_rate.labels(self.policy).set(_rate(t["est_match"], t["est_prompt"]))
        self.actual_rate.labels("all").set(_rate(t["cached_tokens"], t["prompt_tokens"]))
        return generate_latest(self.registry)
