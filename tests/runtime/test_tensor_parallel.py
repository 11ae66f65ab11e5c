"""Tensor parallelism (``--tp-size``): the shard plan, start-up errors, and greedy tokens at tp 2 and 3 against
tp 1 — on the tiny model (loaded from safetensors, and drawn as ``random:tiny``) and on SmolLM2-135M.

Default-mode runs compare with tests/oracle.py: a row-parallel layer sums its K dimension in tp pieces, which
reorders fp32 additions, exactly like the batch-composition changes the oracle was built for. Deterministic
mode promises batch invariance (not equality across tp sizes): at tp 3 a request alone and the same request
in a batch must agree bit for bit (gloo's ring all-reduce would break that; ``TPComm`` sums in rank order).
Every Engine ends with the KV accounting checked (``checked_engine``) and its rank processes gone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import ServerArgs, add_server_args, server_args_from_namespace
from runtime.core.forward_batch import build_forward_batch
from runtime.executor.model_runner import ModelRunner
from runtime.executor.tp_ranks import RankStartError
from runtime.models.tp_plan import TPConfigError, plan_shards
from tests.conftest import checked_engine
from tests.oracle import WITH_TOP2, assert_all_agree

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Here is a short story about a lighthouse keeper who lived alone on a rock",
           "Here is a short story about a lighthouse keeper who"]  # shares a prefix with the one before


def rank_processes() -> list[Any]:
    return [p for p in mp.active_children() if p.name.startswith("radixserve-tp-rank-")]


@contextmanager
def tp_engine(model: str | Path, tp: int, **options: Any) -> Iterator[Any]:
    """An Engine at ``tp``; after it, the KV invariant held and no rank process is left."""
    options.setdefault("dtype", "float32")
    options.setdefault("max_total_tokens", 8192)
    with checked_engine(model, tp_size=tp, **options) as eng:
        try:
            yield eng
        finally:
            eng.runner.close()
    assert rank_processes() == [], rank_processes()


def greedy(eng: Any, new: int, prompts: list[str] = PROMPTS) -> list[dict[str, Any]]:
    return eng.generate(prompts, {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}, **WITH_TOP2)


# ---------------------------------------------------------------------- the plan
def test_plan_splits_smollm2_heads_for_every_size() -> None:
    """9 query / 3 KV heads: tp 3 splits the groups; tp 2 gives whole groups unevenly (no replication);
    tp 4 and 9 share groups between ranks, each with a replica of the group's KV head."""
    def heads(tp: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        return [(s.q_heads, s.kv_heads) for s in plan_shards(9, 3, 1536, 49152, tp)]

    assert heads(3) == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]
    assert heads(2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert heads(4) == [((0, 2), (0, 1)), ((2, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]
    assert [s.num_heads for s in plan_shards(9, 3, 1536, 49152, 9)] == [1] * 9
    for tp in (1, 2, 3, 4, 9):
        shards = plan_shards(9, 3, 1536, 49152, tp)
        assert sum(s.num_heads for s in shards) == 9  # every query head exactly once
        assert sum(s.inter_size for s in shards) == 1536 and sum(s.vocab_size for s in shards) == 49152
        for s in shards:  # each rank's heads read only the KV heads it holds (group size 3)
            assert s.kv_heads == (s.q_heads[0] // 3, (s.q_heads[1] - 1) // 3 + 1)
            assert s.num_heads % s.num_kv_heads == 0
    with pytest.raises(TPConfigError, match="larger than the model's 9 attention heads"):
        plan_shards(9, 3, 1536, 49152, 10)


def test_flag_alias_and_validation() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_args_from_namespace(parser.parse_args(["--tp", "3"])).tp_size == 3
    assert server_args_from_namespace(parser.parse_args(["--tp-size", "2"])).tp_size == 2
    assert "Tensor parallelism" in parser.format_help()
    with pytest.raises(ValueError, match="tp_size: must be >= 1"):
        ServerArgs(tp_size=0).validate()
    # the memory hierarchy copies every rank's heads (tests/runtime/test_tensor_parallel_tiers.py)
    ServerArgs(tp_size=2, enable_hierarchical_cache=True, hicache_storage_backend="file",
               hicache_storage_dir="/tmp/kv").validate()


def test_a_size_the_model_cannot_split_fails_before_any_rank_starts() -> None:
    with pytest.raises(TPConfigError, match="--tp-size 5 is larger than the model's 4 attention heads"):
        ModelRunner(ServerArgs(model="random:tiny", tp_size=5, max_total_tokens=256, log_level="warning"))
    assert rank_processes() == []


# ---------------------------------------------------------------------- same tokens as tp 1
@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Path) -> list[dict[str, Any]]:
    with tp_engine(tiny_model_dir, 1) as eng:
        return greedy(eng, 12)


@pytest.mark.parametrize("tp", [2, 3])
def test_tiny_model_greedy_matches_tp1(tiny_model_dir: Path, tiny_reference: list[dict[str, Any]], tp: int) -> None:
    """4 query / 2 KV heads: tp 2 splits the groups, tp 3 replicates a KV head. Small chunks and a shared
    prefix make the page-table rows each step broadcasts include cached and earlier-chunk KV; tp 3 runs the
    overlap loop (the forward, and so the broadcast, on the worker thread, input ids filled from the
    previous step's samples before the broadcast)."""
    with tp_engine(tiny_model_dir, tp, chunked_prefill_size=8, enable_overlap_schedule=tp == 3) as eng:
        assert_all_agree(tiny_reference, greedy(eng, 12), f"tiny model, tp {tp}")
        again = greedy(eng, 12)  # now from the radix cache: prefixes matched, not recomputed
        assert_all_agree(tiny_reference, again, f"tiny model, tp {tp}, cached")
        assert again[0]["meta_info"]["cached_tokens"] > 0


def test_random_model_shards_draw_the_tp1_weights() -> None:
    """``random:tiny`` at tp 2: each rank draws the full tensors and keeps its shard, so the logits of a
    prefill and a decode step equal tp 1's up to float order."""
    def logits(tp: int) -> list[torch.Tensor]:
        r = ModelRunner(ServerArgs(model="random:tiny", tp_size=tp, max_total_tokens=256, dtype="float32",
                                   log_level="warning"))
        try:
            table = r.req_to_token.table
            slots = r.allocator.alloc(8)
            table[0, :5], table[1, :3] = slots[:5], slots[5:]
            fb = build_forward_batch([[5, 6, 7, 8, 9], [10, 11, 12]], [0, 0], [0, 1], slots, r.kv, table, r.device)
            out = [r.forward(fb, fb.last_token_rows())]
            step = r.allocator.alloc(2)
            table[0, 5], table[1, 3] = step[0], step[1]
            fb = build_forward_batch([[3], [4]], [5, 3], [0, 1], step, r.kv, table, r.device)
            return [*out, r.forward(fb, fb.last_token_rows())]
        finally:
            r.close()

    for a, b in zip(logits(1), logits(2)):
        assert a.shape == b.shape == (2, 49152)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def smol_reference(smol_dir: Path) -> list[dict[str, Any]]:
    with tp_engine("default", 1) as eng:
        return greedy(eng, 10, PROMPTS[:2])


@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_greedy_matches_tp1(smol_reference: list[dict[str, Any]], tp: int) -> None:
    with tp_engine("default", tp) as eng:
        assert_all_agree(smol_reference, greedy(eng, 10, PROMPTS[:2]), f"SmolLM2, tp {tp}")


def test_deterministic_mode_is_batch_invariant_at_tp3(tiny_model_dir: Path) -> None:
    with tp_engine(tiny_model_dir, 3, enable_deterministic_inference=True) as eng:
        alone = [greedy(eng, 8, [p])[0] for p in PROMPTS]
        eng.flush_cache()
        together = greedy(eng, 8)
    for a, b in zip(alone, together):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


# ---------------------------------------------------------------------- failures
def test_a_rank_killed_while_serving_is_named_and_nothing_is_left(tiny_model_dir: Path) -> None:
    """In the Engine (the user's process) a dead rank fails the next step with its name and the scheduler
    thread stops; closing leaves no process behind."""
    from runtime.engine import Engine

    eng = Engine(model=str(tiny_model_dir), tp_size=2, dtype="float32", max_total_tokens=4096, log_level="error")
    try:
        greedy(eng, 2)
        report = eng.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
        (rank1,) = rank_processes()
        rank1.kill()
        rank1.join(10)
        with pytest.raises(Exception) as info:
            greedy(eng, 2)
        assert "tensor-parallel rank 1" in _messages(info.value), _messages(info.value)
    finally:
        eng.shutdown()
        eng.runner.close()
    assert rank_processes() == []


def _messages(exc: BaseException | None) -> str:
    out = []
    while exc is not None:
        out.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(out)


def test_a_rank_dying_during_start_up_is_named() -> None:
    """A rank killed while it loads: the runner raises RankStartError naming it, and kills the rest."""
    errors: list[BaseException] = []

    def build() -> None:
        try:
            ModelRunner(ServerArgs(model="random:tiny", tp_size=3, max_total_tokens=256, log_level="warning"))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=build)
    t.start()
    deadline = time.monotonic() + 60
    while not (victims := [p for p in rank_processes() if p.name.endswith("-2")]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victims[0].kill()
    t.join(120)
    assert len(errors) == 1 and isinstance(errors[0], RankStartError), errors
    assert "tensor-parallel rank 2" in str(errors[0]) and "killed by signal SIGKILL" in str(errors[0])
    assert rank_processes() == []
