"""DiskTier: the disk tier (L3) of the hierarchical cache — blocks of 64 tokens written through to a
``DiskKVStore`` in the background, read back in order on a miss of the tree.

Blocks. A disk block is ``block_tokens`` consecutive tokens (64, or the smallest multiple of the page
size above it) aligned at multiples of ``block_tokens`` from the start of the sequence. It is named by the
chained hash ``chain_hashes(root_hash(namespace), key, 4 * block_tokens)`` of ``radix.events``: the hash
covers the block's whole prefix and namespace, so one name is one prefix, and a restarted server finds a
conversation's blocks by hashing its prompt. A block's payload is its KV for every layer and every KV head,
shaped ``[layers, 2 (K, V), block_tokens, kv_heads, row_dim]`` in the device pool's dtype and format; the device pool
is read and written through ``KVPages``, which gathers a tensor-parallel pool's heads from its ranks.

Writes (``offer``) happen when the tree caches a request's tokens. The blocks not on disk yet are gathered
from the device slots *on the caller's thread* (so the copy is taken before the slots can be freed and
reused; on CUDA the gather is queued on the caller's stream, after the work that computed the KV, and
copied to pinned memory asynchronously) and queued for one background writer thread. The queue is bounded
in bytes: a block that does not fit is skipped and counted (it is simply a miss later). The scheduler never
waits for disk I/O; ``flush`` waits for the queue to drain (the cache calls it on ``reset``; it also runs
at interpreter exit). A SIGKILL loses what was queued, which is safe: the store writes atomically.

Reads: ``present`` names the leading blocks of a hash chain the store has; ``load`` reads them in order, stops
at the first one it cannot read or verify (``DiskKVStore.get`` returns None for a corrupt file, never wrong
data), checks each payload's shape and dtype, and hands each block to the caller to copy into the device
pool before reading the next into the same staging buffer: a load moves each byte twice (page cache to the
buffer, buffer to the pool) through memory that stays mapped and cache-warm, instead of faulting in fresh
pages for every file and again for one tensor joining them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from radix.disk_format import dtype_name, header_length
from radix.disk_store import DiskKVStore
from radix.events import chain_hashes, root_hash
from radix.kv_storage import KVPages, KVShape

logger = logging.getLogger(__name__)

DISK_BLOCK_TOKENS = 64
DEFAULT_QUEUE_BYTES = 256 << 20


def disk_block_tokens(page_size: int) -> int:
    """``DISK_BLOCK_TOKENS`` if it is a whole number of pages, else the smallest multiple of the page above it."""
    return -(-DISK_BLOCK_TOKENS // page_size) * page_size


@dataclass
class DiskTierCounters:
    """What the tier did on top of the store's own counters (``DiskStoreStats``)."""

    hit_tokens: int = 0  # tokens loaded from disk into the device pool (counted by the cache's load)
    loads: int = 0  # load_to_device calls that brought at least one block
    load_seconds: float = 0.0  # read + verify + copy into the device pool, summed over loads
    blocks_queued: int = 0
    blocks_skipped: int = 0  # the write queue was full: not written
    bad_shape: int = 0  # verified files whose payload is not a block of this server's layout


@dataclass
class _Batch:
    """Blocks gathered in one ``offer``: ``kv[:, :, i*B:(i+1)*B]`` is block ``hashes[i]``."""

    hashes: list[int]
    kv: torch.Tensor  # [layers, 2, n*B, heads, dim] on the CPU (pinned when gathered from CUDA)
    ready: torch.cuda.Event | None
    nbytes: int


@dataclass
class _Queue:
    """The writer's work and the bookkeeping the scheduler thread shares with it (under ``cv``)."""

    cv: threading.Condition = field(default_factory=threading.Condition)
    items: deque[_Batch] = field(default_factory=deque)
    queued: set[int] = field(default_factory=set)  # hashes queued or being written
    nbytes: int = 0
    busy: bool = False
    closed: bool = False


