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

from tests.server_harness import Series, ServerProcess, assert_kv_clean, scrape_metrics


def generate(url: str, ids: list[int]) -> tuple[list[int], int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def scrape(url: str) -> Series:
    """Every radixserve_cache_tier_* sample, keyed by name and labels (model_name left out)."""
    return scrape_metrics(url, "radixserve_cache_tier_")


def tier(series: Series, name: str, t: str, **extra: str) -> float:
    return series[(name, tuple(sorted({"tier": t, **extra}.items())))]


def info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def mismatches(m: Series, tiers: dict[str, Any]) -> list[str]:
    """Every /metrics tier series that differs from the server info's ``cache.tiers``, described."""
    pairs: list[tuple[str, str, str, dict[str, str]]] = [
        (t, name, field, {}) for t in ("device", "host", "disk")
        for name, field in (("hit_tokens_total", "hit_tokens"), ("cached_tokens", "cached_tokens"))]
    pairs += [(t, name, field, extra) for t in ("host", "disk")
              for name, field, extra in (("bytes_total", "bytes_written", {"direction": "in"}),
                                         ("bytes_total", "bytes_read", {"direction": "out"}),
                                         ("loads_total", "loads", {}), ("load_seconds_total", "load_seconds", {}))]
    wrong = []
    for t, name, field, extra in pairs:
        got, want = tier(m, "radixserve_cache_tier_" + name, t, **extra), tiers[t][field]
        if abs(got - want) >= 1e-5:  # exact for the counts; float sums of seconds get rounding's room
            wrong.append(f"{t} {field}: /metrics {got} != info {want}")
    return wrong


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

        # the status behind /metrics is pushed twice a second, so a scrape may still show the last request before
        # its finish put its KV in the tree: wait until a scrape shows what the server info shows at that moment
        deadline = time.time() + 10
        while wrong := mismatches(m := scrape(url), tiers := info(url)["cache"]["tiers"]):
            assert time.time() < deadline, wrong
            time.sleep(0.1)
        assert all(tiers[t]["bytes_written"] > 0 and tiers[t]["bytes_read"] > 0 for t in ("host", "disk")), tiers
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
