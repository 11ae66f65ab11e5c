"""DiskTieredRadixCache: the hierarchical cache (device + host) with a disk tier (``radix.disk_tier``) below.

The tree itself is the host tier's (``radix.hierarchical_cache``): the disk holds no tree nodes, only
blocks named by their prefix's chained hash, so a fresh process (a restart) starts with an empty tree and
a full disk. What this class adds:

* Write-through to disk. When the tree caches a request's tokens (``cache_finished_req``, and
  ``cache_unfinished_req`` after each prefill chunk), the complete disk blocks of that prefix that are not
  on disk yet are gathered from the request's device slots and queued for the background writer. A
  finished request's last token is left out: in the overlap loop its KV may still be being written by the
  batch in flight.
* Reads at admission. ``load_to_device(match, key, namespace)`` (through the host tier's ``_load_tiers``
  hook, so the per-tier hit attribution of ``radix.tier_stats`` stays in one place) first loads the match's
  host part (as the host tier does); then, if the match stops short of the caller's key, it reads the disk
  blocks from the one holding the match's end on, in order, up to the first missing or corrupt one;
  allocates device slots for the new positions (the matched prefix locked meanwhile, so making room cannot
  evict it), copies each block's KV in as it is read (``DiskTier.load``), inserts the tokens into the tree
  and returns a fresh device match. The inserted nodes get no host copy at once, even under write_through:
  the disk holds them, and copying them to the host would only delay the request's first token (they are
  copied to the host if they are evicted from the device, as any node without a host copy is). Only
  blocks that lie wholly inside ``key`` are used: the caller's key is what it may reuse, and a block's hash
  needs all its tokens.

``reset`` (``/flush_cache``) flushes the device and host tiers and waits for queued disk writes; the blocks
on disk stay (they are what a restart resumes from; ``DiskKVStore.clear`` removes them).

Accounting: disk blocks hold no slots, so ``check_integrity`` is the host tier's unchanged; the slots a
load allocates are either adopted by the tree (``insert``) or freed at once (duplicates).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.base import CacheStats, MatchResult, ReqKV, TokenSeq, key_bytes
from radix.disk_tier import DiskTier
from radix.errors import KVOutOfMemoryError
from radix.events import EventSink
from radix.hierarchical_cache import HierarchicalRadixCache
from radix.host_pool import HostKVPool
from radix.kv_storage import KVPages


@dataclass
class DiskCacheStats(CacheStats):
    """``CacheStats`` with the disk tier's hits, loads and its report (``DiskTier.report``)."""

    disk_hit_tokens: int = 0  # recorded hits whose tokens were loaded from disk (``radix.tier_stats``)
    disk_loads: int = 0  # admissions that loaded at least one block
    disk_load_seconds: float = 0.0  # read + verify + copy into the device pool, summed over those loads
    disk: dict[str, Any] = field(default_factory=dict)

    @property
    def device_hit_tokens(self) -> int:
        return max(0, self.hit_tokens - self.host_hit_tokens - self.disk_hit_tokens)


class DiskTieredRadixCache(HierarchicalRadixCache):
    """``HierarchicalRadixCache`` with a disk tier under the host pool (see the module docstring)."""

    def __init__(
        self,
        allocator: PagedAllocator,
        req_to_token: ReqToTokenPool,
        device_kv: KVPages,
        host_pool: HostKVPool,
        disk: DiskTier,
        write_policy: str = "write_through",
        eviction_policy: str = "lru",
        event_sink: EventSink | None = None,
    ):
        if disk.block_tokens % allocator.page_size or disk.shape != device_kv.shape:
            raise ValueError("the disk tier's blocks must be whole pages of the device storage's layout")
        self.disk = disk
        super().__init__(allocator, req_to_token, device_kv, host_pool, write_policy, eviction_policy, event_sink)

    # ------------------------------------------------------------------ writes
    def cache_finished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        key = key_bytes(tokens)
        self._offer(state, key[: max(0, len(key) - 4)])  # not the last token (see the module docstring)
        super().cache_finished_req(state, key)

    def cache_unfinished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        key = key_bytes(tokens)
        self._offer(state, key)
        super().cache_unfinished_req(state, key)

    def _offer(self, state: ReqKV, key: bytes) -> None:
        n = len(key) >> 2
        bt = self.disk.block_tokens
        if n >= bt:
            slots = self.req_to_token.read(state.row, 0, n // bt * bt)
            self.disk.offer(key, state.namespace, slots, self.device_kv)

    # ------------------------------------------------------------------ reads
    def _load_tiers(self, match: MatchResult, key: TokenSeq | None, namespace: Hashable | None) -> MatchResult:
        """The host tier's load, then the disk blocks that continue the match within ``key`` (see the module
        docstring). Without room on the device, or without blocks on disk, the match stays as it is."""
        match = super()._load_tiers(match, key, namespace)
        if key is None or match.host_len:
            return match
        key = key_bytes(key)
        bt = self.disk.block_tokens
        start = match.length
        first, last = start // bt, (len(key) >> 2) // bt  # blocks [first, last) lie wholly inside the key
        if first >= last:
            return match
        t0 = time.perf_counter()
        hashes = self.disk.present(key, namespace, first, last - first)
        if not hashes:
            return match
        anchor = match.last_node
        self.lock(anchor)  # making room below must not evict the matched prefix
        try:
            try:
                slots = self._alloc_device((first + len(hashes)) * bt - start)
            except KVOutOfMemoryError:
                return match
            skip = start - first * bt  # the match may end inside the first block: its head is cached already

            def place(i: int, kv: torch.Tensor) -> None:
                lo = 0 if i == 0 else i * bt - skip
                kv = kv[:, :, skip:] if i == 0 else kv
                self.device_kv.write(slots[lo : lo + kv.shape[2]], kv[:, 0], kv[:, 1])

            try:
                loaded = self.disk.load(hashes, place)  # a tensor-parallel pool's copy may fail
            except BaseException:
                self.allocator.free(slots)
                raise
            end = (first + loaded) * bt
            if end <= start:
                self.allocator.free(slots)
                return match
            if end - start < len(slots):  # a block failed its checks: the ones after it are not used
                self.allocator.free(slots[end - start :])
                slots = slots[: end - start]
            every = torch.cat([match.kv_indices, slots])
            cached = self.insert(key[: 4 * end], every, namespace, host_copy=False)  # the disk has it
            if cached > start:  # the tree had those positions already: ours are duplicates
                self.allocator.free(every[start:cached])
        finally:
            self.unlock(anchor)
        fresh = self.match_prefix(key[: 4 * end], namespace, record=False)
        seconds = time.perf_counter() - t0
        self.disk.record_load(fresh.length - start, seconds)
        self._tiers.loaded("disk", fresh.length - start)
        self._tiers.timed("disk", seconds)
        return fresh

    # ------------------------------------------------------------------ flush, stats
    def reset(self) -> None:
        """Flush the device and host tiers; queued disk writes land first, and the disk keeps its blocks."""
        self.disk.flush()
        super().reset()

    def close(self) -> None:
        """Write what is queued and stop the disk writer (the cache stays usable without disk writes)."""
        self.disk.close()

    def stats(self) -> DiskCacheStats:
        base = super().stats()
        t = self._tiers
        return DiskCacheStats(**asdict(base), disk_hit_tokens=t.hit_tokens["disk"], disk_loads=t.loads["disk"],
                              disk_load_seconds=t.load_seconds["disk"], disk=self.disk.report())
