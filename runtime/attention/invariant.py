"""Batch-invariant attention for ``--enable-deterministic-inference`` (CPU, fp32).

Each new token attends its own request's KV positions ``0 .. p`` in order, through one kernel call per
layer for the whole batch (``runtime/kernels/invariant.cpp``: a two-pass softmax per token and head,
fixed-order dot products and sums). A token's arithmetic therefore depends only on its request's KV and
its position: a prompt token computed in a 1,024-token prefill, in a 16-token chunk, or after a cache
hit, and a decode token in a batch of 1 or 32, all get the same bits. There are no cascade groups here:
merging a shared prefix's partial result by log-sum-exp is a different sum.

The plan is the batch's KV slots as one index vector (each request's ``req_to_token`` row up to its new
length, requests one after another) and, per new token, where its request's slots start in it and how many
it reads (``prefix + i + 1`` for the i-th new token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.core.forward_batch import ForwardBatch


@dataclass
class InvariantPlan:
    kv_index: torch.Tensor  # [sum of seq lens] pool slots, request after request
    row_start: torch.Tensor  # [T] offset of each new token's request in kv_index
    row_len: torch.Tensor  # [T] KV positions each new token attends (its position + 1)


def plan_rows(seq_lens: list[int], prefix_lens: list[int], extend_lens: list[int]) -> tuple[list[int], list[int]]:
    """Per new token: offset of its request's slots in the concatenated index, and its KV length."""
    starts: list[int] = []
    lens: list[int] = []
    offset = 0
    for seq, prefix, ext in zip(seq_lens, prefix_lens, extend_lens):
        starts += [offset] * ext
        lens += range(prefix + 1, prefix + ext + 1)
        offset += seq
    return starts, lens


class InvariantAttentionBackend(AttentionBackend):
    name = "invariant"

    def __init__(self, shape: AttentionShape, device: torch.device | str = "cpu"):
        super().__init__(shape)
        if torch.device(device).type != "cpu":
            raise ValueError("the batch-invariant attention kernels run on the CPU only")
        from runtime.kernels.build import load_kernels

        self.kernels: Any = load_kernels("invariant")

    def plan(self, batch: ForwardBatch) -> None:
        rows = batch.req_pool_indices.tolist()
        table = batch.req_to_token
        kv_index = torch.cat([table[r, :s] for r, s in zip(rows, batch.seq_lens_cpu)]) if rows else \
            torch.empty(0, dtype=torch.int64)
        starts, lens = plan_rows(batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu)
        batch.attn_metadata = InvariantPlan(kv_index.to(torch.int64).contiguous(),
                                            torch.tensor(starts, dtype=torch.int64),
                                            torch.tensor(lens, dtype=torch.int64))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        kv = batch.kv
        kv.set_kv(layer_id, batch.out_cache_loc, k, v)
        plan: InvariantPlan = batch.attn_metadata
        return self.kernels.attention(q.float().contiguous(), kv.k(layer_id), kv.v(layer_id), plan.kv_index,
                                      plan.row_start, plan.row_len, self.shape.scale)
