"""Per-layer K and V tensors laid out for paged access.

Layout (the same for every layer, chosen so that CPU gathers and FlashInfer's paged kernels read the
same memory without copies)::

    k_buffer[layer] : [total_slots, num_kv_heads, row_dim]      ("NHD", token-major)
    v_buffer[layer] : [total_slots, num_kv_heads, row_dim]

``row_dim`` is the head dim, in the model's dtype; in the int8 format (``kv_int8``) it is the head dim's int8
values followed by their float32 scale's 4 bytes.

Slot ``s`` is row ``s``; page ``p`` is rows ``p*page_size .. p*page_size + page_size - 1``, so
``paged_view(layer)`` is a free reshape to ``[num_pages + 1, page_size, num_kv_heads, head_dim]``, the
NHD paged layout FlashInfer expects. Row block 0 is the reserved padding page (see ``allocator``).

``KVPages`` is the device pool as the host and disk tiers see it: every KV head of some slots, read or
written as a whole. ``KVStorage`` is one (one device holds every head); under tensor parallelism each rank
holds some heads of every slot and rank 0's ``ShardedKV`` (``runtime/executor/tp_kv.py``) gathers and
scatters them, so the tiers hold the layout of an unsplit pool and never learn that the model is split.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Protocol

import torch

from radix.kv_int8 import SCALE_BYTES, quantize


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32  # the model's: what new K and V arrive in and attention computes in
    int8: bool = False  # stored in the int8 format (``kv_int8``: values and a scale per token and KV head)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type of the pool's tensors."""
        return torch.int8 if self.int8 else self.dtype

    @property
    def row_dim(self) -> int:
        """Elements of one (token, KV head) row in the pool: the head dim, plus the scale's bytes in int8."""
        return self.head_dim + SCALE_BYTES if self.int8 else self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_dim * self.storage_dtype.itemsize

    def tokens_for_bytes(self, budget_bytes: int, page_size: int = 1) -> int:
        """Largest page-aligned token capacity whose storage (plus the reserved page) fits the budget."""
        pages = budget_bytes // (self.bytes_per_token * page_size) - 1
        if pages < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no page of {page_size} tokens "
                f"({self.bytes_per_token} bytes per token)"
            )
        return pages * page_size


def zeroed(dims: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """``torch.zeros(dims)``; on the CPU taken from anonymous memory (``mmap``), which the OS hands out
    zero-filled a page at a time when first touched. A KV pool is sized to a share of RAM (GBs) and mostly
    unused at first: writing zeros over all of it up front made every start-up seconds slower and the idle
    server's memory as large as its pool."""
    device = torch.device(device)
    nbytes = math.prod(dims) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(dims, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(dims)  # the tensor keeps the mapping alive


def gather_slots(buffer: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``buffer.index_select(1, slots)`` for a contiguous ``[layers, slots, kv_heads, row_dim]`` buffer (into
    ``out`` when given), taken through a view whose rows are whole slots: torch's CPU ``index_select`` over
    an inner dimension of a 4-D tensor moves one element at a time, ~10x slower than whole rows."""
    layers, total, heads, dim = buffer.shape
    rows = buffer.view(layers, total, heads * dim)
    if out is None:
        return rows.index_select(1, slots).view(layers, -1, heads, dim)
    torch.index_select(rows, 1, slots, out=out.view(layers, -1, heads * dim))
    return out


class KVPages(Protocol):
    """Every KV head of the device pool's slots, as the host and disk tiers copy them (module docstring)."""

    @property
    def shape(self) -> KVShape:
        """The layout of one slot: every layer, every KV head of the model."""

    @property
    def page_size(self) -> int: ...

    @property
    def total_slots(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where ``read`` returns its tensors."""

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots``, each ``[layers, len(slots), kv_heads, row_dim]`` (new tensors, stored format)."""

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` and ``v`` (shaped as ``read`` returns them, on any device) into ``slots``."""


class KVStorage:
    """Holds the KV tensors of every layer; the allocator decides which slots are whose."""

    def __init__(
        self, shape: KVShape, total_slots: int, page_size: int = 1, device: str | torch.device = "cpu"
    ):
        if total_slots % page_size:
            raise ValueError(f"total_slots {total_slots} is not a multiple of page_size {page_size}")
        self.shape = shape
        self.page_size = page_size
        self.total_slots = total_slots
        dims = (shape.num_layers, total_slots, shape.num_kv_heads, shape.row_dim)
        self.k_buffer = zeroed(dims, shape.storage_dtype, device)
        self.v_buffer = zeroed(dims, shape.storage_dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes

    def release(self) -> None:
        """Free the pool's memory (its runner has stopped): it holds no slot afterwards."""
        self.k_buffer = self.k_buffer.new_empty((self.shape.num_layers, 0, *self.k_buffer.shape[2:]))
        self.v_buffer = self.v_buffer.new_empty((self.shape.num_layers, 0, *self.v_buffer.shape[2:]))
        self.total_slots = 0

    @property
    def device(self) -> torch.device:
        return self.k_buffer.device

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K and V of ``slots`` (``KVPages``)."""
        idx = slots.to(self.k_buffer.device)
        return gather_slots(self.k_buffer, idx), gather_slots(self.v_buffer, idx)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer's K and V into ``slots`` (``KVPages``)."""
        dev = self.k_buffer.device
        idx = slots.to(dev)
        self.k_buffer.index_copy_(1, idx, k.to(dev))
        self.v_buffer.index_copy_(1, idx, v.to(dev))

    def k(self, layer: int) -> torch.Tensor:
        return self.k_buffer[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.v_buffer[layer]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the K/V of new tokens (``[n, num_kv_heads, head_dim]``) into their slots."""
        self.k_buffer[layer].index_copy_(0, slots, self.encode(k))
        self.v_buffer[layer].index_copy_(0, slots, self.encode(v))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """K or V rows ``[..., head_dim]`` as the pool stores them (``[..., row_dim]`` of its dtype)."""
        return quantize(x) if self.shape.int8 else x.to(self.shape.dtype)

    def paged_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_pages, page_size, heads, head_dim]`` views (no copy)."""
        s = self.shape
        if s.int8:
            raise ValueError("the int8 KV format has no paged view of plain rows (its rows carry their scales)")
        view = (self.total_slots // self.page_size, self.page_size, s.num_kv_heads, s.head_dim)
        return self.k_buffer[layer].view(view), self.v_buffer[layer].view(view)
