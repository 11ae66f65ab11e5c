"""The attention-backend interface the models call.

A backend is planned once per batch (``plan``), then called once per layer (``forward``). ``forward``
writes the new tokens' K and V into the pool at ``batch.out_cache_loc`` and returns each new token's
attention output over its request's whole KV (cached prefix + new tokens, causal within the new ones).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.core.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class AttentionBackend(ABC):
    name: str

    def __init__(self, shape: AttentionShape):
        self.shape = shape

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Build per-batch metadata (KV index lists, masks) into ``batch.attn_metadata``."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """``q``: [T, num_heads, head_dim]; ``k``, ``v``: [T, num_kv_heads, head_dim].

        Stores ``k``/``v`` for the new tokens, then returns [T, num_heads, head_dim].
        """
