"""HierarchicalRadixCache: one radix tree over two tiers of KV memory, the device pool and the host pool.

A node's KV is on the device (``value``: device slots), on the host (``host_value``: host slots of a
``HostKVPool``), or both. The rules that keep matching and accounting simple (also in ``radix.base``):

* the device-resident nodes are prefix-closed: a node on the device has its parent on the device, so a
  match is a device prefix followed by host-only nodes; device eviction takes only *device leaves*
  (unlocked nodes with no device-resident child), which keeps the set closed;
* a locked node is on the device (locks are taken on device matches; ``lock`` refuses a host-only node);
* every node is on at least one tier.

Device eviction of a device leaf: with a host copy (write_through made one at insertion, or write_back
makes one now) the node stays in the tree, host-only, and only its device slots are freed; without one
(the host pool is full even after dropping host-only leaves) it leaves the tree as in ``RadixCache``.
Host pressure drops host-only *leaves* in LRU order; ``LowerTier.on_host_evict`` sees each one (its
block hashes and host slots, still readable) before its slots are freed — the hook for a disk tier.

Router events: a block on the host only is still cached (a request for it is a hit, after a load back),
so ``BlocksRemoved`` is emitted only when a block leaves the tree, i.e. leaves every tier. Moves between
tiers emit nothing.

The scheduler's side: ``match_prefix`` as before (``MatchResult.length`` is the device prefix); when
``match.host_len > 0``, ``load_back(match)`` allocates device pages (evicting as needed, or raising
``KVOutOfMemoryError``), starts the host → device copy and returns the whole prefix as a device match,
to be locked with ``assign_prefix`` right away; call ``handle.wait()`` before the forward pass reads it.

Visibility: ``stats()`` reports hits per tier (attributed when the scheduler records a lookup, see
``radix.tier_stats``; device + host + disk == hit_tokens), bytes copied each way and the time admissions
waited for loads. The host books and residency rules are checked by ``radix.tiered_integrity``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable

import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.base import EMPTY_SLOTS, CacheStats, MatchResult, ReqKV, TokenSeq, key_bytes
from radix.errors import KVCacheError, KVOutOfMemoryError
from radix.events import BlocksRemoved, EventSink
from radix.eviction import EvictionIndex, make_policy
from radix.host_pool import DONE, HostKVPool
from radix.kv_storage import KVPages
from radix.radix_cache import RadixCache, TreeNode
from radix.tier_stats import TierCounters
from radix.tiered_integrity import check_tiered_books
from radix.tiered_node import WRITE_POLICIES, LoadBack, LowerTier, TieredNode, node_path

__all__ = ["WRITE_POLICIES", "HierarchicalRadixCache", "LoadBack", "LowerTier", "TieredNode"]


class HierarchicalRadixCache(RadixCache):
    """``RadixCache`` with a host-memory tier behind the device pool (see the module docstring)."""

    node_type = TieredNode

    def __init__(
        self,
        allocator: PagedAllocator,
        req_to_token: ReqToTokenPool,
        device_kv: KVPages,
        host_pool: HostKVPool,
        write_policy: str = "write_through",
        eviction_policy: str = "lru",
        event_sink: EventSink | None = None,
        lower_tier: LowerTier | None = None,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose one of {list(WRITE_POLICIES)}")
        if host_pool.page_size != allocator.page_size or device_kv.total_slots != allocator.total_slots:
            raise ValueError("the host pool and the device storage must match the device allocator's pages")
        self.device_kv = device_kv
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.lower_tier = lower_tier
        self._host_index: EvictionIndex[TieredNode] = EvictionIndex(make_policy("lru"), "host_evict_key")
        self._loading: set[int] = set()  # ids of host nodes being loaded back: host pressure skips them
        self._bytes_per_token = device_kv.shape.bytes_per_token
        super().__init__(allocator, req_to_token, eviction_policy, event_sink)

    # ------------------------------------------------------------------ state
    def _clear_tree(self) -> None:
        super()._clear_tree()
        self._host_index.clear()
        self._host_only = 0

    def reset_stats(self) -> None:
        super().reset_stats()
        self._tiers = TierCounters()

    def record_lookup(self, hit_tokens: int, total_tokens: int) -> None:
        """Count the lookup, its host and disk part being what the admission's load brought in."""
        super().record_lookup(hit_tokens, total_tokens)
        self._tiers.claim(hit_tokens)

    # ------------------------------------------------------------------ lookup
    def match_prefix(
        self, tokens: TokenSeq, namespace: Hashable | None = None, *, record: bool = True
    ) -> MatchResult:
        """The device-resident prefix (slots and last node, as ``RadixCache``) and the host-only nodes that
        continue it (``host_nodes``). Splits like ``RadixCache``; ``record`` counts only the device part (a
        host hit is counted when ``load_back`` brings it in)."""
        key = key_bytes(tokens)
        root = self._root(namespace)
        node, _, values = self._walk(key, root, split=True, hit=True)
        path = node_path(node)
        i = 0
        while i < len(path) and path[i].on_device:
            i += 1
        for n in path[i:]:
            self._host_index.refresh(n)  # a touch renews host LRU time too
        dev = values[:i]
        kv = dev[0] if len(dev) == 1 else (torch.cat(dev) if dev else EMPTY_SLOTS)
        if record:
            self._tiers.forget_pending()  # a lookup recorded here loaded nothing: all of it is a device hit
            self.record_lookup(int(kv.numel()), len(key) >> 2)
        return MatchResult(kv, path[i - 1] if i else root, tuple(path[i:]))

    def load_to_device(
        self, match: MatchResult, key: TokenSeq | None = None, namespace: Hashable | None = None
    ) -> MatchResult:
        """``load_back`` for the scheduler's admission: the caller's stream waits for the copy (on CPU it is
        already done), and a device without room leaves the match at its device part (the rest is computed)."""
        self._tiers.forget_pending()  # a new admission: earlier loads' tokens are plain device KV now
        return self._load_tiers(match, key, namespace)

    def _load_tiers(self, match: MatchResult, key: TokenSeq | None, namespace: Hashable | None) -> MatchResult:
        """The loads of one admission (a lower tier's cache extends this)."""
        if not match.host_len:
            return match
        t0 = time.perf_counter()
        try:
            loaded = self.load_back(match)
        except KVOutOfMemoryError:
            return match
        loaded.handle.wait()
        self._tiers.timed("host", time.perf_counter() - t0)
        return loaded.match

    def load_back(self, match: MatchResult) -> LoadBack:
        """Bring ``match.host_nodes`` back to the device: allocate device pages (evicting as needed; raises
        ``KVOutOfMemoryError`` when there is no room, the nodes staying on the host), start the copy,
        and make the nodes device-resident (their host copies stay). Returns the whole prefix as a device
        match: lock it (``assign_prefix``) before anything else allocates, and ``handle.wait()`` before a
        forward pass reads it. The match must be fresh (no other match or insert in between)."""
        nodes: list[TieredNode] = list(match.host_nodes)
        if not nodes:
            return LoadBack(match, EMPTY_SLOTS, DONE)
        anchor = match.last_node
        parent = anchor
        for n in nodes:
            if n.parent is not parent or n.on_device or n.host_value is None:
                raise KVCacheError("load_back of a stale match (the tree changed since): match again")
            parent = n
        n_tokens = sum(n.num_tokens for n in nodes)
        last = nodes[-1]
        ids = {n.node_id for n in nodes}
        self.lock(anchor)  # the anchor must stay on the device while eviction makes room under it
        self._host_index.discard(last)
        self._loading |= ids
        try:
            slots = self._alloc_device(n_tokens)
            host_slots = torch.cat([n.host_value for n in nodes if n.host_value is not None])
            try:
                handle = self.host_pool.restore(host_slots, self.device_kv, slots)
            except BaseException:
                self.allocator.free(slots)
                raise
            off = 0
            for n in nodes:
                self._promote(n, slots[off : off + n.num_tokens])
                off += n.num_tokens
        finally:
            self._loading -= ids
            if not last.on_device and not last.children:
                self._host_index.add(last)
            self.unlock(anchor)
        self._tiers.loaded("host", n_tokens)
        return LoadBack(MatchResult(torch.cat([match.kv_indices, slots]), last), slots, handle)

    def _alloc_device(self, n_tokens: int) -> torch.Tensor:
        alloc = self.allocator
        self.make_room(alloc.pages_for(n_tokens) * self.page_size, f"loading {n_tokens} tokens back from the host")
        return alloc.alloc(n_tokens)

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: TokenSeq, slots: torch.Tensor, namespace: Hashable | None = None, *,
               host_copy: bool = True) -> int:
        """As ``RadixCache.insert``; host-only nodes on the path adopt the caller's slots (the caller
        computed that KV itself) and are on both tiers again. Returns the device-cached length.

        ``host_copy=False``: the KV has a copy in a tier below the host already (it was just loaded from
        disk), so write_through makes no host copy of the new leaf now, on the request's time to first
        token; like every node without one, it gets its host copy if it is evicted from the device."""
        key = key_bytes(tokens)
        end = len(key) // self._unit * self._unit
        node, pos, _ = self._walk(key[:end], self._root(namespace), split=True, hit=False)
        path = node_path(node)
        cached = 0
        i = 0
        while i < len(path) and path[i].on_device:
            cached += path[i].num_tokens
            i += 1
        off = cached
        for n in path[i:]:
            self._promote(n, slots[off : off + n.num_tokens])
            off += n.num_tokens
        if pos < end:
            leaf = self._add_leaf(node, key, pos, end, slots, namespace)
            if host_copy and self.write_policy == "write_through":
                self._backup(leaf)  # no room even after dropping host-only leaves: backed up on eviction
        return cached

    def _add_leaf(
        self, node: TreeNode, key: bytes, pos: int, end: int, slots: torch.Tensor, namespace: Hashable | None
    ) -> TieredNode:
        leaf = super()._add_leaf(node, key, pos, end, slots, namespace)
        assert isinstance(node, TieredNode) and isinstance(leaf, TieredNode)
        node.device_children += 1
        return leaf

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        upper = super()._split(child, at)
        assert isinstance(child, TieredNode) and isinstance(upper, TieredNode)
        if child.host_value is not None:
            ntok = upper.num_tokens
            upper.host_value = child.host_value[:ntok]
            child.host_value = child.host_value[ntok:]
        upper.device_children = 1 if child.on_device else 0
        return upper

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        if isinstance(node, TieredNode) and not node.on_device:
            raise KVCacheError(f"lock of node {node.node_id}, which is on the host only: load_back it first")
        super().lock(node)

    def _is_device_leaf(self, node: TreeNode) -> bool:
        # a node whose children are all host-only is a device leaf too
        return isinstance(node, TieredNode) and node.device_children == 0

    # ------------------------------------------------------------------ tier moves
    def evict(self, n_tokens: int) -> torch.Tensor:
        """Free at least ``n_tokens`` device tokens from device leaves in policy order: a leaf with a host
        copy (existing, or made now) stays in the tree on the host; one without leaves the tree."""
        freed: list[torch.Tensor] = []
        total = 0
        while total < n_tokens and len(self._index):
            node = self._index.pop_first()
            assert isinstance(node, TieredNode)
            freed.append(node.value)
            total += node.num_tokens
            if node.host_value is not None or self._backup(node):
                self._demote(node)
            else:
                self._remove_device_leaf(node)
        self._evicted += total
        return torch.cat(freed) if freed else EMPTY_SLOTS

    def _backup(self, node: TieredNode) -> bool:
        """Give ``node`` a host copy of its device KV, dropping host-only leaves for room; False if none."""
        k = node.num_tokens
        if k > self.host_pool.capacity:
            return False
        if self.host_pool.free_size < k:
            self._make_host_room(k)
            if self.host_pool.free_size < k:
                return False
        node.host_value, _ = self.host_pool.backup(self.device_kv, node.value)
        self._tiers.to_host += k
        return True

    def _demote(self, node: TieredNode) -> None:
        """Device leaf with a host copy → host-only: free its device slots, keep it in the tree."""
        self.allocator.free(node.value)
        node.value = EMPTY_SLOTS
        self._evictable -= node.num_tokens
        self._host_only += node.num_tokens
        self._device_child_gone(node.parent)
        if not node.children:
            self._host_index.add(node)

    def _promote(self, node: TieredNode, slots: torch.Tensor) -> None:
        """Host-only node (unlocked) → on both tiers, its device KV in ``slots``."""
        parent = node.parent
        assert isinstance(parent, TieredNode) and parent.on_device and node.lock_ref == 0
        node.value = slots
        self._evictable += node.num_tokens
        self._host_only -= node.num_tokens
        self._host_index.discard(node)
        if parent.evict_key is not None:  # no longer a device leaf
            self._index.discard(parent)
        parent.device_children += 1
        if node.device_children == 0:
            self._index.add(node)

    def _device_child_gone(self, parent: TreeNode | None) -> None:
        assert isinstance(parent, TieredNode)
        parent.device_children -= 1
        if parent.parent is not None and parent.device_children == 0 and parent.lock_ref == 0:
            self._index.add(parent)

    def _remove_device_leaf(self, node: TieredNode) -> None:
        """A device leaf with no host copy leaves the tree, with the host-only subtree below it (if any)."""
        parent = node.parent
        assert parent is not None and node.lock_ref == 0
        stack = list(node.children.values())
        order: list[TieredNode] = []
        while stack:  # every descendant of a device leaf is host-only
            child = stack.pop()
            order.append(child)  # type: ignore[arg-type]
            stack.extend(child.children.values())
        for child in reversed(order):  # deepest first, so each is a leaf when dropped
            self._host_index.discard(child)
            self._drop_host_leaf(child)
        self._host_index.discard(node)
        self.allocator.free(node.value)
        del parent.children[node.key[: self._unit]]
        self._evictable -= node.num_tokens
        self._num_nodes -= 1
        if self._events is not None and node.hashes is not None:
            self._events(BlocksRemoved(node.hashes.tolist()))
        self._device_child_gone(parent)

    def _make_host_room(self, n_tokens: int) -> None:
        """Drop host-only leaves, least recently used first, until ``n_tokens`` host tokens are free."""
        while self.host_pool.free_size < n_tokens and len(self._host_index):
            self._drop_host_leaf(self._host_index.pop_first())

    def _drop_host_leaf(self, node: TieredNode) -> None:
        parent = node.parent
        assert isinstance(parent, TieredNode) and node.host_value is not None
        assert not node.on_device and not node.children and node.lock_ref == 0
        hashes = node.hashes.tolist() if node.hashes is not None else None
        if self.lower_tier is not None:
            self.host_pool.complete_backups()  # the lower tier reads these host rows: land them first
            self.lower_tier.on_host_evict(node, hashes, node.host_value, self.host_pool)
        self.host_pool.free(node.host_value)
        node.host_value = None
        del parent.children[node.key[: self._unit]]
        self._num_nodes -= 1
        self._host_only -= node.num_tokens
        self._tiers.host_dropped += node.num_tokens
        if self._events is not None and hashes is not None:
            self._events(BlocksRemoved(hashes))
        if not parent.on_device and not parent.children and parent.node_id not in self._loading:
            self._host_index.add(parent)

    def evict_host(self, n_tokens: int) -> int:
        """Drop host-only leaves (LRU) until ``n_tokens`` host tokens are free; returns the host free size."""
        self._make_host_room(n_tokens)
        return self.host_pool.free_size

    # ------------------------------------------------------------------ flush, stats, integrity
    def reset(self) -> None:
        if self._protected:
            raise KVCacheError(f"cannot flush the cache: {self._protected} tokens are locked by requests")
        for node in self._iter_nodes():
            assert isinstance(node, TieredNode)
            if node.host_value is not None:
                self.host_pool.free(node.host_value)
                node.host_value = None
        super().reset()

    def stats(self) -> CacheStats:
        pool = self.host_pool
        return self._tiers.host_stats(super().stats(), capacity=pool.capacity, free=pool.free_size,
                                      host_only=self._host_only, bytes_per_token=self._bytes_per_token)

    def host_eviction_order(self) -> list[TieredNode]:
        """Host-only leaves, first to be dropped first (introspection for tests and dashboards)."""
        return self._host_index.peek_order()

    def check_integrity(self, states: Iterable[ReqKV] = ()) -> dict[str, int]:
        """The device books (``PrefixCache.check_integrity``), the host books (host_free + host slots held
        by nodes == host capacity, every host page one owner) and the residency rules of the module doc."""
        report = super().check_integrity(states)
        report.update(check_tiered_books(self._iter_nodes(), self.host_pool.allocator, self._loading, self._host_only))
        return report
