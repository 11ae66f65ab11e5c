"""The memory hierarchy under tensor parallelism: the host pool and the disk blocks hold every KV head (the
layout of an unsplit pool), gathered from the ranks on the way down and scattered back on the way up.

* ``HeadLayout``: each head is read from one rank, written to every rank holding it (replicas at tp 3 on
  the tiny model's 2 KV heads).
* Pages round-trip device → host → device bit for bit at tp 2 and 3, the host rows being every head in
  order (what tp 1 computes, up to the row-parallel sums' rounding); a decode step over the restored
  pages equals one over the originals, bit for bit, which it cannot unless every rank got its own heads.
* The host tier at tp 2: a working set larger than the device pool hits the host tier, with tp 1's greedy
  tokens (tests/oracle.py's rule) and, in deterministic mode, the flat cache's bits.
* The disk tier: a directory written at tp 2 is read at tp 1 and the other way round.

Every Engine ends with the KV books checked on every tier and its rank processes gone (``tp_engine``).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radix.host_pool import HostKVPool
from radix.kv_storage import KVShape, KVStorage
from runtime.config import ServerArgs
from runtime.core.forward_batch import build_forward_batch
from runtime.executor.model_runner import ModelRunner
from runtime.executor.tp_kv import HeadLayout
from runtime.models.tp_plan import plan_shards
from runtime.scheduler.cache_setup import kv_fingerprint
from tests.oracle import WITH_TOP2, assert_all_agree
from tests.runtime.test_tensor_parallel import rank_processes, tp_engine

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


# ---------------------------------------------------------------------- which rank holds which head
def test_head_layout_reads_each_head_once_and_writes_every_replica() -> None:
    def layout(heads: int, kv_heads: int, tp: int) -> HeadLayout:
        return HeadLayout.from_shards(plan_shards(heads, kv_heads, 128, 1024, tp))

    tiny2, tiny3 = layout(4, 2, 2), layout(4, 2, 3)
    assert tiny2.held == ((0, 1), (1, 2)) and tiny2.read_sizes == [1, 1] and tiny2.num_heads == 2
    # tp 3 over 2 KV heads: ranks 0 and 1 hold replicas of head 0; a read takes it from rank 0 only
    assert tiny3.held == ((0, 1), (0, 1), (1, 2)) and tiny3.sources == ((0, 1), (1, 1), (0, 1))
    assert tiny3.read_sizes == [1, 0, 1] and tiny3.write_sizes == [1, 1, 1]
    smol2, smol4 = layout(9, 3, 2), layout(9, 3, 4)
    assert smol2.read_sizes == [2, 1] and smol2.write_sizes == [2, 1]
    assert smol4.held == ((0, 1), (0, 1), (1, 2), (2, 3)) and smol4.read_sizes == [1, 0, 1, 1]
    for heads, kv, tp in ((9, 3, 9), (8, 8, 3), (32, 8, 16)):
        lay = layout(heads, kv, tp)
        assert sum(lay.read_sizes) == kv == lay.num_heads  # every head read exactly once, in order


# ---------------------------------------------------------------------- pages, bit for bit
def runner(model: Path, tp: int) -> ModelRunner:
    return ModelRunner(ServerArgs(model=str(model), tp_size=tp, max_total_tokens=1024, dtype="float32",
                                  log_level="warning"))


def prefill(r: ModelRunner, row: int, tokens: list[int]) -> torch.Tensor:
    """Compute ``tokens`` into fresh slots of table row ``row``; returns the slots."""
    slots = r.allocator.alloc(len(tokens))
    r.req_to_token.table[row, : len(tokens)] = slots
    fb = build_forward_batch([tokens], [0], [row], slots, r.kv, r.req_to_token.table, r.device)
    r.forward(fb, fb.last_token_rows())
    return slots


def decode(r: ModelRunner, row: int, prefix: torch.Tensor, token: int) -> torch.Tensor:
    """The logits of one decode step of ``token`` after the KV in ``prefix`` (table row ``row``)."""
    n = int(prefix.numel())
    slot = r.allocator.alloc(1)
    r.req_to_token.table[row, :n] = prefix
    r.req_to_token.table[row, n] = slot[0]
    fb = build_forward_batch([[token]], [n], [row], slot, r.kv, r.req_to_token.table, r.device)
    return r.forward(fb, fb.last_token_rows())


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def tp1_pages(tiny_model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    r = runner(tiny_model_dir, 1)
    try:
        return r.kv_pages.read(prefill(r, 0, PROMPT))
    finally:
        r.close()


@pytest.mark.parametrize("tp", [2, 3])
def test_pages_round_trip_device_host_device_bit_exact(tiny_model_dir: Path,
                                                       tp1_pages: tuple[torch.Tensor, torch.Tensor], tp: int) -> None:
    r = runner(tiny_model_dir, tp)
    try:
        assert r.kv_pages.shape == KVShape(2, 2, 16, torch.float32)  # every head, not rank 0's
        slots = prefill(r, 0, PROMPT)
        k, v = r.kv_pages.read(slots)
        # the heads in order, each what tp 1 computed (up to the rounding of the row-parallel sums)
        torch.testing.assert_close(k, tp1_pages[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, tp1_pages[1], rtol=1e-4, atol=1e-4)
        lo, hi = plan_shards(4, 2, 128, 49152, tp)[0].kv_heads
        assert torch.equal(bits(r.kv.read(slots)[0]), bits(k[:, :, lo:hi]))  # rank 0's own shard
        pool = HostKVPool.for_device(r.kv_pages, 64)
        host, handle = pool.backup(r.kv_pages, slots)
        handle.wait()
        assert torch.equal(bits(pool.k_buffer[:, host]), bits(k)) and torch.equal(bits(pool.v_buffer[:, host]), bits(v))
        fresh = r.allocator.alloc(len(PROMPT))
        pool.restore(host, r.kv_pages, fresh).wait()
        k2, v2 = r.kv_pages.read(fresh)
        assert torch.equal(bits(k2), bits(k)) and torch.equal(bits(v2), bits(v))
        # every rank attends over its own heads of the restored slots: equal logits need each rank's heads
        # (replicas included) to have landed where they were read from
        assert torch.equal(bits(decode(r, 1, fresh, 7)), bits(decode(r, 2, slots, 7)))
    finally:
        r.close()
    assert rank_processes() == []


# ---------------------------------------------------------------------- the host tier in the scheduler
POOL = 1024  # the device pool holds about three of the conversations below


def conversations(n: int, length: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(n)]


def rounds(engine: Any, prompts: list[list[int]], turns: int) -> list[dict[str, Any]]:
    """Every conversation takes a turn after the other (so each evicts the older ones), ``turns`` times; a
    turn extends the prompt by fixed tokens (not by the output, so that runs which part at a near tie still
    ask the same prompts). The books of both tiers are checked after every round."""
    out = []
    for t in range(turns):
        for i, ids in enumerate(prompts):
            out.append(engine.generate(input_ids=ids + [100 + t, 200 + i] * t, sampling_params=GREEDY, **WITH_TOP2))
        report = engine.check_integrity()  # raises on a broken rule of either tier
        assert report["private"] == 0 and report["protected"] == 0, report
        if "host_capacity" in report:
            assert report["host_free"] + report["host_held"] == report["host_capacity"], report
    return out


def host_hits(engine: Any) -> int:
    tiers = engine.server_info()["cache"]["tiers"]
    assert tiers["device"]["hit_tokens"] + tiers["host"]["hit_tokens"] == engine.server_info()["cache"]["hit_tokens"]
    return int(tiers["host"]["hit_tokens"])


def test_host_tier_at_tp2_hits_the_host_with_tp1_tokens(tiny_model_dir: Path) -> None:
    prompts = conversations(5, 300)
    tiered = {"max_total_tokens": POOL, "enable_hierarchical_cache": True, "hicache_ratio": 8}
    with tp_engine(tiny_model_dir, 1, **tiered) as eng:
        reference = rounds(eng, prompts, 3)
    with tp_engine(tiny_model_dir, 2, **tiered) as eng:
        got = rounds(eng, prompts, 3)
        assert host_hits(eng) > 2 * 300  # later turns came back from the host, not recomputed
        assert eng.server_info()["cache"]["tiers"]["host"]["bytes_to_device"] > 0
    assert_all_agree(reference, got, "host tier, tp 2 against tp 1")


def test_host_tier_at_tp2_deterministic_equals_the_flat_cache_bit_for_bit(tiny_model_dir: Path) -> None:
    """Deterministic mode promises batch invariance at any tp size, not equality across sizes: at tp 2 a
    prefix loaded back from the host must give the bits that recomputing it gives."""
    prompts = conversations(5, 300, seed=4)
    det = {"max_total_tokens": POOL, "enable_deterministic_inference": True}
    with tp_engine(tiny_model_dir, 2, **det) as eng:
        flat = rounds(eng, prompts, 2)
    with tp_engine(tiny_model_dir, 2, enable_hierarchical_cache=True, hicache_ratio=8, **det) as eng:
        tiered = rounds(eng, prompts, 2)
        assert host_hits(eng) > 300
    for a, b in zip(flat, tiered):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


# ---------------------------------------------------------------------- the disk tier across tp sizes
def test_the_kv_fingerprint_names_the_tp_size_only_where_kv_bits_depend_on_it() -> None:
    """Blocks hold every head, and KV differs across tp sizes by rounding only: one directory for every
    tp size, except in deterministic mode (bits promised per tp size) and int8 (scales per shard)."""
    def digest(**options: Any) -> str:
        args = ServerArgs(model="random:tiny", **options)
        runner = SimpleNamespace(hf_config=SimpleNamespace(), random_weights=True, device=torch.device("cpu"),
                                 model_path=Path("/nonexistent"), kv_pages=KVStorage(KVShape(2, 2, 16), 16))
        return kv_fingerprint(args, runner).digest()

    assert digest(tp_size=2) == digest(tp_size=1) == digest(tp_size=3)
    assert digest(tp_size=2, enable_deterministic_inference=True) != digest(enable_deterministic_inference=True)
    assert digest(tp_size=2, quantization="int8") != digest(quantization="int8")


def disk(path: Path) -> dict[str, Any]:
    return {"enable_hierarchical_cache": True, "hicache_storage_backend": "file", "hicache_storage_dir": str(path),
            "max_total_tokens": 4096}


def drained(engine: Any) -> dict[str, Any]:
    deadline = time.time() + 30
    while (info := engine.server_info()["cache"]["tiers"]["disk"])["queued_blocks"]:
        assert time.time() < deadline, "the disk writer did not drain"
        time.sleep(0.02)
    return info


def ask(engine: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [engine.generate(input_ids=p, sampling_params=GREEDY, **WITH_TOP2) for p in prompts]


def three_turns() -> list[list[list[int]]]:
    """Three turns of four conversations: each turn's prompt extends the previous one by 70 tokens."""
    rng = random.Random(11)
    turns = [conversations(4, 200, seed=12)]
    for _ in range(2):
        turns.append([p + [rng.randrange(3, 2000) for _ in range(70)] for p in turns[-1]])
    return turns


