"""The bench client's per-tier hit report: the growth of /get_server_info's ``cache.tiers`` over a run (the
shape ``runtime.scheduler.results.tier_report`` gives them), in the summary JSON, the printed summary and the
generated page; absent for servers without the figures."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radix.disk_cache import DiskCacheStats
from runtime.bench.client import RequestRecord, RunResult
from runtime.bench.metrics import format_summary, server_tiers, summarize
from runtime.bench.report import render_section
from runtime.scheduler.results import tier_report

BPT = 1000  # bytes per token of the made-up stats


def info(hit: int, device: int, host: int, disk: int, host_loads: int, disk_loads: int) -> dict[str, Any]:
    """/get_server_info's cache part for a cache whose recorded hits came ``device``/``host``/``disk``."""
    cs = DiskCacheStats(hit_tokens=hit, miss_tokens=1000, cached_tokens=500, host_capacity=4096, host_tokens=800,
                        host_hit_tokens=host, bytes_to_host=900 * BPT, bytes_to_device=host * BPT,
                        host_loads=host_loads, host_load_seconds=0.002 * host_loads, disk_hit_tokens=disk,
                        disk_loads=disk_loads, disk_load_seconds=0.01 * disk_loads,
                        disk={"hit_tokens": disk, "bytes_written": 64 * BPT * 10, "bytes_read": disk * BPT,
                              "blocks_stored": 10, "block_tokens": 64, "directory": "/x", "writable": True})
    assert cs.device_hit_tokens == device
    return {"cache": {"hit_tokens": hit, "miss_tokens": 1000, "tiers": json.loads(json.dumps(tier_report(cs)))},
            "scheduler": {}}


def run_result(before: dict[str, Any] | None, after: dict[str, Any] | None) -> RunResult:
    rec = RequestRecord("r0", "completions", {}, sent_at=0.0, first_token_at=0.1, done_at=0.2, output_tokens=4,
                        prompt_tokens=600, cached_tokens=300)
    return RunResult("multiturn", {}, "d", "http://x/v1", [rec], 1.0, before, after)


def test_per_tier_figures_are_the_growth_over_the_run() -> None:
    before = info(hit=100, device=100, host=0, disk=0, host_loads=0, disk_loads=0)
    after = info(hit=700, device=300, host=320, disk=80, host_loads=4, disk_loads=1)
    tiers = server_tiers(run_result(before, after))
    assert tiers is not None and set(tiers) == {"device", "host", "disk"}
    assert tiers["device"]["hit_tokens"] == 200 and tiers["host"]["hit_tokens"] == 320
    assert tiers["disk"]["hit_tokens"] == 80
    assert tiers["device"]["hit_share"] == pytest.approx(200 / 600)
    assert tiers["host"]["hit_share"] == pytest.approx(320 / 600)
    assert tiers["host"]["loads"] == 4 and tiers["host"]["mean_load_ms"] == pytest.approx(2.0)
    assert tiers["disk"]["loads"] == 1 and tiers["disk"]["mean_load_ms"] == pytest.approx(10.0)
    assert tiers["host"]["bytes_read"] == 320 * BPT and tiers["host"]["bytes_written"] == 0  # 900 before and after
    assert tiers["disk"]["bytes_read"] == 80 * BPT
    assert "loads" not in tiers["device"]  # the device loads nothing

    s = summarize(run_result(before, after), "radixserve")
    assert s["server_tiers"] == tiers
    json.dumps(s)  # the JSON result carries it as it is
    text = format_summary(s)
    assert "tier host: 320 hit tokens (53.3% of hits), 4 loads (mean 2.00 ms), 0.0 MB in, 0.3 MB out" in text
    assert "tier disk: 80 hit tokens (13.3% of hits), 1 loads (mean 10.00 ms)" in text
    assert "tier device: 200 hit tokens (33.3% of hits)" in text


def test_a_tier_that_appears_during_the_run_counts_from_zero_and_no_figures_mean_none() -> None:
    before = {"cache": {"hit_tokens": 0, "miss_tokens": 0, "tiers": {"device": {"hit_tokens": 0}}}}
    after = info(hit=50, device=40, host=10, disk=0, host_loads=1, disk_loads=0)
    tiers = server_tiers(run_result(before, after))
    assert tiers is not None and tiers["host"]["hit_tokens"] == 10 and tiers["disk"]["mean_load_ms"] is None
    assert server_tiers(run_result(None, None)) is None  # a peer without /get_server_info
    flat = {"cache": {"hit_tokens": 5, "miss_tokens": 5}}  # a server that reports no tiers
    assert server_tiers(run_result(flat, flat)) is None
    s = summarize(run_result(None, None), "vllm")
    assert s["server_tiers"] is None and "tier " not in format_summary(s)


def test_the_generated_page_has_a_tier_table_only_with_lower_tiers() -> None:
    before = info(hit=0, device=0, host=0, disk=0, host_loads=0, disk_loads=0)
    after = info(hit=600, device=200, host=320, disk=80, host_loads=4, disk_loads=1)
    row = summarize(run_result(before, after), "radixserve")
    flat = dict(row, system="vllm", server_tiers={"device": {"hit_tokens": 5, "hit_share": 1.0}})
    summary = {"results": [row, flat], "systems": {}, "workloads": {"multiturn": {"params": {}}}}
    page = render_section(summary, [])
    assert "| system | tier | hit tokens | share of hits | loads | mean load | MB in | MB out |" in page
    assert "| radixserve | host | 320 | 53.3% | 4 | 2.00 ms | 0.0 | 0.3 |" in page
    assert "| radixserve | device | 200 | 33.3% | n/a | n/a | n/a | n/a |" in page
    assert "| vLLM | device" not in page and "| vllm | device" not in page
