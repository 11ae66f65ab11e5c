"""CUDA graphs and overlap scheduling on a GPU: on vs off agree under the float-aware oracle in bf16 (graphs
and overlap change batch shapes and KV splits, so near-ties may flip; tests/cuda/bf16.py), and KV accounting
balances after every scenario (skipped without CUDA; needs the 'gpu' extra for graphs). Bit equality of
overlap vs lockstep, seeded sampling included, is tested on CPU in deterministic mode (test_overlap.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.cuda.bf16 import REFERENCE, assert_bf16_agree

pytestmark = pytest.mark.cuda

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three prime numbers:", "Once upon a time", "Translate 'cat' to French:",
           "The square root of 144 is"]


def engine(**opts):
    from runtime.engine import Engine

    base = dict(device="cuda", dtype="bfloat16", max_total_tokens=65536, log_level="warning")
    base.update(opts)
    return Engine(model=base.pop("model", "default"), **base)


def greedy(e, prompts, n=16):
    """Greedy results with their top-2 logprobs (each one a reference for the oracle)."""
    return e.generate(prompts, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **REFERENCE)


def assert_clean(e):
    report = e.check_integrity()
    assert report["private"] == 0 and report["protected"] == 0, report


@pytest.mark.parametrize("page_size", [1, 16])
def test_graphs_on_vs_off_identical_tokens(page_size):
    pytest.importorskip("flashinfer")
    # 1, 3, 5 and 7 requests: graph sizes 1, 4, 8 (padding rows) — and 7 prompts at once
    batches = [PROMPTS[:1], PROMPTS[:3], PROMPTS[:5], PROMPTS]
    common = dict(attention_backend="flashinfer", page_size=page_size, disable_overlap_schedule=True)
    with engine(disable_cuda_graph=True, **common) as e:
        ref = [greedy(e, b) for b in batches]
        assert e.runner.graph_runner is None
        assert_clean(e)
    with engine(cuda_graph_max_bs=16, **common) as e:
        runner = e.runner.graph_runner
        assert runner is not None and runner.sizes == [1, 2, 4, 8, 16]
        assert runner.capture_seconds > 0
        got = [greedy(e, b) for b in batches]
        assert_clean(e)
    for r, g in zip(ref, got):
        assert_bf16_agree(r, g, "graphs on vs off")


def test_graph_replay_matches_eager_hidden_states():
    pytest.importorskip("flashinfer")
    from runtime.core.forward_batch import build_forward_batch

    with engine(model="random:smollm2-135m", attention_backend="flashinfer", cuda_graph_max_bs=8,
                disable_overlap_schedule=True) as e:
        runner = e.runner
        assert runner.graph_runner is not None
        # three requests with 10 / 33 / 17 tokens of KV: slots straight from the allocator
        lens = [10, 33, 17]
        rows = [runner.req_to_token.alloc() for _ in lens]
        for r, n in zip(rows, lens):
            runner.req_to_token.write(r, 0, runner.allocator.alloc(n))
        out_loc = torch.stack([runner.req_to_token.table[r, n - 1] for r, n in zip(rows, lens)])
        ids = [[random.randrange(10, 40000)] for _ in lens]

        def batch():
            return build_forward_batch(ids, [n - 1 for n in lens], rows, out_loc, runner.kv,
                                       runner.req_to_token.table, runner.device)

        eager = runner.model.forward(batch()).float()
        graphed = runner.graph_runner.replay(batch()).float()
        assert graphed.shape == eager.shape
        assert float((graphed - eager).norm() / eager.norm()) < 2e-2


@pytest.mark.parametrize("graphs", [False, True])
def test_overlap_on_vs_off_agree(graphs):
    has_fi = True
    try:
        import flashinfer  # noqa: F401
    except Exception:
        has_fi = False
    if graphs and not has_fi:
        pytest.skip("graphs need flashinfer")
    backend = "flashinfer" if has_fi else "torch_native"
    common = dict(attention_backend=backend, disable_cuda_graph=not graphs)
    # greedy (the oracle's domain), lengths that end at different steps so rows are discarded in flight
    params = [{"max_new_tokens": 8 + 3 * i, "temperature": 0, "ignore_eos": True} for i in range(len(PROMPTS))]
    with engine(disable_overlap_schedule=True, **common) as e:
        ref = e.generate(PROMPTS, params, **REFERENCE)
        assert not e.scheduler.overlap
        assert_clean(e)
    with engine(**common) as e:
        assert e.scheduler.overlap  # on by default on CUDA
        got = e.generate(PROMPTS, params, **REFERENCE)
        again = e.generate(PROMPTS, params, **REFERENCE)
        assert_clean(e)
    assert_bf16_agree(ref, got, "overlap on vs off")
    assert_bf16_agree(ref, again, "overlap on vs off, warm cache")


def test_overlap_with_retraction_and_chunking_on_gpu():
    with engine(max_total_tokens=512, chunked_prefill_size=64, schedule_conservativeness=0.01) as lock_free:
        assert lock_free.scheduler.overlap
        prompts = [list(range(100 + i, 180 + i)) for i in range(8)]
        got = lock_free.generate(input_ids=prompts, sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                                     "ignore_eos": True}, **REFERENCE)
        assert_clean(lock_free)
    with engine(max_total_tokens=512, chunked_prefill_size=64, schedule_conservativeness=0.01,
                disable_overlap_schedule=True) as lock:
        ref = lock.generate(input_ids=prompts, sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                                "ignore_eos": True}, **REFERENCE)
        assert_clean(lock)
    assert_bf16_agree(ref, got, "overlap with retraction and chunking")


def test_kv_pool_sized_after_weights_and_graphs():
    pytest.importorskip("flashinfer")
    from runtime.engine import Engine

    with Engine(model="random:smollm2-135m", device="cuda", log_level="warning", cuda_graph_max_bs=32) as e:
        runner = e.runner
        assert runner.args.dtype == "bfloat16"  # the GPU default
        assert runner.graph_runner is not None
        free, total = torch.cuda.mem_get_info()
        # the pool took ~85% of what was free after weights minus the graph reserve; the graphs fit in the rest
        assert runner.kv.nbytes > 0.5 * total
        assert free > runner.graph_runner.memory_bytes


def test_the_next_engine_gets_the_memory_a_stopped_one_gave_back():
    """``e`` still holds the first Engine while the second sizes its pool from the free memory."""
    sized = dict(model="random:smollm2-135m", cuda_graph_max_bs=8, max_total_tokens=None)  # from free memory
    with engine(**sized) as e:
        first = e.runner.allocator.capacity
        e.generate(input_ids=[list(range(10, 50))], sampling_params={"max_new_tokens": 4})
        assert_clean(e)
    with engine(**sized) as e:
        second = e.runner.allocator.capacity
    assert second > 0.9 * first, (first, second)
