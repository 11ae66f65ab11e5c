"""HostKVPool: the host-memory tier (L2) of the KV cache — K/V pages in RAM and the copies to and from the device.

The pool has the layout of an unsplit device storage (``radix.kv_storage``), one ``[total_slots, kv_heads,
head_dim]`` K and V tensor per layer, and its own ``PagedAllocator`` of host slots (page 0 reserved, like the device's),
so the radix tree can name host KV the way it names device KV: a tensor of slot indices. The pool only
moves bytes and hands out slots; which node owns which host slots is the tiered cache's business
(``radix.hierarchical_cache``).

Copies go through the device pool's ``KVPages`` interface (``radix.kv_storage``), so the host pool holds
every KV head of a slot whatever holds them on the device (one device, or tensor-parallel ranks):

* a ``KVStorage`` on the CPU, or any other ``KVPages`` (rank 0's view of a tensor-parallel pool, whose
  copies are collectives with the other ranks): ``read`` / ``write`` on the caller's thread, and the
  returned handle is already done.
* a ``KVStorage`` on CUDA: host buffers are pinned. A backup gathers the device rows on a side stream
  (after the work already queued on the caller's stream, which computed them), makes the caller's stream
  wait only for that gather (so the device slots can be freed and reused at once), and copies the gathered
  rows to a pinned staging buffer asynchronously; the rows are scattered into the host buffers when the
  copy is complete. Pending backups are completed in order, and always before a restore reads host rows.
  A restore stages the host rows in pinned memory, copies them to the device and scatters them into the
  device buffers on the side stream; ``wait()`` orders the caller's current stream after it (no host block).

Both kinds of handle have ``wait()`` (the data is usable by whatever the caller runs next) and ``done()``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from radix.allocator import PagedAllocator
from radix.kv_storage import KVPages, KVShape, KVStorage, gather_slots, zeroed


class TransferHandle:
    """A copy between tiers. The base class is a finished copy (the CPU path)."""

    def wait(self) -> None:
        """Return once what the caller runs next sees the copied data."""

    def done(self) -> bool:
        return True


DONE = TransferHandle()


class _CudaBackup(TransferHandle):
    """Device → pinned staging (async), then staging → host buffers on the host when complete."""

    def __init__(self, event: torch.cuda.Event, finish: Callable[[], None], pool: HostKVPool):
        self._event = event
        self._finish: Callable[[], None] | None = finish
        self._pool = pool

    def done(self) -> bool:
        return self._finish is None or self._event.query()

    def complete(self) -> None:
        if self._finish is not None:
            self._event.synchronize()
            self._finish()
            self._finish = None

    def wait(self) -> None:
        self._pool.complete_backups(upto=self)


class _CudaRestore(TransferHandle):
    """Pinned staging → device buffers on the side stream; keeps the staging tensors alive until done."""

    def __init__(self, event: torch.cuda.Event, device: torch.device, keep: tuple[torch.Tensor, ...]):
        self._event = event
        self._device = device
        self._keep = keep

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


def host_capacity_tokens(
    device_capacity: int, page_size: int, shape: KVShape, ratio: float | None = None, size_bytes: int | None = None
) -> int:
    """Host pool size in tokens (whole pages): ``ratio`` × the device pool, or what ``size_bytes`` holds."""
    if (ratio is None) == (size_bytes is None):
        raise ValueError("give exactly one of ratio and size_bytes")
    if ratio is not None:
        if ratio <= 0:
            raise ValueError(f"host pool ratio must be > 0, got {ratio}")
        tokens = int(device_capacity * ratio) // page_size * page_size
        if tokens < page_size:
            raise ValueError(f"a host pool of {ratio} x {device_capacity} tokens holds no page of {page_size}")
        return tokens
    assert size_bytes is not None
    return shape.tokens_for_bytes(size_bytes, page_size)


class HostKVPool:
    """Host-memory K/V pages with the device layout, a paged slot allocator, and tier-to-tier copies."""

    def __init__(self, shape: KVShape, capacity_tokens: int, page_size: int = 1, pin_memory: bool = False):
        self.shape = shape
        self.page_size = page_size
        self.allocator = PagedAllocator(capacity_tokens, page_size)
        dims = (shape.num_layers, self.allocator.total_slots, shape.num_kv_heads, shape.row_dim)
        self.pinned = pin_memory
        if pin_memory:  # page-locked for CUDA copies: allocated (and touched) up front
            self.k_buffer = torch.zeros(dims, dtype=shape.storage_dtype, pin_memory=True)
            self.v_buffer = torch.zeros(dims, dtype=shape.storage_dtype, pin_memory=True)
        else:
            self.k_buffer, self.v_buffer = zeroed(dims, shape.storage_dtype), zeroed(dims, shape.storage_dtype)
        self._stream: torch.cuda.Stream | None = None
        self._pending: deque[_CudaBackup] = deque()  # CUDA backups whose rows are not in the buffers yet

    @classmethod
    def for_device(cls, storage: KVPages, capacity_tokens: int) -> HostKVPool:
        """A pool matching ``storage`` (same shape and page size; pinned when the storage is on CUDA)."""
        return cls(storage.shape, capacity_tokens, storage.page_size, pin_memory=storage.device.type == "cuda")

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def free_size(self) -> int:
        return self.allocator.free_size

    @property
    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes

    def free(self, host_slots: torch.Tensor) -> None:
        """Give host slots back (a pending backup into them still lands first: backups complete in order)."""
        self.allocator.free(host_slots)

    # ------------------------------------------------------------------ copies
    def backup(self, storage: KVPages, device_slots: torch.Tensor) -> tuple[torch.Tensor, TransferHandle]:
        """Copy every layer's K and V of ``device_slots`` into fresh host slots (raises
        ``KVOutOfMemoryError`` when the pool has no room); returns the host slots and the copy's handle.
        Once this returns, the device slots may be freed and reused."""
        self._check(storage)
        self.poll()
        host_slots = self.allocator.alloc(int(device_slots.numel()))
        if isinstance(storage, KVStorage) and storage.k_buffer.is_cuda:
            return host_slots, self._cuda_backup(storage, device_slots, host_slots)
        try:
            k, v = storage.read(device_slots)  # under tensor parallelism a collective, which may fail
        except BaseException:
            self.allocator.free(host_slots)
            raise
        self.k_buffer.index_copy_(1, host_slots, k.cpu())
        self.v_buffer.index_copy_(1, host_slots, v.cpu())
        return host_slots, DONE

    def restore(self, host_slots: torch.Tensor, storage: KVPages, device_slots: torch.Tensor) -> TransferHandle:
        """Copy every layer's K and V of ``host_slots`` into ``device_slots`` of ``storage``."""
        self._check(storage)
        if host_slots.numel() != device_slots.numel():
            raise ValueError(f"{host_slots.numel()} host slots restored into {device_slots.numel()} device slots")
        self.complete_backups()  # host rows must hold what was backed up before anyone reads them
        if isinstance(storage, KVStorage) and storage.k_buffer.is_cuda:
            return self._cuda_restore(host_slots, storage, device_slots)
        k, v = gather_slots(self.k_buffer, host_slots), gather_slots(self.v_buffer, host_slots)
        storage.write(device_slots, k, v)
        return DONE

    def poll(self) -> None:
        """Land the pending CUDA backups that have finished copying (in order; never blocks)."""
        while self._pending and self._pending[0].done():
            self._pending.popleft().complete()

    def complete_backups(self, upto: TransferHandle | None = None) -> None:
        """Land pending CUDA backups in order (all of them, or up to and including ``upto``)."""
        while self._pending:
            handle = self._pending.popleft()
            handle.complete()
            if handle is upto:
                break

    def _check(self, storage: KVPages) -> None:
        if storage.shape != self.shape or storage.page_size != self.page_size:
            raise ValueError(
                f"host pool ({self.shape}, page {self.page_size}) does not match the device storage "
                f"({storage.shape}, page {storage.page_size})"
            )

    # ------------------------------------------------------------------ CUDA paths
    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _cuda_backup(self, storage: KVStorage, device_slots: torch.Tensor, host_slots: torch.Tensor) -> TransferHandle:
        device = storage.k_buffer.device
        stream = self._side_stream(device)
        caller = torch.cuda.current_stream(device)
        stream.wait_stream(caller)  # the rows were written by work queued on the caller's stream
        with torch.cuda.stream(stream):
            idx = device_slots.to(device, non_blocking=True)
            k = gather_slots(storage.k_buffer, idx)
            v = gather_slots(storage.v_buffer, idx)
            gathered = torch.cuda.Event()
            gathered.record(stream)
            k_host = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            v_host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            k_host.copy_(k, non_blocking=True)
            v_host.copy_(v, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        caller.wait_event(gathered)  # later writes into the freed device slots come after the gather

        def finish() -> None:
            self.k_buffer.index_copy_(1, host_slots, k_host)
            self.v_buffer.index_copy_(1, host_slots, v_host)

        handle = _CudaBackup(copied, finish, self)
        self._pending.append(handle)
        return handle

    def _cuda_restore(self, host_slots: torch.Tensor, storage: KVStorage, device_slots: torch.Tensor) -> TransferHandle:
        device = storage.k_buffer.device
        n = int(host_slots.numel())
        s = self.shape
        k_host = torch.empty((s.num_layers, n, s.num_kv_heads, s.row_dim), dtype=s.storage_dtype, pin_memory=True)
        v_host = torch.empty(k_host.shape, dtype=s.storage_dtype, pin_memory=True)
        gather_slots(self.k_buffer, host_slots, out=k_host)
        gather_slots(self.v_buffer, host_slots, out=v_host)
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # earlier users of these device slots first
        with torch.cuda.stream(stream):
            idx = device_slots.to(device, non_blocking=True)
            k_dev = k_host.to(device, non_blocking=True)
            v_dev = v_host.to(device, non_blocking=True)
            storage.k_buffer.index_copy_(1, idx, k_dev)
            storage.v_buffer.index_copy_(1, idx, v_dev)
            event = torch.cuda.Event()
            event.record(stream)
        return _CudaRestore(event, device, (k_host, v_host, k_dev, v_dev, idx))
