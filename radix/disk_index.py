"""What a ``DiskKVStore`` knows of its directory: the LRU index of blocks on disk and the scan that rebuilds it.

The index (``BlockIndex``) maps block hash -> file size, least recently used first, and keeps the total; the
store consults it for ``contains`` and evicts from its old end to stay under its byte budget. It is rebuilt at
open by ``scan_blocks``, which orders the block files by mtime (the store touches a file's mtime on every
use, so the LRU order survives a restart) and removes temp files whose writer is gone.

File names (shared with the store's writer): a block is ``blocks/<hh>/<16 hex digits>.kv``; a temp file is
``.<stem>.<host tag>.<pid>.<random>.tmp`` in the directory of the file it will replace, so the scan can
tell a dead writer's leftovers (same host, pid gone) from a live writer's.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 3600.0
HOST_TAG = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


class BlockIndex:
    """Blocks known to be on disk (hash -> file size), least recently used first, with their total size.
    Thread-safe: the scheduler thread reads while the disk writer thread adds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: OrderedDict[int, int] = OrderedDict()
        self._bytes = 0

    def replace(self, blocks: Iterable[tuple[int, int]]) -> None:
        """Forget everything; then know ``blocks`` ((hash, size), oldest first)."""
        sizes = OrderedDict(blocks)
        with self._lock:
            self._sizes = sizes
            self._bytes = sum(sizes.values())

    def note(self, block_hash: int, size: int) -> None:
        """The block is present and now the most recently used."""
        with self._lock:
            old = self._sizes.pop(block_hash, None)
            self._bytes += size - (old or 0)
            self._sizes[block_hash] = size

    def touch(self, block_hash: int) -> None:
        """Make a known block the most recently used (unknown ones stay unknown)."""
        with self._lock:
            if block_hash in self._sizes:
                self._sizes.move_to_end(block_hash)

    def forget(self, block_hash: int) -> None:
        with self._lock:
            self._bytes -= self._sizes.pop(block_hash, 0)

    def pop_until(self, capacity: int, incoming: int) -> list[tuple[int, int]]:
        """Remove least recently used blocks until ``bytes + incoming <= capacity``; returns (hash, size) of
        each removed (the caller deletes the files)."""
        victims: list[tuple[int, int]] = []
        with self._lock:
            while self._sizes and self._bytes + incoming > capacity:
                h, size = self._sizes.popitem(last=False)
                self._bytes -= size
                victims.append((h, size))
        return victims

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._sizes)

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def bytes(self) -> int:
        return self._bytes


def temp_name(stem: str) -> str:
    """A temp file name unique to this writer, which ``scan_blocks`` can attribute to it."""
    return f".{stem}.{HOST_TAG}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"


def scan_blocks(blocks_dir: Path, directory: Path) -> list[tuple[int, int]]:
    """(hash, size) of every block file under ``blocks_dir``, least recently used (oldest mtime) first. Temp
    files there and in ``directory`` are skipped, and removed when their writer is gone. Files that are not
    block files of ours (wrong name, wrong sub-directory) are never indexed, so never read."""
    found: list[tuple[int, int, int]] = []  # (mtime_ns, hash, size)
    now = time.time()
    for sub in _scandir(blocks_dir):
        for e in _scandir(Path(sub.path)):
            name = e.name
            try:
                if name.endswith(TMP_SUFFIX):
                    _remove_if_stale(e, now)
                elif name.endswith(SUFFIX) and len(name) == 16 + len(SUFFIX) and name.startswith(sub.name):
                    st = e.stat()
                    found.append((st.st_mtime_ns, int(name[:16], 16), st.st_size))
            except (OSError, ValueError):
                continue  # vanished meanwhile, or not one of ours
    for e in _scandir(directory):  # temp files of fingerprint.json / the write probe
        if e.name.endswith(TMP_SUFFIX):
            with suppress(OSError):
                _remove_if_stale(e, now)
    found.sort()
    return [(h, size) for _, h, size in found]


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        return [e for e in os.scandir(path) if e.name[:1] != "." or e.name.endswith(TMP_SUFFIX)]
    except OSError:
        return []


def _remove_if_stale(entry: os.DirEntry[str], now: float) -> None:
    """Delete a temp file whose writer is gone: same host and dead pid, or older than an hour."""
    parts = entry.name.split(".")  # "", stem, host, pid, random, "tmp"
    dead = len(parts) == 6 and parts[2] == HOST_TAG and parts[3].isdigit() and not pid_alive(int(parts[3]))
    if dead or now - entry.stat().st_mtime > STALE_TMP_SECONDS:
        with suppress(OSError):
            os.unlink(entry.path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # e.g. EPERM: it exists, owned by someone else
    return True