def test_a_disk_directory_is_shared_between_tp_sizes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """tp 2 writes turn 1; a fresh tp 1 reads it back for turn 2 (and writes turn 2's new blocks); a fresh
    tp 2 reads those for turn 3, the blocks of both writers. Each reader's tokens are a flat tp 1 cache's
    (oracle rule)."""
    stages = three_turns()
    with tp_engine(tiny_model_dir, 1, max_total_tokens=4096) as eng:
        reference = [ask(eng, turn) for turn in stages]
    with tp_engine(tiny_model_dir, 2, **disk(tmp_path)) as eng:
        assert_all_agree(reference[0], ask(eng, stages[0]), "tp 2 writing")
        assert drained(eng)["blocks_written"] == 4 * (200 // 64)
    for tp, turn in ((1, 1), (2, 2)):
        with tp_engine(tiny_model_dir, tp, **disk(tmp_path)) as eng:
            got = ask(eng, stages[turn])
            assert_all_agree(reference[turn], got, f"tp {tp} reading turn {turn}")
            written_before = 200 + 70 * (turn - 1)  # the earlier turn's prompt, whole blocks of it on disk
            for g in got:
                assert g["meta_info"]["cached_tokens"] == written_before // 64 * 64, g["meta_info"]
            info = drained(eng)
            assert info["hit_tokens"] == 4 * (written_before // 64 * 64) and info["corrupted"] == 0, info
