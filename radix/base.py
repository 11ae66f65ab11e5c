"""The prefix-cache interface, its result types, and the request-level KV bookkeeping shared by all caches.

Who owns which KV slots of a running request (row ``r`` of the request-to-token table, ``ps`` = page size)::

    positions                         owner                        freed by
    [0, protected_len)                the cache (tree nodes),      the cache's eviction, once every
                                      locked via last_node         request unlocked them
    [protected_len, kv_len)           the request (private)        cache_finished_req / release_req
    [kv_len, pages_for(kv_len) * ps)  the request (unused tail of  the same call, with its page
                                      its last page)

``protected_len`` is always a multiple of ``ps``: the cache stores whole pages only.

At ``cache_finished_req(state, tokens)`` (``tokens`` = the ids whose KV is computed, ``n = len(tokens)``,
``a = n // ps * ps``)::

    [0, a)   inserted into the cache; insert() reports the cached length c (c >= protected_len): our
             private copies [protected_len, c) duplicate what another request cached first and are
             freed; [c, a) now belongs to the cache
    [a, n)   the unaligned tail: freed (a partial page is never shared)
    the lock on last_node is dropped and the request row is freed.

At ``cache_unfinished_req(state, tokens)`` (after a prefill chunk, so others can hit it while the
request keeps running) the same insert happens, then the row's ``[0, a)`` is rewritten with the cache's
slots, the new last node is locked before the old one is unlocked, and ``protected_len`` becomes ``a``;
the tail ``[a, kv_len)`` stays private.

``release_req`` (retraction, errors) frees ``[protected_len, kv_len)`` without inserting anything.

Accounting invariant (``check_integrity``)::

    free + evictable + protected + sum(private of running requests) == capacity

The host tier (``radix.hierarchical_cache``, optional). A tree node's KV may live on the device, in the
host pool (``radix.host_pool``), or both. Host slots are never a request's: they belong to tree nodes or
to the host pool's free list. Device slots keep the table above; a node that is on the host only holds
no device slot and counts in neither ``evictable`` nor ``protected``::

    host slots                        owner                        freed by
    a node's host copy                the node (one per node)      host pressure dropping a host-only
                                                                   leaf (the node leaves the tree), flush
    what the device pool evicts       write_back: copied to the host when the device copy is evicted
                                      write_through: copied when the node is inserted (if room)

    device:  free + evictable + protected + sum(private) == capacity      (host-only nodes hold 0)
    host:    host_free + sum(host slots held by nodes)    == host capacity

Residency rules the tiered cache keeps: the device-resident nodes form a prefix-closed set (a node on the
device has its parent on the device), a locked node is always on the device, and every node is on at
least one tier. A match is therefore a device prefix followed by host-only nodes (``MatchResult.host_nodes``),
which ``load_back`` copies into fresh device pages before the caller locks the match as usual.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radix.allocator import PagedAllocator, ReqToTokenPool
from radix.errors import IntegrityError, KVOutOfMemoryError

TokenSeq = Sequence[int] | array | bytes


def key_bytes(tokens: TokenSeq) -> bytes:
    """Token ids packed as native int32: the key representation of the tree (compared with memcmp)."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, array):
        return tokens.tobytes() if tokens.typecode == "i" else array("i", tokens).tobytes()
    return array("i", tokens).tobytes()


EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


@dataclass
class MatchResult:
    """The cached prefix of a key: its device KV slots and the node to lock while they are in use.

    ``host_nodes``: with a host tier, the nodes that continue the device prefix but hold their KV on the
    host only (top-down, the first a child of ``last_node``); ``load_back`` turns them into device hits.
    """

    kv_indices: torch.Tensor
    last_node: Any
    host_nodes: tuple[Any, ...] = ()

    @property
    def length(self) -> int:
        """Tokens of the device-resident prefix (what ``assign_prefix`` hands the request)."""
        return int(self.kv_indices.numel())

    @property
    def host_len(self) -> int:
        """Tokens after the device prefix whose KV is in the host pool."""
        return sum(n.num_tokens for n in self.host_nodes)


