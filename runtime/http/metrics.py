"""Prometheus metrics of one server (prometheus-client, a registry per server)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runtime.core.messages import SchedulerStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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

    def on_output(self, handle: Any, before: int, now: float) -> None:
        state = handle.state
        new = state.completion_tokens - before
        if new > 0:
            self.generation_tokens.inc(new)
            if handle.stream:
                last = getattr(handle, "_last_token_at", None)
                if last is None:
                    self.ttft.observe(now - state.created)
                else:
                    per = (now - last) / new
                    for _ in range(new):
                        self.itl.observe(per)
                handle._last_token_at = now
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
        return generate_latest(self.registry)
