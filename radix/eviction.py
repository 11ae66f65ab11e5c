"""Eviction order over the cache's evictable leaves, kept in a sorted index updated incrementally.

A node is *evictable* when it is a leaf, is not the root and holds no lock. The tree tells the index
whenever a node enters or leaves that state, or is touched while in it; eviction then pops the smallest
key in O(log n) instead of scanning the tree.

Policies differ only in the sort key, so they are small classes behind one interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Protocol, TypeVar

from sortedcontainers import SortedList


class EvictableNode(Protocol):
    node_id: int
    last_access: int
    hit_count: int
    evict_key: Any


N = TypeVar("N", bound=EvictableNode)


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def key(self, node: EvictableNode) -> tuple:
        """Smaller keys are evicted first; the node id breaks ties so keys are unique."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first (``last_access`` is a logical clock, so ties cannot happen)."""

    name = "lru"

    def key(self, node: EvictableNode) -> tuple:
        return (node.last_access, node.node_id)


class LFUPolicy(EvictionPolicy):
    """Least frequently hit first; among equals, least recently used."""

    name = "lfu"

    def key(self, node: EvictableNode) -> tuple:
        return (node.hit_count, node.last_access, node.node_id)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


class EvictionIndex(Generic[N]):
    """Sorted set of evictable nodes. Each node remembers the key it was filed under in the attribute
    ``key_attr`` (``evict_key`` by default; a second index over the same nodes, such as the host tier's,
    names another attribute so that the two never see each other's entries)."""

    def __init__(self, policy: EvictionPolicy, key_attr: str = "evict_key"):
        self.policy = policy
        self.key_attr = key_attr
        self._sorted: SortedList = SortedList()
        self._nodes: dict[int, N] = {}

    def __len__(self) -> int:
        return len(self._sorted)

    def __contains__(self, node: N) -> bool:
        return getattr(node, self.key_attr) is not None

    def add(self, node: N) -> None:
        old = getattr(node, self.key_attr)
        if old is not None:
            self._sorted.remove(old)
        key = self.policy.key(node)
        setattr(node, self.key_attr, key)
        self._sorted.add(key)
        self._nodes[node.node_id] = node

    def discard(self, node: N) -> None:
        old = getattr(node, self.key_attr)
        if old is not None:
            self._sorted.remove(old)
            setattr(node, self.key_attr, None)
            del self._nodes[node.node_id]

    def refresh(self, node: N) -> None:
        """Re-file a node whose access time or hit count changed (no-op when it is not indexed)."""
        if getattr(node, self.key_attr) is not None:
            self.add(node)

    def pop_first(self) -> N:
        key = self._sorted.pop(0)
        node = self._nodes.pop(key[-1])
        setattr(node, self.key_attr, None)
        return node

    def peek_order(self) -> list[N]:
        """Nodes in eviction order (for tests and introspection)."""
        return [self._nodes[k[-1]] for k in self._sorted]

    def clear(self) -> None:
        for node in self._nodes.values():
            setattr(node, self.key_attr, None)
        self._sorted.clear()
        self._nodes.clear()