@dataclass
class CacheStats:
    hit_tokens: int = 0
    miss_tokens: int = 0
    num_nodes: int = 0
    cached_tokens: int = 0
    evictable_size: int = 0
    protected_size: int = 0
    evicted_tokens: int = 0  # left the device (dropped, or moved to the host tier)
    inserted_tokens: int = 0
    # host tier (zero without one); cached_tokens / evictable / protected above are device tokens
    host_hit_tokens: int = 0  # recorded hits whose tokens were loaded from the host (``radix.tier_stats``)
    host_tokens: int = 0  # tokens whose KV is in the host pool (host-only and both tiers)
    host_only_tokens: int = 0  # tokens in nodes that are on the host only
    host_capacity: int = 0
    host_evicted_tokens: int = 0  # host-only tokens dropped (or handed to a lower tier) under pressure
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    host_loads: int = 0  # admissions that loaded KV back from the host
    host_load_seconds: float = 0.0  # how long those admissions waited for their copies, summed

    @property
    def device_hit_tokens(self) -> int:
        """Hits that were on the device already (the recorded hits minus those loaded back from the host;
        ``radix.tier_stats`` attributes a hit's tokens to the tier they came from when it is recorded)."""
        return max(0, self.hit_tokens - self.host_hit_tokens)

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0


@dataclass
class ReqKV:
    """What one running request holds of the KV memory (see the ownership table above)."""

    row: int
    namespace: Hashable | None = None
    protected_len: int = 0
    last_node: Any = None
    kv_len: int = 0


