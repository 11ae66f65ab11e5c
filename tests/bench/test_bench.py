"""`radixserve bench`: the optimum simulation, the percentiles, and one quick run against a live server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.bench.metrics import percentile
from runtime.bench.optimum import SimRequest, simulate
from runtime.bench.workload_files import dump_workload
from runtime.bench.workloads import make
from tests.server_harness import ServerProcess


def test_optimum_counts_prefixes_seen_before_and_answers_after_they_finish() -> None:
    shared = list(range(100))
    reqs = [
        SimRequest(0.0, shared + [1000], done_at=1.0, after=[shared + [1000, 7, 8]]),
        SimRequest(0.5, shared + [2000]),  # sent before the first finished: only its prompt is cached
        SimRequest(2.0, shared + [1000, 7, 8, 9]),  # a next turn: the first answer is cached by then
    ]
    result = simulate(reqs)
    assert result.per_request == [0, 100, 103]
    assert result.prompt_tokens == 101 + 101 + 104
    assert result.rate == pytest.approx(203 / 306)


def test_optimum_never_counts_the_last_prompt_token() -> None:
    # Even an identical prompt must compute its last token to produce logits.
    result = simulate([SimRequest(0.0, [1, 2, 3]), SimRequest(1.0, [1, 2, 3])])
    assert result.per_request == [0, 2]


def test_percentile() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "16384"]).start()
    yield proc
    assert proc.stop() == 0, proc.log()


# The workloads ship with the package (runtime/bench/workloads.py): this runs on any checkout.
def test_bench_run_reports_throughput_latency_and_hit_rate(server: ServerProcess, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "fewshot.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "run", "--url", server.url, "--workload", "fewshot",
           "--quick", "--param", "questions=6", "--param", "max_tokens=4", "--concurrency", "4",
           "--tokenizer", str(tiny_model_dir), "--flush-cache", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["requests"] == s["ok"] == 6 and s["errors"] == 0
    assert s["output_tokens"] > 0 and s["requests_per_s"] > 0
    assert s["ttft_p50_s"] <= s["latency_p99_s"]
    # Six questions under one few-shot block: all but the first reuse it; the optimum agrees.
    assert s["optimum_hit_rate"] > 0.5
    assert s["hit_vs_optimum"] >= 0.95
    assert s["prompt_token_mismatches"] == 0


def test_bench_run_on_a_workload_file_of_chat_sessions(server: ServerProcess, tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    wl_file = dump_workload(make("multiturn", sessions=2, turns=2, max_tokens=4), tmp_path / "chats.jsonl")
    out = tmp_path / "chats.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "run", "--url", server.url, "--workload-file", str(wl_file),
           "--concurrency", "2", "--tokenizer", str(tiny_model_dir), "--flush-cache", "--no-progress",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["workload"] == "chats" and s["requests"] == s["ok"] == 4 and s["errors"] == 0
    assert s["params"] == {"file": "chats.jsonl", "sessions": 2}
    # The second turn re-sends the first turn and its answer, both cached by then (measured ~0.48 of an optimum
    # ~0.49). The optimum re-tokenizes the answer text, which a random model's tokens need not round-trip to.
    assert s["hit_rate"] > 0.3 and s["hit_vs_optimum"] >= 0.9


def test_unstreamed_requests_get_the_streamed_texts_and_counts(server: ServerProcess) -> None:
    """``--disable-stream``: one JSON reply per request, read into the same records as a stream. One request at
    a time on a flushed cache, greedy, so both runs compute the same batches and answer the same; the chat
    sessions check the chat reply's message shape (and their later turns resend what the first answered)."""
    from runtime.bench.client import run_workload

    for wl in (make("fewshot", questions=3, max_tokens=6), make("multiturn", sessions=1, turns=2, max_tokens=5)):
        streamed, unstreamed = (run_workload(server.url, wl, concurrency=1, progress=False, flush=True, stream=s)
                                for s in (True, False))
        assert [r.id for r in streamed.records] == [r.id for r in unstreamed.records]
        for a, b in zip(streamed.records, unstreamed.records, strict=True):
            assert a.ok and b.ok, (a.error, b.error)
            assert b.texts == a.texts and b.texts[0], (a.texts, b.texts)
            assert (b.output_tokens, b.prompt_tokens) == (a.output_tokens, a.prompt_tokens)
            assert b.output_tokens > 0 and b.ttft is None and a.ttft is not None
