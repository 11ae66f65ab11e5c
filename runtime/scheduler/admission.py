"""Admission: which waiting requests join the next step, and how much of each.

The memory-safety story, in one place:

* Every running request will still grow by up to ``remaining_new_tokens``. Admission keeps a reserve of
  ``ratio × remaining`` tokens (capped per request) for that growth, where ``ratio`` starts cautious and
  decays while decoding goes well (most requests stop early).
* A candidate's cached prefix is locked *before* memory is checked again: locking turns those tokens
  from evictable into protected, which shrinks what eviction could free (lock, then re-check).
* If the prompt does not fit, it is truncated to a chunk when chunking is on, or admission stops.
* When the reserve turns out too small, decoding retracts requests (``Scheduler._make_decode_room``): their KV is
  released without being cached, they go back to the front of the queue and later resume from their
  prompt plus the tokens they already produced, so their output does not change. ``ratio`` is raised.

Requests that share an uncached prefix with one already admitted in this step are deferred by one step
(in-batch sharing): the first computes the prefix and caches it, the rest then hit it instead of
computing it again. ``n > 1`` samples of one prompt go through the same path and prefill it once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from radix.base import PrefixCache
from runtime.scheduler.req import Req

RESERVE_CLIP = 4096  # most future tokens reserved for one request
DEDUP_MIN_TOKENS = 32  # shared uncached tokens that make deferring worthwhile


def decode_would_retract(running: Iterable[Req], cache: PrefixCache) -> bool:
    """Whether giving each of ``running`` its next token's slot needs more than the available memory (a
    request whose KV ends on a page boundary needs a new page): then the step retracts."""
    ps = cache.page_size
    return sum(ps for r in running if r.kv_len % ps == 0) > cache.available_size


class NewTokenRatio:
    """The share of their remaining tokens that running requests are expected to still produce."""

    def __init__(self, conservativeness: float = 1.0):
        self.init = min(1.0, 0.7 * conservativeness)
        self.min = min(1.0, 0.1 * conservativeness)
        self.decay = 0.001
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.min, self.value - self.decay)

    def on_retract(self) -> None:
        self.value = min(1.0, max(self.value, self.init) + 0.1)

    def reserve(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens(), RESERVE_CLIP) * self.value + 0.999)


class Outcome(Enum):
    ADDED = "added"
    DEFERRED = "deferred"  # try again next step (in-batch sharing)
    STOP = "stop"  # out of budget or memory: admit nothing more this step


@dataclass
class PrefillPlan:
    req: Req
    extend: int  # tokens computed this step (a decode verifying a draft: 1 + len(draft))
    draft: list[int] = field(default_factory=list)  # speculative tokens after the request's last one

    @property
    def completes(self) -> bool:
        return self.req.kv_len >= self.req.fill_len


@dataclass
class PrefillAdder:
    cache: PrefixCache
    token_budget: int  # new tokens this step may still take
    reserved: int  # tokens promised to running requests' future decodes
    ratio: NewTokenRatio
    chunk_size: int | None  # None: prompts are never split
    max_new_reqs: int
    plans: list[PrefillPlan] = field(default_factory=list)
    _computing: list[bytes] = field(default_factory=list)  # token keys being computed this step

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def mem_left(self) -> int:
        return self.cache.available_size - self.reserved

    def _room_for(self, req: Req, want: int) -> int:
        """Tokens of ``want`` that can run now, respecting the step budget, chunking and memory."""
        ps = self.page_size
        full = want
        if self.chunk_size is not None and want > self.token_budget:
            want = self.token_budget
        elif self.chunk_size is None and want > self.token_budget and self.plans:
            return 0  # no chunking: a big prompt waits for a step of its own
        decode_reserve = self.ratio.reserve(req) if want == full else 0
        mem = self.mem_left()
        if want + decode_reserve + ps > mem:
            if self.chunk_size is None:
                return 0 if want + ps > mem else want  # run it without the reserve; retraction covers
            want = min(want, mem - ps)
        if want < full:
            # end chunks on a page boundary so the computed part can be cached whole
            end = (req.kv_len + want) // ps * ps
            want = end - req.kv_len
        return max(0, want)

    def add_chunked(self, req: Req) -> Outcome:
        """Continue the request whose prompt is being computed chunk by chunk."""
        assert req.kv is not None
        extend = self._room_for(req, req.fill_len - req.kv_len)
        if extend <= 0:
            return Outcome.STOP
        self._commit(req, extend)
        return Outcome.ADDED

    def add_new(self, req: Req) -> Outcome:
        """Admit a waiting request (or part of it), locking its cached prefix first."""
        cache = self.cache
        if self.token_budget <= 0 or len(self.plans) >= self.max_new_reqs:
            return Outcome.STOP
        if cache.req_to_token.available == 0:
            return Outcome.STOP
        key = req.tokens[: req.max_prefix_len()]
        match = cache.match_prefix(key, req.options.cache_namespace, record=False)
        if self._shares_with_admitted(req, match.length + match.host_len):
            return Outcome.DEFERRED
        match = cache.load_to_device(match, key, req.options.cache_namespace)  # host/disk parts come back first
        state = cache.new_request(req.options.cache_namespace)
        cache.assign_prefix(state, match)  # lock before re-checking memory
        req.kv = state
        extend = self._room_for(req, req.fill_len - match.length)
        if extend <= 0:
            cache.release_req(state)
            req.kv = None
            return Outcome.STOP
        if req.cached_tokens < 0:
            req.cached_tokens = match.length
            cache.record_lookup(match.length, len(req.input_ids))
        self._commit(req, extend)
        return Outcome.ADDED

    def _commit(self, req: Req, extend: int) -> None:
        assert req.kv is not None
        start = req.kv_len
        self.cache.alloc_tokens(req.kv, extend)
        self.token_budget -= extend
        if req.kv_len >= req.fill_len:
            self.reserved += self.ratio.reserve(req)
        self.plans.append(PrefillPlan(req, extend))
        self._computing.append(req.tokens[: start + extend].tobytes())

    def _shares_with_admitted(self, req: Req, cached: int) -> bool:
        if not self._computing:
            return False
        mine = req.tokens[: req.max_prefix_len()].tobytes()
        if len(mine) - 4 * cached < 4 * DEDUP_MIN_TOKENS:
            return False
        return any(common_prefix_tokens(mine, other) - cached >= DEDUP_MIN_TOKENS for other in self._computing)


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Length in tokens of the common prefix of two int32-packed token keys (binary search on slices)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