def _writer_loop(q: _Queue, store: DiskKVStore, block_tokens: int) -> None:
    """The writer thread: put each queued block into the store, in order. Holds no reference to the tier,
    so a dropped tier's finalizer can stop it."""
    while True:
        with q.cv:
            while not q.items and not q.closed:
                q.cv.wait()
            if not q.items:
                return
            batch = q.items.popleft()
            q.busy = True
        try:
            if batch.ready is not None:
                batch.ready.synchronize()
            for i, h in enumerate(batch.hashes):
                store.put(h, batch.kv[:, :, i * block_tokens : (i + 1) * block_tokens])
        except Exception:  # the store logs its own I/O errors; anything else must not kill the writer
            logger.exception("disk KV tier: writing %d blocks failed", len(batch.hashes))
        finally:
            with q.cv:
                q.queued.difference_update(batch.hashes)
                q.nbytes -= batch.nbytes
                q.busy = False
                q.cv.notify_all()


def _drain(q: _Queue, thread: threading.Thread, stop: bool) -> None:
    """Wait until every queued block is written; with ``stop``, end the writer thread as well."""
    with q.cv:
        while (q.items or q.busy) and thread.is_alive():
            q.cv.wait(timeout=1.0)
        if stop:
            q.closed = True
            q.cv.notify_all()
    if stop:
        thread.join(timeout=30)


