"""Policies that ignore the cache: round_robin, shortest_queue, power_of_two (the baselines)."""

from __future__ import annotations

import random

from router.policies.base import Choice, Policy
from router.request_view import RequestView
from router.workers import Worker


class RoundRobin(Policy):
    """Each worker in turn. Turns follow "least recently chosen", so a worker that is full or unhealthy
    for a while is skipped without shifting the others' order."""

    name = "round_robin"

    def select(self, view: RequestView, candidates: list[Worker]) -> Choice:
        order = sorted(candidates, key=lambda w: self._last_pick.get(w.url, 0))
        return self.pick(order, "round_robin")


class ShortestQueue(Policy):
    """The worker with the fewest requests in flight (ties: least recently chosen)."""

    name = "shortest_queue"

    def select(self, view: RequestView, candidates: list[Worker]) -> Choice:
        return self.pick(self.least_loaded(candidates), "shortest_queue")


class PowerOfTwo(Policy):
    """The less loaded of two workers drawn at random: nearly shortest-queue balance, without every
    router (or every burst) herding onto the same least-loaded worker."""

    name = "power_of_two"

    def __init__(self, seed: int = 0):
        super().__init__()
        self.rng = random.Random(seed)

    def select(self, view: RequestView, candidates: list[Worker]) -> Choice:
        if len(candidates) == 1:
            return self.pick(candidates, "power_of_two")
        a, b = self.rng.sample(candidates, 2)
        if a.load == b.load:
            best = a if self.rng.random() < 0.5 else b
        else:
            best = a if a.load < b.load else b
        return self.pick([best], "power_of_two")
