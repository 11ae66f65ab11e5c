"""ForwardBatch: everything one forward pass needs, and nothing about the scheduler.

A batch is a list of requests, each adding ``extend_len`` new tokens after ``prefix_len`` tokens whose
KV is already in the pool (cached prefix, earlier chunks, earlier decode steps). A decode step is the
case where every request adds exactly one token; chunked prefills and decodes mix freely in one
EXTEND batch. The model never sees requests: it sees these tensors and calls the attention backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch

from radix.kv_storage import KVStorage


class ForwardMode(Enum):
    EXTEND = "extend"  # any mix of prefill chunks and single-token decodes
    DECODE = "decode"  # every request adds exactly one token


class SlotHistory(Protocol):
    """How often the pages under some KV slots were freed (``PagedAllocator.times_freed``)."""

    def times_freed(self, slots: torch.Tensor) -> int: ...


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, request after request
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64, KV slot where each new token's K/V is written
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in the request-to-token table
    seq_lens: torch.Tensor  # [B] int64, KV length of each request after this step (prefix + extend)
    prefix_lens: torch.Tensor  # [B] int64, KV already in the pool before this step
    extend_lens: torch.Tensor  # [B] int64, new tokens of each request
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    kv: KVStorage
    req_to_token: torch.Tensor  # [max_requests, max_context] int64 (the table of ReqToTokenPool)
    attn_metadata: Any = None  # filled by AttentionBackend.plan()
    # What the KV allocator knows of the pool's history (``PagedAllocator``): work derived from the KV of slots
    # stays valid across batches while ``times_freed`` of those slots is unchanged. None: the builder does not
    # know it (kernels then keep nothing across batches).
    kv_history: SlotHistory | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def last_token_rows(self) -> torch.Tensor:
        """Row (in the token dimension) of each request's last new token: where its next-token logits are."""
        return torch.cumsum(self.extend_lens, 0) - 1


def build_forward_batch(
    input_ids: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    req_rows: Sequence[int],
    out_cache_loc: torch.Tensor,
    kv: KVStorage,
    req_to_token: torch.Tensor,
    device: str | torch.device = "cpu",
    kv_history: SlotHistory | None = None,
) -> ForwardBatch:
    """Assemble a batch from per-request new tokens, prefix lengths and table rows.

    ``out_cache_loc`` holds the slots of all new tokens in order; they must already be written to the
    request-to-token table at positions ``prefix_len .. prefix_len + extend_len - 1`` of each row.
    """
    extend = [len(ids) for ids in input_ids]
    seq = [p + e for p, e in zip(prefix_lens, extend)]
    flat = [t for ids in input_ids for t in ids]
    positions = [p for pre, e in zip(prefix_lens, extend) for p in range(pre, pre + e)]
    mode = ForwardMode.DECODE if all(e == 1 for e in extend) else ForwardMode.EXTEND

    def as_tensor(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        mode=mode,
        input_ids=as_tensor(flat),
        positions=as_tensor(positions),
        out_cache_loc=out_cache_loc.to(device),
        req_pool_indices=as_tensor(req_rows),
        seq_lens=as_tensor(seq),
        prefix_lens=as_tensor(prefix_lens),
        extend_lens=as_tensor(extend),
        seq_lens_cpu=seq,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=extend,
        kv=kv,
        req_to_token=req_to_token,
        kv_history=kv_history,
    )
