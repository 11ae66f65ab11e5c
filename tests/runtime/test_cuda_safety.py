"""The CUDA path's safety rules, checked on CPU through their pure parts: every tensor a batch hands to the
worker stream is protected (a middle prompt chunk included), FlashInfer wrappers are re-planned only after
their previous plan's copy ran, the workspace is sized from the model and the device, explicit flashinfer
runs auto's checks, and a missing nvcc is a clear start-up error."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from radix.kv_storage import KVShape, KVStorage
from runtime.attention import make_attention_backend
from runtime.attention.base import AttentionShape
from runtime.attention.flashinfer_setup import (
    MIN_FLOAT_WORKSPACE,
    PlanGuard,
    check_flashinfer_usable,
    find_nvcc,
    float_workspace_bytes,
    require_nvcc,
)
from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.executor.worker import NextTokenTable, batch_tensors, protect_for_stream


class FakeCudaTensor:
    def __init__(self) -> None:
        self.is_cuda = True
        self.streams: list[Any] = []

    def record_stream(self, stream: Any) -> None:
        self.streams.append(stream)


def middle_chunk_batch() -> ForwardBatch:
    """A batch that is only a middle chunk of a prompt: 8 new tokens after 16, no logits row wanted."""
    kv = KVStorage(KVShape(1, 1, 8, torch.float32), 64, 1, "cpu")
    table = torch.arange(64, dtype=torch.int64).reshape(2, 32)
    return build_forward_batch([list(range(8))], [16], [0], table[0, 16:24], kv, table)


def test_every_tensor_of_a_batch_is_handed_over_including_a_middle_chunk() -> None:
    fb = middle_chunk_batch()
    got = batch_tensors(fb)
    tensor_fields = [f.name for f in dataclasses.fields(fb) if isinstance(getattr(fb, f.name), torch.Tensor)]
    assert len(tensor_fields) >= 8  # input_ids .. req_to_token: a field added later is covered by construction
    assert {id(t) for t in got} == {id(getattr(fb, n)) for n in tensor_fields}
    assert all(t is not fb.kv for t in got)  # the pool lives as long as the runner


def test_protect_marks_device_tensors_on_the_worker_stream_only() -> None:
    stream = object()
    fakes = [FakeCudaTensor() for _ in range(3)]
    assert protect_for_stream([*fakes, torch.zeros(2)], stream) == 3
    assert all(f.streams == [stream] for f in fakes)


def test_next_token_table_fills_rows_in_order() -> None:
    table = NextTokenTable(6, torch.device("cpu"))
    table.write([4, 1], torch.tensor([700, 300]))
    ids = torch.tensor([5, 0, 9, 0])
    table.fill(ids, [1, 3], [1, 4])
    assert ids.tolist() == [5, 300, 9, 700]
    table.fill(ids, [], [])  # nothing ahead: untouched
    assert ids.tolist() == [5, 300, 9, 700]


class FakeEvent:
    log: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.recorded = False
        self.synced = False

    def record(self) -> None:
        self.recorded = True
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        assert self.recorded
        self.synced = True
        FakeEvent.log.append("sync")


def test_plan_guard_waits_for_the_previous_plan_of_the_same_wrapper_only() -> None:
    FakeEvent.log = []
    guard = PlanGuard(FakeEvent)
    decode, prefill = object(), object()
    guard.before_plan(decode)  # first plan: nothing to wait for
    guard.after_plan(decode)
    guard.before_plan(prefill)  # another wrapper's buffer: no wait
    guard.after_plan(prefill)
    assert guard.waits == 0 and FakeEvent.log == ["record", "record"]
    guard.before_plan(decode)
    assert guard.waits == 1 and FakeEvent.log[-1] == "sync"
    guard.after_plan(decode)
    guard.before_plan(decode)
    assert guard.waits == 2


def test_workspace_is_sized_from_heads_and_sms() -> None:
    # 64 query / 8 KV heads, head dim 128, an H100's 132 SMs: FA2 split-KV needs ~133 MiB, more than 128 MiB
    big = float_workspace_bytes(64, 8, 128, 132)
    need = 64 * (2 * 132 // 8) * 128 * (128 + 1) * 4
    assert need > MIN_FLOAT_WORKSPACE and big >= need
    assert big - need < 4 * 2**20  # alignment slack only
    assert float_workspace_bytes(9, 3, 64, 132) == MIN_FLOAT_WORKSPACE  # small models keep the default
    assert float_workspace_bytes(64, 8, 128, 264) > big  # more SMs, more split work units
    with pytest.raises(ValueError):
        float_workspace_bytes(0, 8, 128, 132)


def test_explicit_flashinfer_runs_autos_checks() -> None:
    assert check_flashinfer_usable(torch.float32, 64) is not None
    assert check_flashinfer_usable(torch.bfloat16, 80) is not None
    assert check_flashinfer_usable(torch.bfloat16, 128) is None
    with pytest.raises(ValueError, match="float32 kernels"):
        make_attention_backend("flashinfer", AttentionShape(9, 3, 64), "cuda", torch.float32)
    with pytest.raises(ValueError, match="head dim 80"):
        make_attention_backend("flashinfer", AttentionShape(8, 8, 80), "cuda", torch.bfloat16)


def test_missing_nvcc_is_a_clear_start_up_error(tmp_path: Path) -> None:
    assert find_nvcc({}, lambda _name: None) in (None, "/usr/local/cuda/bin/nvcc")
    assert find_nvcc({"CUDA_HOME": str(tmp_path)}, lambda _name: "/x/nvcc") is None  # as given, FlashInfer-like
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert find_nvcc({"CUDA_HOME": str(tmp_path)}, lambda _name: None) == str(tmp_path / "bin" / "nvcc")
    assert find_nvcc({}, lambda _name: "/opt/cuda/bin/nvcc") == "/opt/cuda/bin/nvcc"
    with pytest.raises(RuntimeError, match="nvcc") as err:
        require_nvcc(find=lambda: None, prebuilt=lambda: False)
    assert "nvidia-cuda-nvcc" in str(err.value) or "CUDA_HOME=" in str(err.value)
    require_nvcc(find=lambda: None, prebuilt=lambda: True)  # prebuilt kernels: no compiler needed
    require_nvcc(find=lambda: "/usr/bin/nvcc", prebuilt=lambda: False)
