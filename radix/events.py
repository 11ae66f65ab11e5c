"""Insert/remove events of the radix cache, and a mirror that rebuilds the cached set from them alone.

The tree reports what it stores in *blocks* of ``block_size`` tokens (its page size). Each block carries
a 64-bit hash of its tokens chained with its parent block's hash, starting from a per-namespace root
hash, so a block's hash names the whole prefix that ends with it. Node splits do not change blocks, so
they produce no events; a consumer (the router's exact mode, a dashboard) that applies every event in
order holds exactly the blocks the tree holds.

Hashes use blake2b, so they are the same in every process and every run.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

_MASK = (1 << 64) - 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_hash(namespace: Hashable | None) -> int:
    """Hash of the empty prefix of a namespace (namespaces never share blocks)."""
    return _digest(b"radixserve-root:" + repr(namespace).encode())


def chain_hashes(parent: int, key: bytes, block_bytes: int) -> array:
    """Hashes of consecutive blocks of ``key`` (int32-packed tokens), each chained to the previous one."""
    out = array("Q")
    h = parent
    for i in range(0, len(key), block_bytes):
        h = _digest((h & _MASK).to_bytes(8, "little") + key[i : i + block_bytes])
        out.append(h)
    return out


@dataclass(frozen=True)
class BlocksStored:
    """New blocks were cached after ``parent_hash`` (a root hash for a prefix at the namespace's start)."""

    namespace: Hashable | None
    parent_hash: int
    block_hashes: list[int]
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlocksRemoved:
    """These blocks were evicted (always the deepest blocks of a branch)."""

    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The cache was flushed."""


CacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared
EventSink = Callable[[CacheEvent], None]


@dataclass
class CacheMirror:
    """What a consumer of the events knows: every cached block and the prefix it ends."""

    block_size: int = 1
    blocks: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def apply(self, event: CacheEvent) -> None:
        if isinstance(event, BlocksStored):
            self.block_size = event.block_size
            parent = event.parent_hash
            bs = event.block_size
            for i, h in enumerate(event.block_hashes):
                self.blocks[h] = (parent, tuple(event.token_ids[i * bs : (i + 1) * bs]))
                parent = h
        elif isinstance(event, BlocksRemoved):
            for h in event.block_hashes:
                self.blocks.pop(h, None)
        else:
            self.blocks.clear()

    def match_len(self, tokens: Sequence[int], namespace: Hashable | None = None) -> int:
        """Length of the longest cached prefix of ``tokens``, as the tree would report it."""
        bs = self.block_size
        key = array("i", tokens).tobytes()
        h = root_hash(namespace)
        n = 0
        for i in range(0, len(tokens) - bs + 1, bs):
            h = chain_hashes(h, key[4 * i : 4 * (i + bs)], 4 * bs)[0]
            if h not in self.blocks:
                break
            n += bs
        return n
