"""Attention through FlashInfer's paged kernels (CUDA only; the optional ``gpu`` extra).

The pool is already in FlashInfer's NHD paged layout (``KVStorage.paged_view``: ``[pages, page_size,
kv_heads, head_dim]``), so the kernels read it in place. Per batch, ``plan()`` builds the page table
(``flashinfer_plan``: ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len`` / ``qo_indptr``, vectorised, no
host sync) and plans ONE wrapper:

* a pure decode batch (every request adds one token) -> ``BatchDecodeWithPagedKVCacheWrapper``;
* anything else (prefill chunks over cached prefixes, mixed with decodes) ->
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``. ``forward`` writes the new tokens' K/V into
  the pool first, so one paged pass over each request's whole KV (prefix + new tokens, queries aligned to
  the end of the KV) is exact; the ragged-new-tokens + paged-prefix split with a merge is not needed for
  correctness and is left out (it would save re-reading the new tokens' K/V from the pool).

``forward`` runs the planned wrapper for every layer. GQA is native (query heads a multiple of KV heads);
decode uses the tensor-core kernels for group sizes above 4, where the CUDA-core decode kernels are not
instantiated or slower. Kernels are JIT-compiled by FlashInfer at first use (minutes, cached on disk
afterwards). On Hopper (sm90) the FA2 kernels are requested explicitly: ``auto`` would pick FA3.

Start-up (``flashinfer_setup``): the dtype and head dim are checked (as ``auto`` does), nvcc must be found
unless FlashInfer's prebuilt kernels are installed, and the float workspace is sized from the model's head
counts and the device's SM count. Every ``plan()`` goes through a ``PlanGuard``: a wrapper is re-planned only
once the host-to-device copy of its previous plan has run.

CUDA graphs (``runtime.executor.cuda_graph``) use :meth:`init_cuda_graph_state` and
:meth:`plan_cuda_graph`: one decode wrapper per captured batch size over shared, fixed index buffers,
re-planned (outside the graph) before every replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.attention.flashinfer_plan import FlashInferPlan, pad_plan, plan_batch
from runtime.attention.flashinfer_setup import PlanGuard, check_flashinfer_usable, float_workspace_bytes, require_nvcc
from runtime.core.forward_batch import ForwardBatch

TENSOR_CORE_MIN_GROUP = 5  # query heads per KV head from which decode uses the tensor-core kernels


def import_flashinfer() -> Any:
    """``flashinfer``, or a RuntimeError that says how to get it."""
    try:
        import flashinfer
    except Exception as exc:
        raise RuntimeError(
            "the flashinfer attention backend needs the flashinfer-python package (install the 'gpu' extra: "
            "pip install 'radixserve[gpu]'; it pins the version built for torch 2.11 + CUDA 13), or choose "
            f"--attention-backend torch_native. Import failed with {type(exc).__name__}: {exc}") from exc
    return flashinfer


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the planned flashinfer wrapper (decode or prefill)
    plan: FlashInferPlan


class FlashInferBackend(AttentionBackend):
    """FlashInfer paged decode / prefill (see the module docstring)."""

    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, shape: AttentionShape, device: torch.device | str = "cuda",
                 dtype: torch.dtype | None = None, workspace_bytes: int | None = None):
        super().__init__(shape)
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(f"the flashinfer attention backend runs on CUDA devices only, not {device}; "
                               "use --attention-backend torch_native (the CPU path)")
        if not torch.cuda.is_available():
            raise RuntimeError("the flashinfer attention backend needs CUDA, which torch reports unavailable "
                               "here; use --attention-backend torch_native")
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"{shape.num_heads} query heads is not a multiple of {shape.num_kv_heads} kv heads")
        unusable = check_flashinfer_usable(dtype, shape.head_dim)
        if unusable is not None:
            raise RuntimeError(f"--attention-backend flashinfer cannot run this model: {unusable}; or choose "
                               "--attention-backend torch_native")
        self.fi = import_flashinfer()
        require_nvcc()
        self.device = device
        self.group = shape.num_heads // shape.num_kv_heads
        self.use_tensor_cores = self.group >= TENSOR_CORE_MIN_GROUP
        major, _minor = torch.cuda.get_device_capability(device)
        self.kernel_backend = "fa2" if major == 9 else "auto"
        if workspace_bytes is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            workspace_bytes = float_workspace_bytes(shape.num_heads, shape.num_kv_heads, shape.head_dim, sms)
        # One float workspace shared by every wrapper: only one kernel runs at a time on the stream.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.plan_guard = PlanGuard(torch.cuda.Event)
        self.decode_wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend=self.kernel_backend)
        self.prefill_wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.kernel_backend)
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_buffers: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ planning
    def plan(self, batch: ForwardBatch) -> None:
        """Build the page table on the device and plan the one wrapper this batch needs."""
        if batch.batch_size == 0:
            batch.attn_metadata = None
            return
        plan = plan_batch(batch)
        wrapper = self.decode_wrapper if plan.is_decode else self.prefill_wrapper
        self._plan_wrapper(wrapper, plan, batch.kv.shape.dtype)
        batch.attn_metadata = FlashInferMetadata(wrapper, plan)

    def _plan_wrapper(self, wrapper: Any, plan: FlashInferPlan, dtype: torch.dtype) -> None:
        s, kv = self.shape, plan.kv
        self.plan_guard.before_plan(wrapper)
        if plan.is_decode:
            wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, s.num_heads, s.num_kv_heads,
                         s.head_dim, kv.page_size, q_data_type=dtype, kv_data_type=dtype, sm_scale=s.scale,
                         non_blocking=True)
        else:
            wrapper.plan(plan.qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, s.num_heads,
                         s.num_kv_heads, s.head_dim, kv.page_size, causal=True, sm_scale=s.scale,
                         q_data_type=dtype, kv_data_type=dtype, non_blocking=True)
        self.plan_guard.after_plan(wrapper)

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        kv = batch.kv
        kv.set_kv(layer_id, batch.out_cache_loc, k, v)
        meta: FlashInferMetadata = batch.attn_metadata
        in_dtype = q.dtype
        q = q.to(kv.shape.dtype).contiguous()  # rotary output is a strided view of q|k; kernels want rows packed
        out = meta.wrapper.run(q, kv.paged_view(layer_id))
        return out if out.dtype == in_dtype else out.to(in_dtype)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_pages: int) -> None:
        """Fixed index buffers for decode graphs of up to ``max_bs`` requests over ``max_pages`` page ids."""
        dev = self.device
        self._graph_buffers = {
            "indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "indices": torch.zeros(max_pages, dtype=torch.int32, device=dev),
            "last_page_len": torch.ones(max_bs, dtype=torch.int32, device=dev),
        }
        self._graph_wrappers = {}

    def _graph_wrapper(self, bs: int) -> Any:
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            buf = self._graph_buffers
            if not buf:
                raise RuntimeError("init_cuda_graph_state() must be called before planning a graph")
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=buf["indptr"][: bs + 1], paged_kv_indices_buffer=buf["indices"],
                paged_kv_last_page_len_buffer=buf["last_page_len"][:bs], backend=self.kernel_backend)
            self._graph_wrappers[bs] = wrapper
        return wrapper

    def plan_cuda_graph(self, batch: ForwardBatch, padded_bs: int) -> FlashInferMetadata:
        """Plan the graph wrapper of size ``padded_bs`` for the decode ``batch`` (its real rows); the padding
        rows attend over one token of the reserved page 0. Called before capture and before every replay."""
        plan = pad_plan(plan_batch(batch), padded_bs)
        if plan.kv.num_pages > self._graph_buffers["indices"].numel():
            raise RuntimeError(f"{plan.kv.num_pages} KV pages exceed the graph index buffer "
                               f"({self._graph_buffers['indices'].numel()})")
        wrapper = self._graph_wrapper(padded_bs)
        self._plan_wrapper(wrapper, plan, batch.kv.shape.dtype)
        return FlashInferMetadata(wrapper, plan)
