"""NaiveCache: the prefix-cache interface with no sharing, for ``--disable-radix-cache`` and A/B runs.

Every request computes its whole prompt and frees all of its KV when it ends; the tree stays empty.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from radix.base import EMPTY_SLOTS, CacheStats, MatchResult, PrefixCache, ReqKV, TokenSeq, key_bytes


class NaiveCache(PrefixCache):
    def match_prefix(
        self, tokens: TokenSeq, namespace: Hashable | None = None, *, record: bool = True
    ) -> MatchResult:
        """Never matches anything (and never splits: there is no tree)."""
        if record:
            self.record_lookup(0, len(key_bytes(tokens)) >> 2)
        return MatchResult(EMPTY_SLOTS, None)

    def insert(self, tokens: TokenSeq, slots: torch.Tensor, namespace: Hashable | None = None) -> int:
        """Keeps nothing: the caller keeps ownership of (and frees) every slot it passed."""
        return 0

    def lock(self, node: object) -> None:
        return None

    def unlock(self, node: object) -> None:
        return None

    def evict(self, n_tokens: int) -> torch.Tensor:
        return EMPTY_SLOTS

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None

    def stats(self) -> CacheStats:
        return CacheStats(hit_tokens=self._hit, miss_tokens=self._miss)

    def owned_slots(self) -> list[torch.Tensor]:
        return []

    def cache_finished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        self.release_req(state)

    def cache_unfinished_req(self, state: ReqKV, tokens: TokenSeq) -> None:
        return None