class PrefixCache(ABC):
    """Maps token prefixes to KV slots. Subclasses decide what is shared; this class owns the bookkeeping."""

    def __init__(self, allocator: PagedAllocator, req_to_token: ReqToTokenPool):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size
        self._hit = self._miss = 0

    @property
    def eviction_policy(self) -> str | None:
        """Name of the eviction order in force (None: this cache keeps nothing, so it evicts nothing)."""
        return None

    def record_lookup(self, hit_tokens: int, total_tokens: int) -> None:
        """Count one lookup in the hit statistics (the scheduler does this once per admitted request)."""
        self._hit += hit_tokens
        self._miss += total_tokens - hit_tokens

    # ------------------------------------------------------------------ the cache proper
    @abstractmethod
    def match_prefix(
        self, tokens: TokenSeq, namespace: Hashable | None = None, *, record: bool = True
    ) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` in ``namespace`` (``record``: count it in the
        hit statistics)."""

    @abstractmethod
    def insert(self, tokens: TokenSeq, slots: torch.Tensor, namespace: Hashable | None = None) -> int:
        """Cache ``slots`` as the KV of ``tokens``; returns how many leading tokens were cached already."""

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Drop one lock taken by ``lock``."""

    @abstractmethod
    def evict(self, n_tokens: int) -> torch.Tensor:
        """Free at least ``n_tokens`` (if that much is evictable); returns the freed slots."""

    @property
    @abstractmethod
    def evictable_size(self) -> int: ...

    @property
    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry (only when no request holds a lock)."""

    @abstractmethod
    def stats(self) -> CacheStats: ...

    @abstractmethod
    def owned_slots(self) -> list[torch.Tensor]:
        """Slots held by the cache itself (for integrity checks)."""

    @abstractmethod
    def cache_finished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        """A request ended: keep what is worth keeping, free the rest, release its row."""

    @abstractmethod
    def cache_unfinished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        """A request is mid-way (chunked prefill): make its computed prefix matchable by others."""

    def load_to_device(
        self, match: MatchResult, key: TokenSeq | None = None, namespace: Hashable | None = None
    ) -> MatchResult:
        """The whole cached prefix of a fresh ``match`` of ``key`` in ``namespace`` with its KV on the device,
        ready for ``assign_prefix`` (call it at once). A cache with one tier has nothing to load; a tiered
        cache brings back the parts kept on lower tiers (a disk tier may extend the match past the tree:
        ``key`` bounds how far), or returns the device part alone when the device has no room for them."""
        return match

    # ------------------------------------------------------------------ request bookkeeping
    def new_request(self, namespace: Hashable | None = None) -> ReqKV:
        return ReqKV(row=self.req_to_token.alloc(), namespace=namespace)

    def assign_prefix(self, state: ReqKV, match: MatchResult) -> None:
        """Give a fresh request the matched prefix: write its slots to the row and lock the node."""
        assert state.kv_len == 0, "assign_prefix is for requests that hold no KV yet"
        self.lock(match.last_node)
        state.last_node = match.last_node
        state.protected_len = match.length
        state.kv_len = match.length
        if match.length:
            self.req_to_token.write(state.row, 0, match.kv_indices)

    @property
    def available_size(self) -> int:
        """Tokens that can be allocated now, evicting if needed."""
        return self.allocator.free_size + self.evictable_size

    def make_room(self, need: int, who: str) -> None:
        """Evict cached entries until ``need`` device tokens are free; KVOutOfMemoryError (naming ``who``) when
        even that is not enough. Nothing is allocated here."""
        alloc = self.allocator
        if need > alloc.free_size:
            self.evict(need - alloc.free_size)
            if need > alloc.free_size:
                raise KVOutOfMemoryError(
                    f"{who} needs {need} more KV tokens; free {alloc.free_size}, evictable "
                    f"{self.evictable_size}, protected {self.protected_size}"
                )

    def alloc_tokens(self, state: ReqKV, n_tokens: int) -> torch.Tensor:
        """Slots for ``n_tokens`` more positions of ``state``, evicting cached entries if needed."""
        if n_tokens <= 0:
            return EMPTY_SLOTS
        alloc = self.allocator
        ps = self.page_size
        used = state.kv_len % ps
        fresh = max(0, n_tokens - ((ps - used) % ps if used else 0))
        self.make_room(alloc.pages_for(fresh) * ps, "request")
        last = int(self.req_to_token.table[state.row, state.kv_len - 1]) if state.kv_len else 0
        slots = alloc.alloc_extend(state.kv_len, last, n_tokens)
        self.req_to_token.write(state.row, state.kv_len, slots)
        state.kv_len += n_tokens
        return slots

    def alloc_decode_tokens(self, states: Sequence[ReqKV]) -> torch.Tensor:
        """One slot more for each of ``states`` (a decode step's rows), evicting cached entries if needed: the
        slots ``alloc_tokens(state, 1)`` gives each in turn, in one allocation and one table write instead of a
        few small tensor operations per request (~30 us each on a CPU host, per decode row and step)."""
        if not states:
            return EMPTY_SLOTS
        alloc = self.allocator
        ps = self.page_size
        lens = [s.kv_len for s in states]
        table = self.req_to_token
        table.check_fits(max(lens) + 1)
        self.make_room(sum(1 for n in lens if n % ps == 0) * ps, f"{len(states)} decode rows")
        rows = [s.row for s in states]
        last = table.table[rows, [max(n - 1, 0) for n in lens]].tolist() if ps > 1 else []
        slots = alloc.alloc_next(lens, last)
        table.write_next(rows, lens, slots)
        for s in states:
            s.kv_len += 1
        return slots

    def private_size(self, state: ReqKV) -> int:
        """Tokens of capacity held privately by ``state`` (whole pages)."""
        return self.allocator.pages_for(state.kv_len) * self.page_size - state.protected_len

    def release_req(self, state: ReqKV) -> None:
        """Free everything private to ``state`` without caching it (retraction, errors)."""
        self._free_private(state, state.protected_len)
        self._drop_lock(state)
        self.req_to_token.free(state.row)

    def _free_private(self, state: ReqKV, start: int) -> None:
        if state.kv_len > start:
            self.allocator.free(self.req_to_token.read(state.row, start, state.kv_len))

    def _drop_lock(self, state: ReqKV) -> None:
        if state.last_node is not None:
            self.unlock(state.last_node)
            state.last_node = None
        state.protected_len = 0
        state.kv_len = 0

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, states: Iterable[ReqKV] = ()) -> dict[str, int]:
        """Verify free + evictable + protected + private == capacity and that no page has two owners.

        Returns the four terms and the capacity; raises ``IntegrityError`` when the books do not balance.
        """
        alloc = self.allocator
        states = list(states)
        private = sum(self.private_size(s) for s in states)
        report = {
            "free": alloc.free_size,
            "evictable": self.evictable_size,
            "protected": self.protected_size,
            "private": private,
            "capacity": alloc.capacity,
        }
        total = report["free"] + report["evictable"] + report["protected"] + private
        if total != alloc.capacity:
            raise IntegrityError(f"KV accounting does not balance: {report} sums to {total}")
        owner: dict[int, str] = dict.fromkeys(alloc.free_page_set(), "free")
        ps = self.page_size

        def claim(slots: torch.Tensor, who: str) -> None:
            for page in torch.unique(slots // ps).tolist():
                if page in owner:
                    raise IntegrityError(f"page {page} is owned by both {owner[page]} and {who}")
                owner[page] = who

        for slots in self.owned_slots():
            claim(slots, "the cache")
        for s in states:
            if s.kv_len > s.protected_len:
                claim(self.req_to_token.read(s.row, s.protected_len, s.kv_len), f"request row {s.row}")
        if len(owner) != alloc.num_pages:
            raise IntegrityError(f"{alloc.num_pages - len(owner)} pages have no owner (leaked)")
        return report
