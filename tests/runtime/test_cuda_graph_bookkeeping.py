"""CUDA-graph bookkeeping on CPU: captured sizes, bucket lookup, padding of static inputs, memory reserve,
and the runner's refusal off CUDA / with a backend that cannot be captured."""

from __future__ import annotations

import pytest
import torch

from runtime.attention import make_attention_backend
from runtime.attention.base import AttentionShape
from runtime.executor.cuda_graph import (
    CudaGraphRunner,
    bucket_for,
    capture_batch_sizes,
    fill_static,
    graph_memory_reserve,
    max_graph_pages,
    padding_rows,
)


def test_capture_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))
    assert len(sizes) == 4 + 31
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


@pytest.mark.parametrize("max_bs", [1, 7, 64, 100, 256])
def test_every_batch_up_to_the_max_has_the_smallest_bucket(max_bs):
    sizes = capture_batch_sizes(max_bs)
    for b in range(1, max_bs + 1):
        bucket = bucket_for(b, sizes)
        assert bucket is not None and bucket >= b
        assert not [s for s in sizes if b <= s < bucket]
        assert 0 <= padding_rows(b, bucket) < 8
    assert bucket_for(max_bs + 1, sizes) is None
    assert bucket_for(0, sizes) is None


def test_fill_static_pads_the_tail():
    static = torch.full((10,), -7, dtype=torch.int64)
    fill_static(static, torch.tensor([5, 6, 7]), 8)
    assert static.tolist() == [5, 6, 7, 0, 0, 0, 0, 0, -7, -7]  # rows past the bucket untouched
    fill_static(static, torch.tensor([1, 2]), 2, pad_value=3)
    assert static[:4].tolist() == [1, 2, 7, 0]  # past the bucket of 2: untouched
    with pytest.raises(ValueError):
        fill_static(static, torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError):
        fill_static(static, torch.tensor([1]), 11)


def test_memory_reserve_and_index_buffer_sizes():
    assert max_graph_pages(4, 100, 16) == 4 * 7 + 4
    assert graph_memory_reserve([], 4096, 14336, 32, 8, 128, torch.bfloat16, 8192, 1) == 0
    sizes = capture_batch_sizes(256)
    reserve = graph_memory_reserve(sizes, 4096, 14336, 32, 8, 128, torch.bfloat16, 8192, 1)
    # 8B shape: tens of MB of activations, 35 wrappers x 8 MiB, 8 MB of indices: well under 1 GB
    assert 300e6 < reserve < 1e9


def test_runner_refuses_cpu_and_uncapturable_backends():
    shape = AttentionShape(4, 2, 16)
    backend = make_attention_backend("torch_native", shape)
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaGraphRunner(None, backend, None, torch.zeros(1, 1), 8, 64, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="cannot be captured"):
        CudaGraphRunner(None, backend, None, torch.zeros(1, 1), 8, 64, torch.device("cuda"))


def test_flashinfer_backend_errors_clearly_without_cuda():
    shape = AttentionShape(4, 2, 16)
    with pytest.raises(RuntimeError, match="CUDA devices only"):
        make_attention_backend("flashinfer", shape, "cpu")
    assert make_attention_backend("auto", shape, "cpu").name == "torch_native"
