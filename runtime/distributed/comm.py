"""The collectives a tensor-parallel model needs, over one torch.distributed process group.

The model calls three things: an in-place sum across ranks after each row-parallel layer (and the
vocab-parallel embedding), a gather of vocab-sharded logits to rank 0, and nothing else — the step's batch
is broadcast by the executor (``runtime/executor/tp_step.py``) before the model runs. The memory hierarchy's
copies (``runtime/executor/tp_kv.py``) gather every rank's KV heads to rank 0 and scatter them back.

``deterministic`` (``--enable-deterministic-inference``) replaces the library's all-reduce by an
all-gather and a sum in rank order. Gloo's ring all-reduce splits the buffer into chunks by its size and
each chunk's sum starts at a different rank, so with three or more ranks a token's float sum would depend
on how many tokens share the step; a fixed rank order keeps each element's arithmetic a function of the
element alone (batch-invariant), at the cost of tp-1 extra buffers per call.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# Collectives never time out: an idle server's ranks wait in the next step's broadcast for as long as no
# request comes. A rank that dies closes its sockets, which fails the peers' pending calls at once; a rank
# that hangs is the scheduler watchdog's to report (--watchdog-timeout).
NO_TIMEOUT = datetime.timedelta(days=365)


def make_process_group(store: dist.Store, rank: int, size: int, device: torch.device) -> Any:
    """A process group of its own (gloo on CPU, NCCL on CUDA), not torch's global default group, so one
    process may run several tensor-parallel models one after another (tests) without global state."""
    prefixed = dist.PrefixStore("radixserve-tp", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = NO_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, size, NO_TIMEOUT)


class TPComm:
    """Rank ``rank`` of ``size``; ``group`` is set by :meth:`connect` once every rank has started."""

    def __init__(self, rank: int, size: int, deterministic: bool = False):
        self.rank = rank
        self.size = size
        self.group: Any = None
        self.deterministic = deterministic
        self.comm_seconds = 0.0  # time spent inside collectives, for the all-reduce share of a step
        self.comm_bytes = 0

    def connect(self, group: Any) -> None:
        self.group = group

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` becomes the elementwise sum of every rank's ``x`` (in place; returned for chaining)."""
        t0 = time.perf_counter()
        self.comm_bytes += x.nbytes
        if self.deterministic:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.allgather([parts], [x.contiguous()]).wait()
            x.copy_(parts[0])
            for p in parts[1:]:
                x.add_(p)
        else:
            self.group.allreduce([x]).wait()
        self.comm_seconds += time.perf_counter() - t0
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Rank 0 gets ``[N, sum(widths)]``: every rank's ``x`` ``[N, widths[rank]]`` side by side in rank
        order; the other ranks get their own ``x`` back. Shards of unequal width are padded for the call."""
        parts = self.gather(x, 1, widths)
        return x if parts is None else torch.cat(parts, dim=1)

    def gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's ``x`` (whose size along ``dim`` is ``sizes[rank]``, the other dimensions
        equal) in rank order; the other ranks get None. Unequal sizes are padded for the call."""
        t0 = time.perf_counter()
        send = _pad(x, dim, max(sizes)).contiguous()
        self.comm_bytes += send.nbytes
        parts = [torch.empty_like(send) for _ in range(self.size)] if self.is_first else None
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.group.gather([parts] if parts is not None else [], [send], opts).wait()
        self.comm_seconds += time.perf_counter() - t0
        if parts is None:
            return None
        return [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]

    def scatter(self, parts: list[torch.Tensor] | None, dim: int, sizes: list[int], shape: Sequence[int],
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Each rank gets ``parts[rank]`` of rank 0 (the other ranks pass None): a ``shape`` tensor whose size
        along ``dim`` is ``sizes[rank]``. Unequal sizes are padded for the call."""
        t0 = time.perf_counter()
        wide = list(shape)
        wide[dim] = max(sizes)
        recv = torch.empty(wide, dtype=dtype, device=device)
        send = [_pad(p, dim, wide[dim]).contiguous() for p in parts] if parts is not None else None
        self.comm_bytes += recv.nbytes
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        self.group.scatter([recv], [send] if send is not None else [], opts).wait()
        self.comm_seconds += time.perf_counter() - t0
        return recv.narrow(dim, 0, sizes[self.rank])

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` becomes rank 0's ``x`` (in place)."""
        t0 = time.perf_counter()
        self.comm_bytes += x.nbytes
        self.group.broadcast([x], dist.BroadcastOptions()).wait()
        self.comm_seconds += time.perf_counter() - t0
        return x


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` padded with zeros at the end of ``dim`` up to ``size`` (``x`` itself when it is that size)."""
    have = x.shape[dim]
    if have == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - have
    return torch.cat([x, x.new_zeros(shape)], dim=dim)
