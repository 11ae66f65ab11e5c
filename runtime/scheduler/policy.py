"""Waiting-queue order: which requests the admission step considers first.

LPM (longest prefix match) puts requests whose prompt is already cached first, so they run while their
prefix is still in memory and the hit rate climbs; past ``LPM_MAX_QUEUE`` waiting requests the lookups
cost more than they save and the order falls back to arrival (FCFS). Retracted requests are re-queued at
the front and keep that place under both policies (the sort is stable).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from radix.base import PrefixCache
from runtime.scheduler.req import Req

LPM_MAX_QUEUE = 128


class SchedulePolicy(ABC):
    name: str

    def __init__(self) -> None:
        self.reorders = 0  # orderings that differed from arrival order (LPM at work)

    @abstractmethod
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        """The waiting requests in the order admission should try them."""


class FCFSPolicy(SchedulePolicy):
    name = "fcfs"

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        return list(waiting)


class LPMPolicy(SchedulePolicy):
    name = "lpm"

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        if len(waiting) > LPM_MAX_QUEUE or len(waiting) < 2:
            return list(waiting)
        hits = {
            id(r): cache.match_prefix(r.tokens[: r.max_prefix_len()], r.namespace, record=False).length
            for r in waiting
        }
        ordered = sorted(waiting, key=lambda r: (r.retractions == 0, -hits[id(r)]))
        if any(a is not b for a, b in zip(ordered, waiting)):
            self.reorders += 1
        return ordered


def make_schedule_policy(name: str) -> SchedulePolicy:
    policies: dict[str, type[SchedulePolicy]] = {"lpm": LPMPolicy, "fcfs": FCFSPolicy}
    if name not in policies:
        raise ValueError(f"unknown schedule policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
