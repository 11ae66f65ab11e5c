"""The memory hierarchy's visibility through a real server: /metrics' per-tier series equal /get_server_info's
``cache.tiers``, the tiers' hits add up to the cache's hits and to the responses' ``cached_tokens`` (which count
tokens from every tier), repeated scrapes do not move the counters, and the KV books of both pools balance.

The scenario: a device pool that holds about two of four conversations, a host pool that holds them all, and a
disk tier; every conversation takes two turns round-robin (the second turns come back from the host), then
/flush_cache empties the device and host pools and one more turn comes back from disk."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import ServerProcess, assert_kv_clean

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def generate(url: str, ids: list[int]) -> tuple[list[int], int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def scrape(url: str) -> Series:
    """Every radixserve_cache_tier_* sample, keyed by name and labels (model_name left out)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("radixserve_cache_tier_") and not s.name.endswith("_created"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
    return out


def tier(series: Series, name: str, t: str, **extra: str) -> float:
    return series[(name, tuple(sorted({"tier": t, **extra}.items())))]


def info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def test_tier_series_match_the_server_info_and_cached_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "1024",
            "--enable-hierarchical-cache", "--hicache-ratio", "8",
            "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path)]
    rng = random.Random(7)
    history = [[rng.randrange(3, 2000) for _ in range(300)] for _ in range(4)]
    server = ServerProcess(str(tiny_model_dir), args).start()
    try:
        url = server.url
        cached: list[int] = []
        for turn in range(2):
            for i, ids in enumerate(history):
                out, c = generate(url, ids)
                cached.append(c)
                history[i] = ids + out + [100 + turn, 200 + i]
        # the second turns hit their whole first transcript (whole pages), from the host: the device holds two
        assert all(c >= 296 for c in cached[4:]), cached
        deadline = time.time() + 30
        while info(url)["cache"]["tiers"]["disk"]["queued_blocks"]:
            assert time.time() < deadline, "the disk writer did not catch up"
            time.sleep(0.05)
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200  # device + host; disk stays
        _out, c = generate(url, history[0])
        cached.append(c)
        assert c >= 64 * 4, c  # the first turn's blocks (and more) come back from disk

        final = info(url)
        cache, tiers = final["cache"], final["cache"]["tiers"]
        # cached_tokens counts every tier: the responses' sum is the cache's recorded hits, split by tier
        assert sum(cached) == cache["hit_tokens"]
        assert sum(tiers[t]["hit_tokens"] for t in ("device", "host", "disk")) == cache["hit_tokens"]
        assert tiers["host"]["hit_tokens"] >= 4 * 296 and tiers["disk"]["hit_tokens"] >= 256
        assert tiers["host"]["loads"] >= 4 and tiers["host"]["load_seconds"] > 0
        assert tiers["disk"]["loads"] >= 1 and tiers["disk"]["load_seconds"] > 0

        # the status behind /metrics is pushed twice a second: wait until it shows the final figures
        deadline = time.time() + 10
        while (m := scrape(url)).get(("radixserve_cache_tier_hit_tokens_total", (("tier", "disk"),))) != \
                tiers["disk"]["hit_tokens"]:
            assert time.time() < deadline, m
            time.sleep(0.1)
        for t in ("device", "host", "disk"):
            assert tier(m, "radixserve_cache_tier_hit_tokens_total", t) == tiers[t]["hit_tokens"]
            assert tier(m, "radixserve_cache_tier_cached_tokens", t) == tiers[t]["cached_tokens"]
        for t in ("host", "disk"):
            assert tier(m, "radixserve_cache_tier_bytes_total", t, direction="in") == tiers[t]["bytes_written"] > 0
            assert tier(m, "radixserve_cache_tier_bytes_total", t, direction="out") == tiers[t]["bytes_read"] > 0
            assert tier(m, "radixserve_cache_tier_loads_total", t) == tiers[t]["loads"]
            assert abs(tier(m, "radixserve_cache_tier_load_seconds_total", t) - tiers[t]["load_seconds"]) < 1e-5
        assert tiers["host"]["bytes_written"] == tiers["host"]["bytes_to_host"]
        assert tiers["host"]["bytes_read"] == tiers["host"]["bytes_to_device"]
        time.sleep(0.6)  # at least one more status: counters advance by growth only, never per scrape
        assert scrape(url) == m

        assert_kv_clean(url)
        kv = info(url)["kv"]
        assert kv["host_free"] + kv["host_held"] == kv["host_capacity"], kv
    finally:
        code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()}"
