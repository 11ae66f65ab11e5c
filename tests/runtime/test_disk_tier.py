"""Warm restart from the disk tier (``--hicache-storage-backend file``): a fresh Engine over the directory an
earlier one wrote resumes its conversations from disk, with the same tokens and logprobs, bit for bit, as an
Engine without any hierarchy (deterministic mode promises that); a corrupt block is recomputed, a server of
another KV fingerprint never reads the blocks, and the KV books balance after every scenario."""

from __future__ import annotations

import random
import time
from array import array
from pathlib import Path
from typing import Any

import pytest

from radix.events import chain_hashes, root_hash
from runtime.engine import Engine

DET = {"enable_deterministic_inference": True}
LENGTHS = (300, 200, 450, 130)  # + 6 output tokens: 4, 3, 7 and 2 whole 64-token blocks of transcript
SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def disk(path: Path, **extra: Any) -> dict[str, Any]:
    return {"enable_hierarchical_cache": True, "hicache_storage_backend": "file", "hicache_storage_dir": str(path),
            **DET, **extra}


def conversations(seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in LENGTHS]


def ask(engine: Any, ids: list[int]) -> tuple[list[int], list[float], int]:
    r = engine.generate(input_ids=ids, return_logprob=True, sampling_params=SAMPLING)
    meta = r["meta_info"]
    return r["output_ids"], [lp for lp, _t, _x in meta["output_token_logprobs"]], meta["cached_tokens"]


def checked(engine: Any) -> None:
    report = engine.check_integrity()
    assert report["private"] == 0 and report["protected"] == 0, report


def disk_info(engine: Any) -> dict[str, Any]:
    return engine.server_info()["cache"]["tiers"]["disk"]


def first_turns(model_dir: Path, store: Path) -> list[list[int]]:
    """Engine A: the first turn of every conversation, its blocks on disk; shut down once the writer drained.
    Returns each conversation's next prompt (transcript + two new tokens)."""
    a = Engine(model=str(model_dir), max_total_tokens=4096, dtype="float32", log_level="warning", **disk(store))
    try:
        nxt = []
        for i, ids in enumerate(conversations()):
            out, _lp, cached = ask(a, ids)
            assert cached == 0
            nxt.append(ids + out + [100, 200 + i])
        deadline = time.time() + 30
        while disk_info(a)["queued_blocks"]:
            assert time.time() < deadline, "the disk writer did not drain"
            time.sleep(0.02)
        info = disk_info(a)
        assert info["blocks_written"] == sum((n + 6 - 2) // 64 for n in LENGTHS), info
        checked(a)
    finally:
        a.shutdown()
    return nxt


def block_hash(ids: list[int], block: int) -> int:
    return chain_hashes(root_hash(None), array("i", ids).tobytes(), 256)[block]


def test_a_restarted_engine_resumes_from_disk_bit_for_bit(tiny_engine: Any, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    nxt = first_turns(tiny_model_dir, tmp_path)
    flat = tiny_engine(**DET)
    b = tiny_engine(**disk(tmp_path))
    for ids in nxt:
        want = ask(flat, ids)
        got = ask(b, ids)
        assert got[:2] == want[:2]  # tokens and logprobs, bit for bit
        transcript = len(ids) - 2
        assert got[2] >= transcript // 64 * 64, (got[2], transcript)
        checked(b)
    info = disk_info(b)
    assert info["hit_tokens"] >= sum((n + 6) // 64 * 64 for n in LENGTHS)
    assert info["blocks_read"] == sum((n + 6) // 64 for n in LENGTHS) and info["corrupted"] == 0
    assert info["load_ms"] > 0
    tiers = b.server_info()["cache"]
    assert tiers["tiers"]["device"]["hit_tokens"] + info["hit_tokens"] == tiers["hit_tokens"]
    # /flush_cache empties the device and host tiers; the disk keeps the blocks, so the next turn hits again
    assert b.flush_cache()
    again = ask(b, nxt[0])
    assert again[:2] == ask(flat, nxt[0])[:2] and again[2] >= 256
    checked(b)


def test_a_corrupt_block_is_recomputed_with_identical_output(tiny_engine: Any, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    nxt = first_turns(tiny_model_dir, tmp_path)
    prev = nxt[2][:-2]  # conversation 2: 456 tokens of transcript, blocks 0..6 on disk
    (path,) = tmp_path.glob(f"*/blocks/*/{block_hash(prev, 3):016x}.kv")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    flat = tiny_engine(**DET)
    b = tiny_engine(**disk(tmp_path))
    got = ask(b, nxt[2])
    assert got[:2] == ask(flat, nxt[2])[:2]
    assert got[2] == 3 * 64  # blocks 0..2; from block 3 on the prompt is computed
    info = disk_info(b)
    assert info["corrupted"] == 1 and info["blocks_read"] == 3
    checked(b)


def test_another_fingerprint_ignores_the_blocks(tiny_engine: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    nxt = first_turns(tiny_model_dir, tmp_path)
    paged = tiny_engine(**disk(tmp_path, page_size=2))  # another page size: another fingerprint
    fast = tiny_engine(**{**disk(tmp_path), "enable_deterministic_inference": False})  # other kernels' KV
    for engine in (paged, fast):
        assert ask(engine, nxt[0])[2] == 0
        info = disk_info(engine)
        assert info["hit_tokens"] == 0 and info["blocks_read"] == 0
        checked(engine)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 3  # three fingerprints, three directories


def test_an_unusable_directory_is_a_start_up_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        Engine(model=str(tiny_model_dir), max_total_tokens=1024, dtype="float32", log_level="warning",
               **disk(blocker))
