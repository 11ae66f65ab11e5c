"""The bench client's speculation report: the growth of /get_server_info's speculative-decoding counters over
a run, in the summary JSON and the printed summary; absent where nothing was drafted or the server has no
such counters."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.bench.client import RequestRecord, RunResult
from runtime.bench.metrics import format_summary, server_speculation, summarize


def info(verifications: int, drafted: int, accepted: int) -> dict[str, Any]:
    return {"cache": {"hit_tokens": 0, "miss_tokens": 10},
            "scheduler": {"spec_verifications": verifications, "spec_draft_tokens": drafted,
                          "spec_accepted_tokens": accepted}}


def run_result(before: dict[str, Any] | None, after: dict[str, Any] | None) -> RunResult:
    rec = RequestRecord("r0", "completions", {}, sent_at=0.0, first_token_at=0.1, done_at=0.2, output_tokens=4,
                        prompt_tokens=600, cached_tokens=300)
    return RunResult("agent", {}, "d", "http://x/v1", [rec], 1.0, before, after)


def test_speculation_figures_are_the_growth_over_the_run() -> None:
    spec = server_speculation(run_result(info(10, 30, 12), info(60, 230, 162)))
    assert spec is not None
    assert spec["verifications"] == 50 and spec["draft_tokens"] == 200 and spec["accepted_tokens"] == 150
    assert spec["accept_rate"] == pytest.approx(0.75)
    assert spec["accept_length"] == pytest.approx(1 + 150 / 50)
    s = summarize(run_result(info(10, 30, 12), info(60, 230, 162)), "radixserve")
    assert s["speculation"] == spec
    json.dumps(s)
    assert "speculation: 150 of 200 draft tokens accepted (75.0%), 4.00 tokens per verifying step" in format_summary(s)


def test_no_report_without_drafts_or_counters() -> None:
    assert server_speculation(run_result(None, None)) is None  # a peer without /get_server_info
    assert server_speculation(run_result(info(5, 9, 3), info(5, 9, 3))) is None  # nothing drafted during the run
    assert server_speculation(run_result({"cache": {}}, {"cache": {}})) is None  # no counters at all
    s = summarize(run_result(None, None), "llama.cpp")
    assert s["speculation"] is None and "speculation" not in format_summary(s)
