"""FlashInfer planning: a batch's page tables as CSR index tensors, built with tensor ops only.

FlashInfer's paged kernels find a batch's KV through four small tensors (all int32)::

    kv_indptr        [B + 1]  request b's pages are kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    kv_indices       [P]      page ids; page p is slots p*ps .. p*ps + ps - 1 of the pool
    kv_last_page_len [B]      tokens used in each request's last page (1 .. ps; 0 for an empty request)
    qo_indptr        [B + 1]  request b's new tokens (queries) are rows qo_indptr[b] : qo_indptr[b + 1]

Why reading one table column per page is enough: the allocator keeps position ``p`` of a sequence at
offset ``p % ps`` of its page (``PagedAllocator.alloc_extend``) and the cache shares whole pages only, so
the page holding positions ``j*ps .. j*ps + ps - 1`` of request ``r`` is ``table[r, j*ps] // ps``. With
``ps == 1`` pages are slots. Page 0 is the reserved padding page (see ``radix.allocator``).

Everything is vectorised (no Python loop over requests) and runs on whatever device the table lives
on. The only sizes the functions need on the host are the lengths the batch already carries
(``ForwardBatch.seq_lens_cpu`` / ``prefix_lens_cpu`` / ``extend_lens_cpu``): with them, building the
indices never reads a device tensor back (no host synchronisation). FlashInfer's ``plan()`` wants the
two ``indptr`` tensors and ``kv_last_page_len`` on the host anyway (it reads them to split the work), so
those are built on the CPU from the host lengths, and only ``kv_indices`` — the one tensor whose size
grows with the context — is gathered on the table's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.core.forward_batch import ForwardBatch

INDEX_DTYPE = torch.int32  # what FlashInfer's kernels index with


@dataclass
class PagedKVIndex:
    """The page table of a batch (or of a part of each request's KV, e.g. the cached prefixes)."""

    kv_indptr: torch.Tensor  # [B + 1] int32, host
    kv_indices: torch.Tensor  # [P] int32, on the table's device
    kv_last_page_len: torch.Tensor  # [B] int32, host
    kv_lens: list[int]  # tokens of KV per request (host)
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def num_pages(self) -> int:
        return int(self.kv_indices.numel())


@dataclass
class FlashInferPlan:
    """Everything one ``plan()`` call of a FlashInfer wrapper takes from a batch."""

    qo_indptr: torch.Tensor  # [B + 1] int32, host
    kv: PagedKVIndex  # each request's whole KV (cached prefix + the new tokens written this step)
    is_decode: bool  # every request adds exactly one token

    @property
    def batch_size(self) -> int:
        return self.kv.batch_size


def indptr_from_lens(lens: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` (int32) from per-request lengths."""
    out = torch.zeros(lens.numel() + 1, dtype=INDEX_DTYPE, device=lens.device)
    out[1:] = torch.cumsum(lens, 0)
    return out


def pages_per_request(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages that hold each request's KV: ``ceil(kv_len / page_size)``."""
    return torch.div(kv_lens + (page_size - 1), page_size, rounding_mode="floor")


def last_page_lens(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Tokens used in each request's last page: 1 .. page_size, or 0 for a request with no KV."""
    return torch.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, torch.zeros_like(kv_lens))


def page_table_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                       page_size: int, total_pages: int) -> torch.Tensor:
    """Page ids of every request's first ``kv_len`` positions, request after request (``[total_pages]``).

    ``kv_lens`` lives on the table's device; ``total_pages`` (the sum of the page counts) comes from host
    data so that the output size is known without reading the device. Built as one gather: request of
    each output entry (``repeat_interleave``), its page number within the request, the table column of the
    page's first position, then ``slot // page_size``.
    """
    device = req_to_token.device
    rows = req_pool_indices.to(device=device, dtype=torch.int64)
    pages = pages_per_request(kv_lens.to(device=device, dtype=torch.int64), page_size)
    if total_pages == 0:
        return torch.empty(0, dtype=INDEX_DTYPE, device=device)
    owner = torch.repeat_interleave(torch.arange(rows.numel(), device=device), pages, output_size=total_pages)
    starts = torch.cumsum(pages, 0) - pages  # first output entry of each request
    page_in_req = torch.arange(total_pages, device=device) - starts[owner]
    slots = req_to_token[rows[owner], page_in_req * page_size]
    if page_size > 1:
        slots = torch.div(slots, page_size, rounding_mode="floor")
    return slots.to(INDEX_DTYPE)


def build_paged_kv_index(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         kv_lens_cpu: Sequence[int], page_size: int,
                         kv_lens: torch.Tensor | None = None) -> PagedKVIndex:
    """The page table of the first ``kv_lens_cpu[b]`` positions of each request.

    ``kv_lens`` (optional) is the same lengths already on the table's device, to save a host-to-device
    copy; the host list is what sizes the outputs.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    lens_host = torch.tensor(list(kv_lens_cpu), dtype=torch.int64)
    pages_host = pages_per_request(lens_host, page_size)
    total = int(pages_host.sum())
    if kv_lens is None:
        kv_lens = lens_host.to(req_to_token.device, non_blocking=True)
    indices = page_table_indices(req_to_token, req_pool_indices, kv_lens, page_size, total)
    return PagedKVIndex(indptr_from_lens(pages_host), indices, last_page_lens(lens_host, page_size).to(INDEX_DTYPE),
                        [int(x) for x in kv_lens_cpu], page_size)


def plan_batch(batch: ForwardBatch, page_size: int | None = None) -> FlashInferPlan:
    """The FlashInfer plan of a ForwardBatch: queries = the new tokens, KV = each request's whole KV.

    The new tokens' K/V are written to the pool before the kernels run (``forward`` does ``set_kv`` first),
    so one paged pass over ``seq_len`` positions with a causal mask (queries aligned to the end of the KV)
    covers both the cached prefix and the new tokens.
    """
    ps = batch.kv.page_size if page_size is None else page_size
    kv = build_paged_kv_index(batch.req_to_token, batch.req_pool_indices, batch.seq_lens_cpu, ps, batch.seq_lens)
    qo = indptr_from_lens(torch.tensor(batch.extend_lens_cpu, dtype=torch.int64))
    is_decode = all(e == 1 for e in batch.extend_lens_cpu)
    return FlashInferPlan(qo, kv, is_decode)


def plan_prefix(batch: ForwardBatch, page_size: int | None = None) -> PagedKVIndex:
    """The page table of the cached prefixes only (for a ragged pass over the new tokens merged with a paged
    pass over the prefix). Prefix lengths are page-aligned only for cache hits; a chunk boundary may end
    mid-page, which ``kv_last_page_len`` expresses."""
    ps = batch.kv.page_size if page_size is None else page_size
    return build_paged_kv_index(batch.req_to_token, batch.req_pool_indices, batch.prefix_lens_cpu, ps,
                                batch.prefix_lens)


def reference_page_indices(req_to_token: torch.Tensor, rows: Sequence[int], kv_lens: Sequence[int],
                           page_size: int) -> list[list[int]]:
    """Per-request page lists, the obvious way (a loop): the oracle of the unit tests."""
    out = []
    for row, n in zip(rows, kv_lens):
        out.append([int(req_to_token[row, j]) // page_size for j in range(0, n, page_size)])
    return out


def pad_plan(plan: FlashInferPlan, batch_size: int) -> FlashInferPlan:
    """``plan`` grown to ``batch_size`` requests with padding rows (CUDA graphs replay fixed batch sizes).

    Each padding request has one query token and one token of KV on the reserved page 0, where padded
    rows also write their K/V (``out_cache_loc`` 0): they read and write nobody's data.
    """
    n = plan.batch_size
    pad = batch_size - n
    if pad < 0:
        raise ValueError(f"cannot pad a batch of {n} requests down to {batch_size}")
    if pad == 0:
        return plan
    kv = plan.kv
    steps = torch.arange(1, pad + 1, dtype=INDEX_DTYPE)
    indptr = torch.cat([kv.kv_indptr, kv.kv_indptr[-1:] + steps])
    indices = torch.cat([kv.kv_indices, torch.zeros(pad, dtype=INDEX_DTYPE, device=kv.kv_indices.device)])
    last = torch.cat([kv.kv_last_page_len, torch.ones(pad, dtype=INDEX_DTYPE)])
    qo = torch.cat([plan.qo_indptr, plan.qo_indptr[-1:] + steps])
    padded = PagedKVIndex(indptr, indices, last, kv.kv_lens + [1] * pad, kv.page_size)
    return FlashInferPlan(qo, padded, plan.is_decode)