class DiskTier:
    """Blocks of KV on disk for one device pool layout (see the module docstring)."""

    def __init__(self, store: DiskKVStore, shape: KVShape, page_size: int, queue_bytes: int = DEFAULT_QUEUE_BYTES):
        self.store = store
        self.shape = shape
        self.block_tokens = disk_block_tokens(page_size)
        self.block_shape = (shape.num_layers, 2, self.block_tokens, shape.num_kv_heads, shape.row_dim)
        self.block_bytes = shape.bytes_per_token * self.block_tokens
        self.queue_bytes = queue_bytes
        self.counters = DiskTierCounters()
        self._staging: bytearray | None = None  # where ``load`` reads block files (made at its first call)
        self._q = _Queue()
        self._writer = threading.Thread(target=_writer_loop, args=(self._q, store, self.block_tokens),
                                        name="radixserve-disk-writer", daemon=True)
        self._writer.start()
        # drain at interpreter exit too (a graceful stop keeps every queued block), or when the tier is dropped
        self._finalizer = weakref.finalize(self, _drain, self._q, self._writer, True)

    # ------------------------------------------------------------------ hashes
    def hashes(self, key: bytes, namespace: Hashable | None, n_blocks: int) -> list[int]:
        """Chained hashes of the first ``n_blocks`` blocks of ``key`` (int32-packed tokens)."""
        unit = 4 * self.block_tokens
        return chain_hashes(root_hash(namespace), key[: unit * n_blocks], unit).tolist()

    # ------------------------------------------------------------------ write
    def offer(self, key: bytes, namespace: Hashable | None, slots: torch.Tensor, kv: KVPages) -> int:
        """Queue for writing every complete block of ``key`` (whose KV is in device ``slots``, one per token)
        that is neither on disk nor queued. The gather happens now; the write later. Returns blocks queued."""
        bt = self.block_tokens
        n_blocks = min(len(key) // 4, int(slots.numel())) // bt
        if n_blocks == 0 or not self.store.writable:
            return 0
        hashes = self.hashes(key, namespace, n_blocks)
        with self._q.cv:
            queued = self._q.queued
            todo = [i for i, h in enumerate(hashes) if h not in queued]
        todo = [i for i in todo if not self.store.contains(hashes[i])]
        if not todo:
            return 0
        with self._q.cv:
            room = max(0, (self.queue_bytes - self._q.nbytes) // self.block_bytes)
        if len(todo) > room:
            self.counters.blocks_skipped += len(todo) - room
            todo = todo[:room]  # the leading ones: a read needs a chain's blocks from the start
            if not todo:
                return 0
        batch = self._gather(kv, slots, todo, [hashes[i] for i in todo])
        with self._q.cv:
            self._q.items.append(batch)
            self._q.queued.update(batch.hashes)
            self._q.nbytes += batch.nbytes
            self._q.cv.notify_all()
        self.counters.blocks_queued += len(todo)
        return len(todo)

    def _gather(self, kv: KVPages, slots: torch.Tensor, blocks: list[int], hashes: list[int]) -> _Batch:
        bt = self.block_tokens
        k, v = kv.read(torch.cat([slots[i * bt : (i + 1) * bt] for i in blocks]))
        both = torch.stack((k, v), dim=1)  # [layers, 2, n*B, heads, dim]: a copy, independent of the slots
        ready: torch.cuda.Event | None = None
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)  # queued after the forward passes that wrote the rows
            ready = torch.cuda.Event()
            ready.record()
            both = host
        return _Batch(hashes, both, ready, len(hashes) * self.block_bytes)

    def flush(self) -> None:
        """Wait until every queued block is on disk (or failed)."""
        _drain(self._q, self._writer, stop=False)

    def close(self) -> None:
        """Drain the queue and stop the writer (also done at interpreter exit)."""
        self._finalizer()

    @property
    def queued_blocks(self) -> int:
        with self._q.cv:
            return len(self._q.queued)

    # ------------------------------------------------------------------ read
    def present(self, key: bytes, namespace: Hashable | None, first_block: int, n_blocks: int) -> list[int]:
        """Hashes of the leading run of blocks ``first_block .. first_block + n_blocks - 1`` of ``key`` that the
        store has (by its index: whether they verify is only known when ``load`` reads them)."""
        if n_blocks <= 0:
            return []
        hashes = self.hashes(key, namespace, first_block + n_blocks)[first_block:]
        return hashes[: self.store.longest_prefix(hashes)]

    def load(self, hashes: list[int], place: Callable[[int, torch.Tensor], None]) -> int:
        """Read the blocks ``hashes`` in order, handing each (its index in ``hashes``, its KV shaped
        ``block_shape``) to ``place``, up to the first one missing, unreadable, corrupt or of another layout.
        Returns how many were placed. Every block is read into one staging buffer that this tier keeps, so
        ``place`` must copy what it needs before it returns."""
        if self._staging is None:  # the largest block file of this layout: its header, then its payload
            self._staging = bytearray(header_length(len(self.block_shape)) + self.block_bytes)
        want = dtype_name(self.shape.storage_dtype)
        for i, h in enumerate(hashes):
            block = self.store.get(h, self._staging)
            if block is None:
                return i
            if tuple(block.shape) != self.block_shape or dtype_name(block.dtype) != want:
                self.counters.bad_shape += 1
                return i
            place(i, block)
        return len(hashes)

    def record_load(self, tokens: int, seconds: float) -> None:
        c = self.counters
        c.hit_tokens += tokens
        c.loads += 1
        c.load_seconds += seconds

    # ------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """The tier's counters for ``/get_server_info`` (``cache.tiers.disk``)."""
        s = self.store.stats()
        c = self.counters
        return {
            "hit_tokens": c.hit_tokens,
            "blocks_written": s.blocks_written,
            "blocks_read": s.blocks_read,
            "bytes_written": s.bytes_written,
            "bytes_read": s.bytes_read,
            "blocks_stored": len(self.store),
            "bytes_stored": self.store.bytes_used,
            "capacity_bytes": self.store.capacity_bytes,
            "block_tokens": self.block_tokens,
            "queued_blocks": self.queued_blocks,
            "skipped_blocks": c.blocks_skipped,
            "corrupted": s.corrupted + c.bad_shape,
            "evicted_blocks": s.evicted_blocks,
            "write_errors": s.write_errors,
            "read_errors": s.read_errors,
            "writable": self.store.writable,
            "loads": c.loads,
            "load_ms": round(1e3 * c.load_seconds, 3),
            "mean_load_ms": round(1e3 * c.load_seconds / c.loads, 3) if c.loads else 0.0,
            "mean_block_read_ms": round(s.mean_load_ms, 3),
            "directory": str(self.store.directory),
        }
