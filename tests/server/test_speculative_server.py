"""Speculative decoding through a real server (n-gram drafts and a draft model): /generate's meta_info carries
each request's draft figures, /get_server_info the scheduler's, /metrics the acceptance gauges; the outputs equal
those without speculation (an in-process Engine's), and the KV books balance."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.server_harness import ServerProcess, assert_kv_clean, scrape_metrics

ARGS = ["--max-total-tokens", "8192", "--num-threads", "1", "--dtype", "float32"]


def generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def spec_gauges(url: str) -> dict[str, float]:
    return {name: value for (name, _), value in scrape_metrics(url, "radixserve_spec_").items()}


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_server_reports_speculation_and_outputs_are_unchanged(tiny_model_dir: Path, algorithm: str):
    """ngram drafts from the first request's output; the draft model (here the served model itself, so nearly
    every draft is accepted) drafts from the start."""
    ids = list(range(400, 430)) * 3
    flags = ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", "6",
             "--speculative-draft-budget", "full"]  # every step drafts: the figures under test must be there
    if algorithm == "draft":
        flags += ["--speculative-draft-model", str(tiny_model_dir)]
    spec = ServerProcess(str(tiny_model_dir), [*ARGS, *flags]).start()
    try:
        first, second = generate(spec.url, ids), generate(spec.url, ids)  # the second drafts from the first
        meta = second["meta_info"]
        assert meta["spec_accepted_tokens"] > 0 and meta["spec_draft_tokens"] >= meta["spec_accepted_tokens"]
        assert first["output_ids"] == second["output_ids"]
        stats = httpx.get(spec.url + "/get_server_info", timeout=30).json()["scheduler"]
        assert stats["spec_accepted_tokens"] >= meta["spec_accepted_tokens"]
        assert 0 < stats["spec_accept_rate"] <= 1 and stats["spec_accept_length"] > 1
        # the status behind /metrics is pushed twice a second: wait until it is the current one (both gauges,
        # since a draft that is always accepted keeps the rate at 1 while the length still moves)
        deadline = time.time() + 10
        while True:
            gauges = spec_gauges(spec.url)
            if all(abs(gauges[f"radixserve_spec_{name}"] - stats[f"spec_{name}"]) < 1e-3
                   for name in ("accept_rate", "accept_length")):
                break
            assert time.time() < deadline, (gauges, stats)
            time.sleep(0.1)
        assert_kv_clean(spec.url)
    finally:
        assert spec.stop() == 0, spec.log()
    from runtime.engine import Engine

    with Engine(model=str(tiny_model_dir), max_total_tokens=8192, dtype="float32", log_level="warning") as plain:
        ref = plain.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                             "ignore_eos": True})
    assert ref["output_ids"] == first["output_ids"]
    assert "spec_draft_tokens" not in ref["meta_info"]
