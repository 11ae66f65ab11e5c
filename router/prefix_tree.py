"""PrefixTree: the cache_aware policy's guess of one worker's cache — a radix tree of what was routed there.

Keys are ``bytes``: UTF-8 text (``unit=1``) or int32-packed token ids (``unit=4``), so comparing an edge
with a slice of the key is one ``memcmp`` and a mismatch inside an edge is found by binary search over
slices. Sizes and match lengths are in units (bytes of text, or tokens).

The tree is bounded: when it holds more than ``max_size`` units, the least recently used leaves are cut
until it fits again. The worker's own cache evicts in LRU order too, so what the tree forgets first is
roughly what the worker forgets first. Leaves live in a ``SortedList`` keyed by last access, updated
incrementally, so pruning never scans the tree. ``match`` does not count as a use (the router asks every
worker's tree and sends the request to only one); ``insert`` does.
"""

from __future__ import annotations

import itertools

from sortedcontainers import SortedList


class _Node:
    __slots__ = ("children", "key", "last_access", "parent", "uid")

    def __init__(self, key: bytes, parent: _Node | None, uid: int, tick: int):
        self.key = key
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.last_access = tick
        self.uid = uid

    def sort_key(self) -> tuple[int, int]:
        return (self.last_access, self.uid)


def common_prefix_len(edge: bytes, key: bytes, start: int, unit: int) -> int:
    """Length (a multiple of ``unit``) of the longest common prefix of ``edge`` and ``key[start:]``."""
    n = min(len(edge), len(key) - start)
    n -= n % unit
    if edge[:n] == key[start : start + n]:
        return n
    lo, hi = 0, n // unit  # edge[:lo units] matches, edge[:hi units] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[: mid * unit] == key[start : start + mid * unit]:
            lo = mid
        else:
            hi = mid
    return lo * unit


class PrefixTree:
    def __init__(self, max_size: int, unit: int = 1):
        if unit < 1 or max_size < 1:
            raise ValueError("unit and max_size must be >= 1")
        self.unit = unit
        self.max_size = max_size
        self._uids = itertools.count(1)
        self._clock = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        self.root = _Node(b"", None, 0, 0)
        self._leaves: SortedList = SortedList(key=_Node.sort_key)
        self._bytes = 0
        self.pruned = 0  # units pruned since creation (for /workers)

    @property
    def size(self) -> int:
        """Units held (text bytes, or tokens)."""
        return self._bytes // self.unit

    def __len__(self) -> int:
        return self.size

    # ------------------------------------------------------------------ queries
    def match(self, key: bytes) -> int:
        """Units of the longest prefix of ``key`` in the tree (no LRU update)."""
        unit = self.unit
        end = len(key) - len(key) % unit
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(key[pos : pos + unit])
            if child is None:
                break
            n = common_prefix_len(child.key, key, pos, unit)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos // unit

    # ------------------------------------------------------------------ updates
    def insert(self, key: bytes) -> None:
        """Add ``key`` (whole units), mark its path as just used, then prune to ``max_size``."""
        unit = self.unit
        end = len(key) - len(key) % unit
        tick = next(self._clock)
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(key[pos : pos + unit])
            if child is None:
                leaf = _Node(key[pos:end], node, next(self._uids), tick)
                if not node.children and node is not self.root:
                    self._leaves.remove(node)  # node stops being a leaf
                node.children[leaf.key[:unit]] = leaf
                self._leaves.add(leaf)
                self._bytes += end - pos
                node = leaf
                break
            n = common_prefix_len(child.key, key, pos, unit)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, tick)
            node, pos = child, pos + n
        self._prune()

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node``'s edge after ``n`` bytes; returns the new upper half (an inner node)."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:n], parent, next(self._uids), node.last_access)
        parent.children[upper.key[: self.unit]] = upper
        # ``node`` keeps its identity (and its place among the leaves if it is one): only its key and
        # parent change, and the sort key does not depend on either.
        node.key = node.key[n:]
        node.parent = upper
        upper.children[node.key[: self.unit]] = node
        return upper

    def _touch(self, node: _Node, tick: int) -> None:
        if node.last_access == tick:
            return
        is_leaf = not node.children
        if is_leaf:
            self._leaves.remove(node)
        node.last_access = tick
        if is_leaf:
            self._leaves.add(node)

    def _prune(self) -> None:
        while self._bytes > self.max_size * self.unit and self._leaves:
            leaf = self._leaves.pop(0)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.unit]]
            self._bytes -= len(leaf.key)
            self.pruned += len(leaf.key) // self.unit
            if not parent.children and parent is not self.root:
                self._leaves.add(parent)

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the size, leaf index and parent links agree with the tree (for tests)."""
        total, leaves = 0, 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node and child.key[: self.unit] == first and child.key
                total += len(child.key)
                leaves += not child.children
                stack.append(child)
        assert total == self._bytes, (total, self._bytes)
        assert leaves == len(self._leaves), (leaves, len(self._leaves))
