"""Rank 0's view of a tensor-parallel KV pool as the memory hierarchy copies it: every KV head of a slot.

Each rank holds some KV heads of every slot (``models/tp_plan.py``); the host pool and the disk blocks hold
all of them, the layout of an unsplit pool, so a disk directory written at one tp size is read at another and
the radix tree never learns that the model is split. ``ShardedKV`` is ``radix.kv_storage.KVPages`` over the
ranks; the ranks' side is :func:`serve_kv_copy`:

* ``read(slots)``: rank 0 announces a ``KV_READ`` of the slots (``tp_step``), every rank takes its *source*
  heads of them and they are gathered to rank 0, which lays them side by side. A KV head that several ranks
  hold (more ranks than KV heads: each holds a replica) is read from the first of them only.
* ``write(slots, k, v)``: rank 0 announces a ``KV_WRITE`` and scatters to each rank the heads it holds,
  replicas included, which each rank writes into its pool shard.

An operation holds the runner's tensor-parallel lock from its announcement to its last collective, so the
ranks see copies and forward steps in one order (the overlap loop runs forward steps on a worker thread).
On CUDA that lock orders only the launches: rank 0's forward runs on the worker's stream, so a copy first
waits for the device to finish what was queued (copies are rare: evictions to the host, loads back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from radix.kv_storage import KVShape, KVStorage
from runtime.distributed.comm import TPComm
from runtime.executor.tp_step import KVCopy, send_kv_copy
from runtime.models.tp_plan import Shard

HEAD_DIM = 3  # of a copy's payload: [layers, 2 (K, V), slots, heads, row_dim]


@dataclass(frozen=True)
class HeadLayout:
    """Which of the model's KV heads each rank holds, and which of them a read takes from it."""

    held: tuple[tuple[int, int], ...]  # per rank: the global [start, end) of its KV heads
    sources: tuple[tuple[int, int], ...]  # per rank: the local [start, end) of the heads a read takes from it

    @classmethod
    def from_shards(cls, shards: list[Shard]) -> HeadLayout:
        """The ranks' KV-head ranges are contiguous, in rank order and cover every head (``plan_shards``);
        replicas share a range. Each head is read from the first rank holding it, so the ranks' source
        heads, side by side in rank order, are the model's heads in order."""
        held = tuple(s.kv_heads for s in shards)
        sources, covered = [], 0
        for start, end in held:
            if start > covered:
                raise ValueError(f"KV heads {covered}..{start - 1} are held by no rank: {held}")
            lo = max(start, covered)
            sources.append((lo - start, max(lo, end) - start))
            covered = max(covered, end)
        return cls(held, tuple(sources))

    @property
    def num_heads(self) -> int:
        return max(end for _start, end in self.held)

    @property
    def read_sizes(self) -> list[int]:
        return [end - start for start, end in self.sources]

    @property
    def write_sizes(self) -> list[int]:
        return [end - start for start, end in self.held]


class ShardedKV:
    """``KVPages`` over every rank's pool shard (rank 0's side; see the module docstring). ``exclusive``
    is the runner's context for one operation's collectives (its lock, and naming a rank that died)."""

    def __init__(self, local: KVStorage, layout: HeadLayout, comm: TPComm,
                 exclusive: Callable[[], AbstractContextManager[None]]):
        if comm.rank != 0:
            raise ValueError("ShardedKV is rank 0's view; the other ranks answer with serve_kv_copy")
        self.local = local
        self.layout = layout
        self.comm = comm
        self._exclusive = exclusive
        self._shape = dataclasses.replace(local.shape, num_kv_heads=layout.num_heads)

    @property
    def shape(self) -> KVShape:
        return self._shape

    @property
    def page_size(self) -> int:
        return self.local.page_size

    @property
    def total_slots(self) -> int:
        return self.local.total_slots

    @property
    def device(self) -> torch.device:
        return self.local.device

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if slots.numel() == 0:
            s = self._shape
            empty = torch.empty((s.num_layers, 0, s.num_kv_heads, s.row_dim), dtype=s.storage_dtype, device=self.device)
            return empty, empty.clone()
        with self._exclusive():
            self._settle()
            send_kv_copy(self.comm, KVCopy(False, slots), self.device)
            parts = gather_heads(self.comm, self.local, slots.to(self.device), self.layout)
        assert parts is not None
        both = torch.cat(parts, dim=HEAD_DIM)
        return both[:, 0], both[:, 1]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        both = torch.stack((k, v), dim=1).to(self.device, self._shape.storage_dtype)
        pieces = [both.narrow(HEAD_DIM, start, end - start) for start, end in self.layout.held]
        with self._exclusive():
            self._settle()
            send_kv_copy(self.comm, KVCopy(True, slots), self.device)
            scatter_heads(self.comm, self.local, slots.to(self.device), self.layout, pieces)

    def _settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # see the module docstring


def serve_kv_copy(comm: TPComm, kv: KVStorage, layout: HeadLayout, copy: KVCopy) -> None:
    """Ranks 1..N-1: take part in the copy rank 0 announced."""
    if copy.write:
        scatter_heads(comm, kv, copy.slots, layout, None)
    else:
        gather_heads(comm, kv, copy.slots, layout)


def gather_heads(comm: TPComm, kv: KVStorage, slots: torch.Tensor, layout: HeadLayout) -> list[torch.Tensor] | None:
    """This rank's source heads of ``slots`` to rank 0, which gets every rank's (None elsewhere)."""
    k, v = kv.read(slots)
    lo, hi = layout.sources[comm.rank]
    mine = torch.stack((k, v), dim=1).narrow(HEAD_DIM, lo, hi - lo)
    return comm.gather(mine, HEAD_DIM, layout.read_sizes)


def scatter_heads(comm: TPComm, kv: KVStorage, slots: torch.Tensor, layout: HeadLayout,
                  pieces: list[torch.Tensor] | None) -> None:
    """Rank 0's ``pieces`` (each rank's heads of ``slots``) to their ranks, each writing its own."""
    s = kv.shape
    shape = (s.num_layers, 2, int(slots.numel()), s.num_kv_heads, s.row_dim)
    mine = comm.scatter(pieces, HEAD_DIM, layout.write_sizes, shape, s.storage_dtype, kv.device)
    kv.write(slots, mine[:, 0], mine[:, 1])
