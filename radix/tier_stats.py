"""Per-tier counters of the tiered caches: which tier a request's cached tokens came from, and what loads cost.

Why hits are attributed when a lookup is *recorded*, not when KV is loaded: the scheduler loads a match's host
and disk parts at admission (``load_to_device``) before it knows whether the request fits, and records the
lookup (``record_lookup``) only when it does, and only at a request's first admission. A load whose request
was not admitted, or was re-admitted after a retraction, moved KV but served no recorded hit; when that
request is admitted later its prefix is on the device, and it counts as a device hit. So a load's tokens are
*pending* until the next recorded lookup claims them and are dropped at the next admission's load. That keeps
``device + host + disk == hit_tokens`` exact, which ``/metrics`` and the bench report rely on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from radix.base import CacheStats

LOWER_TIERS = ("host", "disk")  # the tiers a hit can be loaded from; the rest of a hit was on the device


def _zeros() -> dict[str, int]:
    return dict.fromkeys(LOWER_TIERS, 0)


@dataclass
class TierCounters:
    """Hits attributed to the host and disk tiers, their loads (count, tokens, seconds), and the host tier's
    traffic the other way (tokens copied device -> host, host-only tokens dropped under host pressure)."""

    to_host: int = 0
    host_dropped: int = 0
    hit_tokens: dict[str, int] = field(default_factory=_zeros)  # recorded hits served from the tier
    loaded_tokens: dict[str, int] = field(default_factory=_zeros)  # every load's tokens, recorded or not
    loads: dict[str, int] = field(default_factory=_zeros)
    load_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOWER_TIERS, 0.0))
    _pending: dict[str, int] = field(default_factory=_zeros)

    def loaded(self, tier: str, tokens: int) -> None:
        """``tokens`` were brought to the device from ``tier`` for the match being admitted."""
        self.loaded_tokens[tier] += tokens
        self.loads[tier] += 1
        self._pending[tier] += tokens

    def timed(self, tier: str, seconds: float) -> None:
        """A load from ``tier`` took ``seconds`` until its KV was usable (the admission waited that long)."""
        self.load_seconds[tier] += seconds

    def forget_pending(self) -> None:
        """A new admission starts: what earlier loads brought in is on the device now."""
        for tier in LOWER_TIERS:
            self._pending[tier] = 0

    def claim(self, hit_tokens: int) -> None:
        """A lookup of ``hit_tokens`` was recorded: the pending loads' tokens are its host and disk part."""
        left = hit_tokens
        for tier in LOWER_TIERS:
            take = min(self._pending[tier], left)
            self.hit_tokens[tier] += take
            left -= take
        self.forget_pending()

    def host_stats(
        self, base: CacheStats, *, capacity: int, free: int, host_only: int, bytes_per_token: int
    ) -> CacheStats:
        """``base`` (the device figures) with the host tier's filled in."""
        return dataclasses.replace(
            base,
            host_hit_tokens=self.hit_tokens["host"],
            host_tokens=capacity - free,
            host_only_tokens=host_only,
            host_capacity=capacity,
            host_evicted_tokens=self.host_dropped,
            bytes_to_host=self.to_host * bytes_per_token,
            bytes_to_device=self.loaded_tokens["host"] * bytes_per_token,
            host_loads=self.loads["host"],
            host_load_seconds=self.load_seconds["host"],
        )
