"""RadixCache: a radix tree from token prefixes to the KV slots that hold them.

Keys are token ids packed as int32 bytes, so comparing a node's key with a slice of a prompt is one
memcmp. Every node key, every match and every insert is a whole number of pages; children are keyed by
their first page. Each namespace (cache salt, adapter id) has its own root, so two namespaces never
share KV. Evictable leaves sit in a sorted index (see ``eviction``) that the tree updates as nodes are
locked, unlocked, touched, created and removed.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Hashable, Iterator

import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.base import EMPTY_SLOTS, CacheStats, MatchResult, PrefixCache, ReqKV, TokenSeq, key_bytes
from radix.errors import KVCacheError
from radix.events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    EventSink,
    chain_hashes,
    root_hash,
)
from radix.eviction import EvictionIndex, make_policy
from radix.snapshot import TreeSnapshot, build_snapshot


class TreeNode:
    __slots__ = (
        "children",
        "evict_key",
        "hashes",
        "hit_count",
        "key",
        "last_access",
        "lock_ref",
        "node_id",
        "parent",
        "value",
    )

    def __init__(self, node_id: int, key: bytes, value: torch.Tensor, parent: TreeNode | None):
        self.node_id = node_id
        self.key = key  # int32-packed token ids, a whole number of pages
        self.value = value  # KV slot of each token (int64)
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.evict_key: tuple | None = None
        self.hashes: array | None = None  # chained block hashes, only when events are on

    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2

    @property
    def tier(self) -> str:
        """Where this node's KV lives (``device``; a tiered cache's nodes may say ``host`` too)."""
        return "device"


class RadixCache(PrefixCache):
    """The prefix-sharing cache. See ``radix.base`` for the ownership rules it implements."""

    node_type: type[TreeNode] = TreeNode  # a tiered cache stores richer nodes (``radix.hierarchical_cache``)

    def __init__(
        self,
        allocator: PagedAllocator,
        req_to_token: ReqToTokenPool,
        eviction_policy: str = "lru",
        event_sink: EventSink | None = None,
    ):
        super().__init__(allocator, req_to_token)
        self._unit = 4 * self.page_size  # bytes per page of key
        self._index: EvictionIndex[TreeNode] = EvictionIndex(make_policy(eviction_policy))
        self._events = event_sink
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.reset_stats()
        self._clear_tree()

    @property
    def eviction_policy(self) -> str:
        return self._index.policy.name

    # ------------------------------------------------------------------ state
    def _clear_tree(self) -> None:
        self._roots: dict[Hashable | None, TreeNode] = {}
        self._index.clear()
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0

    def reset_stats(self) -> None:
        self._hit = self._miss = self._evicted = self._inserted = 0

    def _root(self, namespace: Hashable | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self.node_type(0, b"", EMPTY_SLOTS, None)
            root.lock_ref = 1  # roots are never evicted
            if self._events is not None:
                root.hashes = array("Q", [root_hash(namespace)])
            self._roots[namespace] = root
        return root

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    # ------------------------------------------------------------------ lookup
    def match_prefix(
        self, tokens: TokenSeq, namespace: Hashable | None = None, *, record: bool = True
    ) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens``: its KV slots and the node ending it.

        This may split a node: when the prefix ends inside a node's key, the node is cut in two at the
        page boundary after the last matching page, so that the returned node ends exactly where the
        match does and can be locked on its own. Splits never change what is cached or the accounting.
        Matching counts as a use (LRU time, LFU hits); ``record`` adds the result to the hit statistics.
        """
        key = key_bytes(tokens)
        node, pos, values = self._walk(key, self._root(namespace), split=True, hit=True)
        if record:
            self.record_lookup(pos >> 2, len(key) >> 2)
        kv = values[0] if len(values) == 1 else (torch.cat(values) if values else EMPTY_SLOTS)
        return MatchResult(kv, node)

    def _walk(
        self, key: bytes, node: TreeNode, split: bool, hit: bool
    ) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``key`` down from ``node``; returns the last node reached, the matched bytes, values."""
        unit = self._unit
        end = len(key) // unit * unit
        tick = next(self._clock)
        node.last_access = tick
        pos = 0
        values: list[torch.Tensor] = []
        while pos < end:
            child = node.children.get(key[pos : pos + unit])
            if child is None:
                break
            ck = child.key
            size = len(ck)
            if pos + size > end or key[pos : pos + size] != ck:
                common = self._common_prefix(ck, key, pos, end)
                if not split:
                    break
                child = self._split(child, common)
                size = common
            child.last_access = tick
            if hit:
                child.hit_count += 1
            if child.evict_key is not None:
                self._index.refresh(child)
            values.append(child.value)
            pos += size
            node = child
        return node, pos, values

    def _common_prefix(self, ck: bytes, key: bytes, pos: int, end: int) -> int:
        """Bytes (whole pages) that ``ck`` shares with ``key[pos:end]``; at least one page, by the caller."""
        unit = self._unit
        lo, hi = 1, min(len(ck), end - pos) // unit  # the first page matched via the children dict
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ck[: mid * unit] == key[pos : pos + mid * unit]:
                lo = mid
            else:
                hi = mid - 1
        return lo * unit

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` after ``at`` bytes of its key; returns the new upper node (same locks and time)."""
        parent = child.parent
        assert parent is not None
        ntok = at >> 2
        upper = self.node_type(next(self._ids), child.key[:at], child.value[:ntok], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        if child.hashes is not None:
            nblocks = ntok // self.page_size
            upper.hashes = child.hashes[:nblocks]
            child.hashes = child.hashes[nblocks:]
        child.key = child.key[at:]
        child.value = child.value[ntok:]
        child.parent = upper
        upper.children[child.key[: self._unit]] = child
        parent.children[upper.key[: self._unit]] = upper
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: TokenSeq, slots: torch.Tensor, namespace: Hashable | None = None) -> int:
        """Cache ``slots`` as the KV of ``tokens`` (whole pages only; a partial last page is ignored).

        Returns the number of leading tokens that were cached already: the caller still owns its slots
        for those positions and must free them. The slots past that point now belong to the cache.
        """
        key = key_bytes(tokens)
        end = len(key) // self._unit * self._unit
        node, pos, _ = self._walk(key[:end], self._root(namespace), split=True, hit=False)
        if pos < end:
            self._add_leaf(node, key, pos, end, slots, namespace)
        return pos >> 2

    def _add_leaf(
        self, node: TreeNode, key: bytes, pos: int, end: int, slots: torch.Tensor, namespace: Hashable | None
    ) -> TreeNode:
        """Hang ``key[pos:end]`` (KV in ``slots[pos/4 : end/4]``) under ``node`` as a new evictable leaf."""
        if node.evict_key is not None:  # it is about to get a child
            self._index.discard(node)
        leaf = self.node_type(next(self._ids), key[pos:end], slots[pos >> 2 : end >> 2], node)
        leaf.last_access = node.last_access
        node.children[leaf.key[: self._unit]] = leaf
        self._num_nodes += 1
        self._evictable += leaf.num_tokens
        self._inserted += leaf.num_tokens
        self._index.add(leaf)
        if self._events is not None:
            parent_hash = node.hashes[-1] if node.hashes else root_hash(namespace)
            leaf.hashes = chain_hashes(parent_hash, leaf.key, self._unit)
            self._events(
                BlocksStored(
                    namespace, parent_hash, leaf.hashes.tolist(), array("i", leaf.key).tolist(), self.page_size
                )
            )
        return leaf

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= node.num_tokens
                self._protected += node.num_tokens
                if node.evict_key is not None:
                    self._index.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise KVCacheError(f"unlock of node {node.node_id} that holds no lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += node.num_tokens
                self._protected -= node.num_tokens
                if self._is_device_leaf(node):
                    self._index.add(node)
            node = node.parent

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """Whether eviction may take ``node`` once unlocked: here, a leaf (a tiered tree counts device children)."""
        return not node.children

    # ------------------------------------------------------------------ eviction
    def evict(self, n_tokens: int) -> torch.Tensor:
        """Evict whole unlocked leaves in policy order until ``n_tokens`` are freed or none is left."""
        freed: list[torch.Tensor] = []
        total = 0
        while total < n_tokens and len(self._index):
            node = self._index.pop_first()
            self._remove_leaf(node)
            freed.append(node.value)
            total += node.num_tokens
        self._evicted += total
        return torch.cat(freed) if freed else EMPTY_SLOTS

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        self.allocator.free(node.value)
        del parent.children[node.key[: self._unit]]
        self._evictable -= node.num_tokens
        self._num_nodes -= 1
        if self._events is not None and node.hashes is not None:
            self._events(BlocksRemoved(node.hashes.tolist()))
        if parent.parent is not None and not parent.children and parent.lock_ref == 0:
            self._index.add(parent)

    # ------------------------------------------------------------------ flush and stats
    def reset(self) -> None:
        if self._protected:
            raise KVCacheError(f"cannot flush the cache: {self._protected} tokens are locked by requests")
        for node in self._iter_nodes():
            self.allocator.free(node.value)
        self._clear_tree()
        if self._events is not None:
            self._events(AllBlocksCleared())

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def owned_slots(self) -> list[torch.Tensor]:
        return [n.value for n in self._iter_nodes()]

    def stats(self) -> CacheStats:
        return CacheStats(
            hit_tokens=self._hit,
            miss_tokens=self._miss,
            num_nodes=self._num_nodes,
            cached_tokens=self._evictable + self._protected,
            evictable_size=self._evictable,
            protected_size=self._protected,
            evicted_tokens=self._evicted,
            inserted_tokens=self._inserted,
        )

    def eviction_order(self) -> list[TreeNode]:
        """Evictable leaves, first to go first (introspection for tests and dashboards)."""
        return self._index.peek_order()

    def snapshot_events(self) -> list[CacheEvent]:
        """Events that rebuild the whole tree from scratch (for a consumer that joins late)."""
        if self._events is None:
            raise KVCacheError("snapshot_events needs the cache to be built with an event sink")
        out: list[CacheEvent] = [AllBlocksCleared()]
        for namespace, root in self._roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                parent = node.parent
                assert parent is not None and parent.hashes is not None and node.hashes is not None
                out.append(BlocksStored(namespace, parent.hashes[-1], node.hashes.tolist(),
                                        array("i", node.key).tolist(), self.page_size))
                stack.extend(node.children.values())
        return out

    def snapshot(self, max_nodes: int = 500, min_tokens: int = 1, preview_tokens: int = 32) -> TreeSnapshot:
        """A read-only, size-bounded copy of the tree for dashboards (see ``radix.snapshot``)."""
        return build_snapshot(self._roots, max_nodes, min_tokens, preview_tokens)

    def block_hashes(self) -> set[int]:
        """Every cached block's hash (requires events); equals a ``CacheMirror``'s keys."""
        return {h for n in self._iter_nodes() for h in (n.hashes or ())}

    # ------------------------------------------------------------------ request-level
    def cache_finished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        key = key_bytes(tokens)
        n = len(key) >> 2
        assert n == state.kv_len, f"{n} tokens given for a request holding {state.kv_len} KV slots"
        aligned = n // self.page_size * self.page_size
        # A copy: the row is reused by the next request, the cache keeps these slot numbers.
        slots = self.req_to_token.read(state.row, 0, n).clone()
        cached = self.insert(key[: 4 * aligned], slots[:aligned], state.namespace)
        if cached > state.protected_len:
            self.allocator.free(slots[state.protected_len : cached])
        if n > aligned:
            self.allocator.free(slots[aligned:n])
        self._drop_lock(state)
        self.req_to_token.free(state.row)

    def cache_unfinished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        key = key_bytes(tokens)
        n = len(key) >> 2
        assert n <= state.kv_len, f"{n} tokens given for a request holding {state.kv_len} KV slots"
        aligned = n // self.page_size * self.page_size
        if aligned <= state.protected_len:
            return
        slots = self.req_to_token.read(state.row, 0, aligned).clone()
        cached = self.insert(key[: 4 * aligned], slots, state.namespace)
        if cached > state.protected_len:
            self.allocator.free(slots[state.protected_len : cached])
        match = self.match_prefix(key[: 4 * aligned], state.namespace, record=False)
        assert match.length == aligned, "a prefix just inserted must match in full"
        self.req_to_token.write(state.row, 0, match.kv_indices)
        self.lock(match.last_node)
        if state.last_node is not None:
            self.unlock(state.last_node)
        state.last_node = match.last_node
        state.protected_len = aligned
