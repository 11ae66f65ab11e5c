"""A server with the disk tier (``--hicache-storage-backend file``) killed with SIGKILL leaves a directory the
next server resumes from: the next turn of a conversation hits its transcript's blocks on disk, and answers
exactly as the same prompt computed cold (another cache salt: a namespace with no blocks)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server_harness import ServerProcess, assert_kv_clean

PROMPT_LEN = 400
NEW = 8


def generate(url: str, ids: list[int], **extra: Any) -> tuple[list[int], list[Any], int]:
    body = {"input_ids": ids, "return_logprob": True, **extra,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["output_token_logprobs"], out["meta_info"]["cached_tokens"]


def disk_info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=30).json()["cache"]["tiers"]["disk"]


def test_a_killed_servers_directory_serves_the_next_turn(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--enable-deterministic-inference", "--dtype", "float32", "--max-total-tokens", "8192",
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path)]
    rng = random.Random(21)
    prompt = [rng.randrange(3, 2000) for _ in range(PROMPT_LEN)]
    first = ServerProcess(str(tiny_model_dir), args).start()
    try:
        out, _lp, _cached = generate(first.url, prompt)
        transcript = prompt + out
        blocks = (len(transcript) - 2) // 64  # the last token has no KV, and the one before may be in flight
        deadline = time.time() + 30
        while (info := disk_info(first.url))["blocks_written"] < blocks or info["queued_blocks"]:
            assert time.time() < deadline, f"the disk writer did not catch up: {info}"
            time.sleep(0.05)
    finally:
        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGKILL)  # the whole group: server, scheduler, detokenizer
        first.proc.wait(10)
    second = ServerProcess(str(tiny_model_dir), args).start()
    try:
        nxt = transcript + [100, 200]
        ids, lps, cached = generate(second.url, nxt)
        assert cached >= blocks * 64, (cached, blocks)
        info = disk_info(second.url)
        assert info["hit_tokens"] >= blocks * 64 and info["blocks_read"] >= blocks and info["corrupted"] == 0
        cold_ids, cold_lps, cold_cached = generate(second.url, nxt, cache_salt="cold")
        assert cold_cached == 0
        assert (ids, lps) == (cold_ids, cold_lps)
        assert_kv_clean(second.url)
    finally:
        code = second.stop()
    assert code == 0, second.log()
