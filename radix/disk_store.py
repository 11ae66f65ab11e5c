"""DiskKVStore: the disk tier (L3) of the KV cache — one file per KV page, content-addressed, checksummed.

Layout under ``root`` (one store per ``KVFingerprint``; other fingerprints' directories are never read)::

    root/<fingerprint digest>/fingerprint.json        the fields of the fingerprint (human-readable)
    root/<fingerprint digest>/blocks/<hh>/<hash>.kv   one block; <hash> = 16 hex digits, <hh> its first two

A block's name is the chained block hash of ``radix.events``: the hash covers the block's whole token prefix
and namespace, so under one fingerprint equal names mean equal KV, and a writer never has to overwrite a
different block. The file format (header, checksums) is ``radix.disk_format``'s.

Why each rule:

* Writes go to a uniquely named temp file in the block's own directory, are fsynced, then ``os.replace``d
  onto the final name: a reader opens either the old file or the complete new one, never a torn one; two
  writers of one block both rename complete, identical files (the last rename wins). No lock is needed.
* ``get`` checks magic, version, header checksum, hash, fingerprint, length and payload checksum, and returns
  None (deleting the file, logging a warning) for anything that fails: a corrupted block is recomputed,
  never served. A file that vanishes (another process evicted it) is a plain miss.
* A writer killed mid-write leaves only a temp file (names end ``.tmp`` and carry the writer's host and pid);
  the scan at open ignores temp files and deletes those whose writer is dead (or that are over an hour old).
* LRU: an in-memory index (``radix.disk_index.BlockIndex``: hash -> size, oldest first) is rebuilt at open
  from the files' mtimes (``scan_blocks``); ``get`` and ``put`` of a present block touch the mtime, so the
  order survives a restart. ``put`` evicts the
  oldest blocks to stay under ``capacity_bytes``. Processes sharing a directory each bound what they see
  (blocks they wrote, read or scanned); a miss in the index stats the file, so one sees the other's blocks.
* Faults: a root that cannot be created or written raises ``DiskTierError`` at open; a write failing later
  (full disk, read-only remount, permissions) logs one warning and leaves the store read-only — ``put``
  never raises I/O errors into the caller.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from radix.disk_format import BlockCorrupt, KVFingerprint, decode_block, encode_header, payload_bytes
from radix.disk_index import SUFFIX, TMP_SUFFIX, BlockIndex, scan_blocks, temp_name
from radix.errors import KVCacheError

logger = logging.getLogger(__name__)

__all__ = ["SUFFIX", "TMP_SUFFIX", "DiskKVStore", "DiskStoreStats", "DiskTierError"]

_MASK = (1 << 64) - 1


class DiskTierError(KVCacheError):
    """The disk tier cannot be used (raised at open: the directory cannot be created or written)."""


@dataclass
class DiskStoreStats:
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    corrupted: int = 0  # files that failed verification (each removed)
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    write_errors: int = 0
    read_errors: int = 0  # I/O errors other than a vanished file
    load_seconds: float = 0.0  # total over hits: open, read, verify
    max_load_seconds: float = 0.0

    @property
    def mean_load_ms(self) -> float:
        return 1e3 * self.load_seconds / self.hits if self.hits else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["mean_load_ms"] = self.mean_load_ms
        return out


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


class DiskKVStore:
    """Blocks of KV on disk, named by chained block hash, for one ``KVFingerprint`` (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: KVFingerprint,
        capacity_bytes: int | None = None,
        *,
        fsync: bool = True,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive or None, got {capacity_bytes}")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.directory = self.root / fingerprint.digest()
        self._blocks_dir = self.directory / "blocks"
        self._fp = bytes.fromhex(fingerprint.digest())
        self._fsync = fsync
        self._lock = threading.Lock()  # guards the counters (the index has its own lock)
        self._index = BlockIndex()
        self._stats = DiskStoreStats()
        self._read_only_reason: str | None = None
        self._warned_read_errnos: set[int] = set()
        self._open()

    # ----------------------------------------------------------------- open
    def _open(self) -> None:
        try:
            self._blocks_dir.mkdir(parents=True, exist_ok=True)
            for i in range(256):
                (self._blocks_dir / f"{i:02x}").mkdir(exist_ok=True)
            # a real write (temp file, fsync, unlink) catches read-only mounts, permissions and a full disk
            probe = self.directory / temp_name("probe")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                with suppress(OSError):
                    os.unlink(probe)
            self._write_fingerprint()
        except OSError as e:
            raise DiskTierError(f"disk KV tier unusable at {self.root}: {e.strerror or e} ({e.filename})") from e
        self._warn_foreign()
        self.rescan()
        self._evict_to(self.capacity_bytes or 0, 0)

    def _write_fingerprint(self) -> None:
        path = self.directory / "fingerprint.json"
        mine = self.fingerprint.to_dict()
        try:
            theirs = json.loads(path.read_text())
        except FileNotFoundError:
            theirs = None
        except ValueError:
            logger.warning("disk KV tier: %s is unreadable; rewriting it", path)
            theirs = None
        if theirs is not None:
            if theirs != mine:
                raise DiskTierError(f"{path} names another fingerprint than its directory: {theirs} != {mine}")
            return
        tmp = self.directory / temp_name("fingerprint")
        tmp.write_text(json.dumps(mine, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)

    def _warn_foreign(self) -> None:
        try:
            others = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and e.name != self.directory.name)
        except OSError:
            return
        if others:
            logger.warning(
                "disk KV tier: %s holds %d cache director%s of other KV fingerprints (%s); they are ignored, "
                "never read (this server's blocks go to %s)", self.root, len(others),
                "y" if len(others) == 1 else "ies", ", ".join(others[:5]) + (" ..." if len(others) > 5 else ""),
                self.directory.name,
            )

    def rescan(self) -> None:
        """Rebuild the index from the directory (at open; later to see what other processes wrote)."""
        self._index.replace(scan_blocks(self._blocks_dir, self.directory))

    # ----------------------------------------------------------------- queries
    def _path(self, block_hash: int) -> Path:
        name = f"{block_hash & _MASK:016x}"
        return self._blocks_dir / name[:2] / (name + SUFFIX)

    def contains(self, block_hash: int) -> bool:
        """Whether the block is on disk (in the index, or written there by another process)."""
        if block_hash in self._index:
            return True
        try:
            size = os.stat(self._path(block_hash)).st_size
        except OSError:
            return False
        self._index.note(block_hash, size)
        return True

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a hash chain are present."""
        n = 0
        for h in hashes:
            if not self.contains(h):
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return self._index.bytes

    @property
    def writable(self) -> bool:
        return self._read_only_reason is None

    @property
    def read_only_reason(self) -> str | None:
        """Why writes stopped (a full disk, a read-only directory, ...); None while writable."""
        return self._read_only_reason

    def stats(self) -> DiskStoreStats:
        """A copy of the counters."""
        with self._lock:
            return replace(self._stats)

    # ----------------------------------------------------------------- recency
    def _touch(self, path: Path) -> None:
        """Move the block to the recent end of the on-disk LRU order (its mtime) for the next open."""
        if self._read_only_reason is None:
            now = time.time_ns()  # explicit: the kernel's own file timestamps tick only every few ms
            with suppress(OSError):
                os.utime(path, ns=(now, now))

    # ----------------------------------------------------------------- get
    def get(self, block_hash: int, buffer: bytearray | None = None) -> torch.Tensor | None:
        """The block's KV (a CPU tensor of the shape and dtype it was put with), or None if it is missing or
        fails verification (then the file is removed). Never raises for I/O errors.

        ``buffer``: where to read the file when it is large enough (else a new one is made), so that a caller
        reading many blocks in turn reuses memory that is already mapped instead of faulting in fresh pages
        for each; the tensor returned then shares it, and is only valid until the buffer's next use."""
        t0 = time.perf_counter()
        path = self._path(block_hash)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                buf = memoryview(buffer if buffer is not None and len(buffer) >= size else bytearray(size))[:size]
                n = 0
                while n < size and (k := f.readinto(buf[n:])):
                    n += k
        except FileNotFoundError:
            self._miss(block_hash)
            return None
        except OSError as e:
            if e.errno not in self._warned_read_errnos:
                self._warned_read_errnos.add(e.errno or 0)
                logger.warning("disk KV tier: cannot read %s (%s); treating it as a miss", path, e.strerror or e)
            with self._lock:
                self._stats.read_errors += 1
            self._miss(block_hash)
            return None
        try:
            if n != size:
                raise BlockCorrupt(f"file shrank while read ({n} of {size} bytes)")
            kv = decode_block(buf, block_hash, self._fp)
        except BlockCorrupt as c:
            self._discard_corrupt(block_hash, path, st, str(c))
            self._miss(block_hash)
            return None
        self._touch(path)
        self._index.note(block_hash, size)
        dt = time.perf_counter() - t0
        with self._lock:
            s = self._stats
            s.hits += 1
            s.blocks_read += 1
            s.bytes_read += size
            s.load_seconds += dt
            s.max_load_seconds = max(s.max_load_seconds, dt)
        return kv

    def _miss(self, block_hash: int) -> None:
        self._index.forget(block_hash)
        with self._lock:
            self._stats.misses += 1

    def _discard_corrupt(self, block_hash: int, path: Path, st: os.stat_result, reason: str) -> None:
        logger.warning("disk KV tier: block %016x (%s) is corrupt: %s; removing it", block_hash, path, reason)
        with self._lock:
            self._stats.corrupted += 1
        # remove the file only if it is still the one we read: another process may have just replaced it
        with suppress(OSError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)

    # ----------------------------------------------------------------- put
    def put(self, block_hash: int, kv: torch.Tensor) -> bool:
        """Store one block (``kv``: one page's KV, any shape/dtype). True if the block is on disk afterwards.
        I/O failures are logged once and leave the store read-only; they never raise."""
        if not 0 <= block_hash <= _MASK:
            raise ValueError(f"block hash must be a 64-bit unsigned int, got {block_hash}")
        path = self._path(block_hash)
        if self.contains(block_hash):  # equal hash => equal KV under one fingerprint: nothing to write
            self._touch(path)
            self._index.touch(block_hash)
            return True
        if self._read_only_reason is not None:
            return False
        payload = payload_bytes(kv)
        header = encode_header(block_hash, self._fp, kv.dtype, tuple(kv.shape), payload)
        size = len(header) + payload.nbytes
        if self.capacity_bytes is not None:
            if size > self.capacity_bytes:
                return False
            self._evict_to(self.capacity_bytes, size)
        try:
            self._write_atomic(path, header, payload)
        except OSError as e:
            self._write_failed(e)
            return False
        self._index.note(block_hash, size)
        with self._lock:
            self._stats.blocks_written += 1
            self._stats.bytes_written += size
        return True

    def _write_atomic(self, path: Path, header: bytes, payload: memoryview) -> None:
        tmp = path.parent / temp_name(path.stem)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # someone removed the directory tree under us: recreate it once
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            try:
                _write_all(fd, header)
                _write_all(fd, payload)
                now = time.time_ns()  # a fine-grained LRU stamp (kernel file times tick every few ms)
                os.utime(fd, ns=(now, now))
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise

    def _write_failed(self, e: OSError) -> None:
        reason = f"{errno.errorcode.get(e.errno or 0, 'error')}: {e.strerror or e}"
        with self._lock:
            self._stats.write_errors += 1
            first = self._read_only_reason is None
            self._read_only_reason = reason
        if first:
            logger.warning(
                "disk KV tier: writing to %s failed (%s); the tier is read-only from now on", self.directory, reason
            )

    # ----------------------------------------------------------------- eviction
    def _evict_to(self, capacity: int, incoming: int) -> None:
        """Remove least recently used blocks until ``bytes_used + incoming <= capacity`` (0 = unbounded)."""
        if not capacity:
            return
        victims = self._index.pop_until(capacity, incoming)
        with self._lock:
            self._stats.evicted_blocks += len(victims)
            self._stats.evicted_bytes += sum(size for _, size in victims)
        for h, _ in victims:
            with suppress(OSError):  # already gone (another process evicted it): nothing to do
                os.unlink(self._path(h))

    def remove(self, block_hash: int) -> bool:
        """Delete one block; True if a file was removed."""
        self._index.forget(block_hash)
        try:
            os.unlink(self._path(block_hash))
        except OSError:
            return False
        return True

    def clear(self) -> int:
        """Delete every block of this fingerprint (other fingerprints' directories are left alone)."""
        self.rescan()
        return sum(self.remove(h) for h in self._index.hashes())
