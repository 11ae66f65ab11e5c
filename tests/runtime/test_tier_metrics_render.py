"""/metrics' per-tier series from the scheduler's statuses (``SchedulerStatus.tiers``, as ``tier_report`` makes
them from a real cache's stats): counters advance by growth only, whatever the number of scrapes; a reset of
the source counts from zero; what a tier holds is a gauge; non-numeric report fields are left out.
tests/server/test_tier_metrics.py checks the same series through a running server."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from radix.base import CacheStats
from radix.disk_cache import DiskCacheStats
from runtime.core.messages import SchedulerStatus
from runtime.http.metrics import ServerMetrics
from runtime.scheduler.results import tier_report


def status(cs: CacheStats) -> SchedulerStatus:
    return SchedulerStatus(num_running=0, num_waiting=0, token_usage=0.0, cache_hit_rate=cs.hit_rate,
                           decode_throughput=0.0, cached_tokens=cs.cached_tokens, capacity=1024,
                           tiers=tier_report(cs))


def stats(host_hit: int, device_hit: int, loads: int, seconds: float, to_host: int, disk: bool = False) -> CacheStats:
    fields: dict[str, Any] = dict(hit_tokens=host_hit + device_hit, miss_tokens=10, cached_tokens=300,
                                  host_capacity=2048, host_tokens=700, host_hit_tokens=host_hit,
                                  bytes_to_host=to_host, bytes_to_device=host_hit * 8, host_loads=loads,
                                  host_load_seconds=seconds)
    if not disk:
        return CacheStats(**fields)
    return DiskCacheStats(**fields, disk={"blocks_stored": 2, "block_tokens": 64, "bytes_written": 512,
                                          "bytes_read": 0, "directory": "/somewhere", "writable": True,
                                          "capacity_bytes": None})


def series(m: ServerMetrics, st: SchedulerStatus | None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render(st).decode()):
        for s in family.samples:
            if s.name.startswith("radixserve_cache_tier_") and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def get(ser: dict[Any, float], name: str, tier: str, **extra: str) -> float:
    return ser[(name, tuple(sorted({"tier": tier, **extra}.items())))]


def test_tier_counters_follow_the_cumulative_figures_and_stay_monotonic() -> None:
    m = ServerMetrics("m")
    first = series(m, status(stats(host_hit=40, device_hit=60, loads=2, seconds=0.004, to_host=1000)))
    assert get(first, "radixserve_cache_tier_hit_tokens_total", "host") == 40
    assert get(first, "radixserve_cache_tier_hit_tokens_total", "device") == 60
    assert get(first, "radixserve_cache_tier_bytes_total", "host", direction="in") == 1000
    assert get(first, "radixserve_cache_tier_bytes_total", "host", direction="out") == 320
    assert get(first, "radixserve_cache_tier_loads_total", "host") == 2
    assert get(first, "radixserve_cache_tier_load_seconds_total", "host") == 0.004
    assert get(first, "radixserve_cache_tier_cached_tokens", "host") == 700
    assert get(first, "radixserve_cache_tier_cached_tokens", "device") == 300
    same = status(stats(host_hit=40, device_hit=60, loads=2, seconds=0.004, to_host=1000))
    assert series(m, same) == first and series(m, same) == first  # scraping twice moves nothing
    assert series(m, None) == first  # no status yet / gone: the last figures stay
    grown = series(m, status(stats(host_hit=100, device_hit=70, loads=5, seconds=0.010, to_host=1000)))
    assert get(grown, "radixserve_cache_tier_hit_tokens_total", "host") == 100
    assert get(grown, "radixserve_cache_tier_hit_tokens_total", "device") == 70
    assert get(grown, "radixserve_cache_tier_loads_total", "host") == 5
    # the source's counters were reset (a new cache): the exported counters go on from where they were
    after_reset = series(m, status(stats(host_hit=8, device_hit=0, loads=1, seconds=0.001, to_host=0)))
    assert get(after_reset, "radixserve_cache_tier_hit_tokens_total", "host") == 108
    assert get(after_reset, "radixserve_cache_tier_hit_tokens_total", "device") == 70
    assert get(after_reset, "radixserve_cache_tier_loads_total", "host") == 6
    assert get(after_reset, "radixserve_cache_tier_cached_tokens", "host") == 700  # a gauge: as reported


def test_disk_tier_series_and_non_numeric_fields() -> None:
    m = ServerMetrics("m")
    ser = series(m, status(stats(host_hit=0, device_hit=5, loads=0, seconds=0.0, to_host=0, disk=True)))
    assert get(ser, "radixserve_cache_tier_cached_tokens", "disk") == 128
    assert get(ser, "radixserve_cache_tier_bytes_total", "disk", direction="in") == 512
    assert get(ser, "radixserve_cache_tier_hit_tokens_total", "disk") == 0
    assert not any("directory" in name or "writable" in name for name, _ in ser)
    # only the tiers the status names have series: a server without the hierarchy shows the device alone
    flat = series(ServerMetrics("m"), status(CacheStats(hit_tokens=3, cached_tokens=9)))
    assert {dict(labels)["tier"] for _, labels in flat} == {"device"}
