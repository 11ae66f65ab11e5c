"""FlashInfer backend vs the torch_native oracle on a GPU (skipped without CUDA; needs the 'gpu' extra).

Run on a GPU machine: ``pytest -q tests/cuda`` (the first run JIT-compiles FlashInfer's kernels: minutes).
"""

from __future__ import annotations

import random

import pytest
import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.kv_storage import KVShape, KVStorage
from runtime.attention.base import AttentionShape
from runtime.attention.flashinfer_plan import build_paged_kv_index, plan_batch
from runtime.attention.torch_native import TorchNativeBackend
from runtime.core.forward_batch import build_forward_batch
from tests.cuda.bf16 import REFERENCE, assert_bf16_agree

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")


def flashinfer_backend(shape: AttentionShape):
    pytest.importorskip("flashinfer", reason="install the 'gpu' extra (flashinfer-python)")
    from runtime.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(shape, DEV)


def grown_table(page_size: int, lens: list[int], seed: int, shared_pages: int = 0):
    """Rows grown a few tokens at a time, interleaved (scattered pages), the first ``shared_pages`` pages
    shared by every row (a cached prefix); allocator and table as the scheduler uses them."""
    rng = random.Random(seed)
    alloc = PagedAllocator(8192, page_size)
    pool = ReqToTokenPool(len(lens) + 1, max(lens) + 16)
    rows = [pool.alloc() for _ in lens]
    cur = [0] * len(lens)
    if shared_pages:
        first = alloc.alloc(shared_pages * page_size)
        for r in rows:
            pool.write(r, 0, first)
        cur = [shared_pages * page_size] * len(lens)
    while any(c < n for c, n in zip(cur, lens)):
        i = rng.randrange(len(lens))
        if cur[i] >= lens[i]:
            continue
        step = min(lens[i] - cur[i], rng.choice([1, 2, page_size + 3]))
        last = int(pool.table[rows[i], cur[i] - 1]) if cur[i] else 0
        pool.write(rows[i], cur[i], alloc.alloc_extend(cur[i], last, step))
        cur[i] += step
    return alloc, pool.table.to(DEV), rows


def run_both(shape, page_size, prefix, extend, dtype=torch.bfloat16, shared_pages=0, seed=0):
    torch.manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, extend)]
    alloc, table, rows = grown_table(page_size, lens, seed, shared_pages)
    kv = KVStorage(KVShape(1, shape.num_kv_heads, shape.head_dim, dtype), alloc.total_slots, page_size, DEV)
    kv.k_buffer.normal_()
    kv.v_buffer.normal_()
    out_loc = torch.cat([table[r, p:n] for r, p, n in zip(rows, prefix, lens)])
    fb = build_forward_batch([[1] * e for e in extend], prefix, rows, out_loc, kv, table, DEV)
    t = fb.num_tokens
    q = torch.randn(t, shape.num_heads, shape.head_dim, device=DEV, dtype=dtype)
    k = torch.randn(t, shape.num_kv_heads, shape.head_dim, device=DEV, dtype=dtype)
    v = torch.randn(t, shape.num_kv_heads, shape.head_dim, device=DEV, dtype=dtype)
    oracle = TorchNativeBackend(shape, DEV, cascade=None)
    oracle.plan(fb)
    ref = oracle.forward(q, k, v, 0, fb).float()
    fi = flashinfer_backend(shape)
    fb.attn_metadata = None
    fi.plan(fb)
    got = fi.forward(q, k, v, 0, fb).float()
    return got, ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


SHAPES = [AttentionShape(8, 2, 64), AttentionShape(32, 8, 128), AttentionShape(9, 3, 64), AttentionShape(28, 4, 128)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.num_heads}kv{s.num_kv_heads}d{s.head_dim}")
def test_mixed_prefill_decode_with_cached_prefixes(page_size, shape):
    prefix = [0, 37, 16, 5, 64, 1, 200, 129]
    extend = [9, 1, 20, 1, 3, 1, 1, 40]
    got, ref = run_both(shape, page_size, prefix, extend)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.num_heads}kv{s.num_kv_heads}d{s.head_dim}")
def test_pure_decode_batch(page_size, shape):
    prefix = [0, 15, 16, 17, 300, 1023, 64, 5]
    got, ref = run_both(shape, page_size, prefix, [1] * len(prefix), shared_pages=0, seed=1)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_sharing_prefix_pages(page_size):
    shape = AttentionShape(8, 2, 128)
    prefix = [48, 48, 50, 70]
    extend = [1, 7, 1, 12]
    got, ref = run_both(shape, page_size, prefix, extend, shared_pages=48 // page_size, seed=2)
    assert rel_err(got, ref) < 1e-2


def test_planning_on_the_device_equals_the_cpu():
    ps = 16
    lens = [5, 40, 77, 16]
    _alloc, table, rows = grown_table(ps, lens, 3)
    on_gpu = build_paged_kv_index(table, torch.tensor(rows, device=DEV), lens, ps)
    on_cpu = build_paged_kv_index(table.cpu(), torch.tensor(rows), lens, ps)
    assert on_gpu.kv_indices.device.type == "cuda"
    assert on_gpu.kv_indices.cpu().tolist() == on_cpu.kv_indices.tolist()
    assert on_gpu.kv_indptr.tolist() == on_cpu.kv_indptr.tolist()
    kv = KVStorage(KVShape(1, 1, 8, torch.bfloat16), 8192 + ps, ps, DEV)
    fb = build_forward_batch([[1]] * 4, [n - 1 for n in lens], rows,
                             torch.stack([table[r, n - 1] for r, n in zip(rows, lens)]), kv, table, DEV)
    assert plan_batch(fb).is_decode


# ---------------------------------------------------------------------- end to end on SmolLM2
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three prime numbers:", "Once upon a time"]


def greedy(engine, n: int = 12) -> list[dict]:
    """Greedy results with their top-2 logprobs (references for the float-aware oracle)."""
    return engine.generate(PROMPTS, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **REFERENCE)


@pytest.mark.parametrize("page_size", [1, 16])
def test_smollm2_greedy_agrees_across_backends(page_size):
    """bf16 kernels that sum in another order may flip a near-tie: the oracle (tests/cuda/bf16.py) decides."""
    pytest.importorskip("flashinfer")
    from runtime.engine import Engine

    common = dict(device="cuda", dtype="bfloat16", max_total_tokens=65536, page_size=page_size,
                  disable_cuda_graph=True, disable_overlap_schedule=True, log_level="warning")
    with Engine(model="default", attention_backend="torch_native", **common) as e:
        ref = greedy(e)
    with Engine(model="default", attention_backend="flashinfer", **common) as e:
        assert e.runner.attn_backend.name == "flashinfer"
        got = greedy(e)
        report = e.check_integrity()
    assert_bf16_agree(ref, got, "flashinfer vs torch_native")
    assert report["private"] == 0 and report["protected"] == 0


def test_auto_picks_flashinfer_on_cuda_with_bf16():
    pytest.importorskip("flashinfer")
    from runtime.attention import auto_backend_name

    assert auto_backend_name("cuda", torch.bfloat16, AttentionShape(9, 3, 64)) == "flashinfer"
    assert auto_backend_name("cuda", torch.float32, AttentionShape(9, 3, 64)) == "torch_native"
    assert auto_backend_name("cuda", torch.bfloat16, AttentionShape(4, 2, 16)) == "torch_native"
    assert auto_backend_name("cpu", torch.bfloat16) == "torch_native"
