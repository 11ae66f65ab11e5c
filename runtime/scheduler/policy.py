"""Waiting-queue order: which requests the admission step considers first.

LPM (longest prefix match) puts requests whose prompt is already cached first, so they run while their
prefix is still in memory and the hit rate climbs; past ``LPM_MAX_QUEUE`` waiting requests the lookups
cost more than they save and the order falls back to arrival (FCFS). Retracted requests are re-queued at
the front and keep that place under both policies (the sort is stable).

``PriorityPolicy`` wraps either of them (``--enable-priority-scheduling``): requests are admitted by their
``priority`` first and by the wrapped policy's order within one priority, and when KV memory runs short the
lowest-priority running request is retracted first.
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

    def retraction_victim(self, running: list[Req]) -> Req:
        """The running request to give its KV back when the next decode step does not fit: the newest, which
        has the least work to redo."""
        return max(running, key=lambda r: (r.arrival, r.rid))


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
            id(r): cache.match_prefix(r.tokens[: r.max_prefix_len()], r.options.cache_namespace,
                                      record=False).length
            for r in waiting
        }
        ordered = sorted(waiting, key=lambda r: (r.retractions == 0, -hits[id(r)]))
        if any(a is not b for a, b in zip(ordered, waiting)):
            self.reorders += 1
        return ordered


class PriorityPolicy(SchedulePolicy):
    """Priority classes first, the wrapped policy's order inside each class."""

    def __init__(self, inner: SchedulePolicy, low_values_first: bool = False):
        super().__init__()
        self.inner = inner
        self.name = f"priority+{inner.name}"
        self.sign = 1 if low_values_first else -1

    def urgency(self, req: Req) -> int:
        """Smaller runs sooner."""
        return self.sign * req.options.priority

    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        ordered = sorted(self.inner.order(waiting, cache), key=self.urgency)
        self.reorders = self.inner.reorders
        return ordered

    def retraction_victim(self, running: list[Req]) -> Req:
        return max(running, key=lambda r: (self.urgency(r), r.arrival, r.rid))


def make_schedule_policy(name: str, by_priority: bool = False, low_values_first: bool = False) -> SchedulePolicy:
    policies: dict[str, type[SchedulePolicy]] = {"lpm": LPMPolicy, "fcfs": FCFSPolicy}
    if name not in policies:
        raise ValueError(f"unknown schedule policy {name!r}; choose one of {sorted(policies)}")
    policy = policies[name]()
    return PriorityPolicy(policy, low_values_first) if by_priority else policy
