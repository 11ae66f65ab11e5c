"""Workers: their health (with hysteresis), their load, and the bounded queue in front of them.

Load is what the router itself knows for sure: the requests it has in flight on each worker. Health has
two speeds. A refused connection means nothing listens on the port any more, so the worker is taken out
at once. Slow or failed checks, resets and 5xx answers are noise a busy machine produces too, so they
count: ``failure_threshold`` in a row take a worker out. Coming back always takes ``success_threshold``
passed checks in a row, so a worker that flaps does not keep pulling traffic. A worker never checked
before (just added) is decided by its first check.

``SlotGate`` gives each request a slot on a worker (at most ``max_inflight_per_worker`` each). When every
candidate is full, requests wait in FIFO order, at most ``max_queued_requests`` of them (429 beyond);
with no healthy worker, or after ``queue_timeout`` seconds, they get 503.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.errors import RouterError

logger = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url: {url!r} is not an http(s) URL")
    return url


@dataclass(eq=False)
class Worker:
    url: str
    kv_events: str | None = None  # ZMQ endpoint of its cache events (exact mode)
    healthy: bool = False
    checked: bool = False  # has any check or request decided its health yet?
    load: int = 0  # requests in flight, routed by this router
    routed: int = 0
    failures: int = 0  # consecutive failures
    successes: int = 0  # consecutive passed checks
    last_error: str | None = None
    changed_at: float = field(default_factory=time.time)
    info: dict[str, Any] = field(default_factory=dict)  # what /get_model_info said, once known

    # ------------------------------------------------------------------ health state machine
    def record_success(self, success_threshold: int) -> bool:
        """A passed health check; returns True when the worker becomes healthy."""
        self.failures = 0
        self.successes += 1
        if not self.healthy and (not self.checked or self.successes >= success_threshold):
            return self._set(True, None)
        self.checked = True
        return False

    def record_failure(self, why: str, failure_threshold: int, hard: bool = False) -> bool:
        """A failed check or request; returns True when the worker becomes unhealthy."""
        self.successes = 0
        self.failures += 1
        self.last_error = why
        if self.healthy and (hard or self.failures >= failure_threshold):
            return self._set(False, why)
        if not self.checked:
            self.checked = True
            self.changed_at = time.time()
        return False

    def record_served(self) -> None:
        """A request went through: the worker is alive, whatever earlier soft failures said."""
        self.failures = 0

    def _set(self, healthy: bool, why: str | None) -> bool:
        self.healthy = healthy
        self.checked = True
        self.changed_at = time.time()
        self.successes = 0 if not healthy else self.successes
        return True

    def as_json(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "load": self.load, "routed": self.routed,
                "consecutive_failures": self.failures, "consecutive_successes": self.successes,
                "last_error": self.last_error, "kv_events": self.kv_events,
                "since": round(self.changed_at, 3)}


class WorkerRegistry:
    """The workers, in the order they were added; listeners hear about every health or membership change."""

    def __init__(self, failure_threshold: int = 3, success_threshold: int = 2):
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._workers: dict[str, Worker] = {}
        self.listeners: list[Callable[[Worker, str], None]] = []

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url.rstrip("/"))

    def healthy(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.healthy]

    def add(self, url: str, kv_events: str | None = None) -> tuple[Worker, bool]:
        """Returns (worker, created); adding a known URL returns the existing worker."""
        url = normalize_url(url)
        existing = self._workers.get(url)
        if existing is not None:
            if kv_events:
                existing.kv_events = kv_events
            return existing, False
        worker = Worker(url, kv_events)
        self._workers[url] = worker
        self._notify(worker, "added")
        return worker, True

    def remove(self, url: str) -> Worker | None:
        worker = self._workers.pop(url.rstrip("/"), None)
        if worker is not None:
            worker.healthy = False
            self._notify(worker, "removed")
        return worker

    def _known(self, worker: Worker) -> bool:
        """False for a worker removed while a probe or request on it was still running."""
        return self._workers.get(worker.url) is worker

    def check_passed(self, worker: Worker) -> None:
        if self._known(worker) and worker.record_success(self.success_threshold):
            logger.info("worker %s is healthy", worker.url)
            self._notify(worker, "healthy")

    def reinstate(self, worker: Worker) -> None:
        """An operator re-added the worker and a check just passed: trust it without the success streak."""
        if self._known(worker) and not worker.healthy:
            worker._set(True, None)
            logger.info("worker %s reinstated", worker.url)
            self._notify(worker, "healthy")

    def failed(self, worker: Worker, why: str, hard: bool = False) -> None:
        if self._known(worker) and worker.record_failure(why, self.failure_threshold, hard):
            logger.warning("worker %s is unhealthy: %s", worker.url, why)
            self._notify(worker, "unhealthy")

    def _notify(self, worker: Worker, what: str) -> None:
        for fn in self.listeners:
            fn(worker, what)


class HasWorker(Protocol):
    worker: Worker


class SlotGate:
    def __init__(self, registry: WorkerRegistry, max_inflight_per_worker: int, max_queued: int,
                 timeout: float):
        self.registry = registry
        self.limit = max_inflight_per_worker
        self.max_queued = max_queued
        self.timeout = timeout
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        registry.listeners.append(lambda _w, _what: self._kick())

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, choose: Callable[[list[Worker]], HasWorker],
                      exclude: Collection[str] = ()) -> Any:
        """A slot on the worker ``choose`` picks among the healthy, non-excluded workers with room.

        Returns what ``choose`` returned, with the chosen worker's load already counted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        queued = False
        while True:
            pool = [w for w in self.registry.healthy() if w.url not in exclude]
            if not pool:
                if queued:
                    self._kick()  # the next waiter should learn it too, now
                gone = "every worker that could take it failed" if exclude else "no healthy worker"
                raise RouterError(503, f"the router cannot serve the request: {gone}", "no_healthy_worker",
                                  retry_after=1)
            free = [w for w in pool if w.load < self.limit]
            # Newcomers do not overtake queued requests; a woken waiter is first in line.
            if free and (queued or not self._waiters):
                choice = choose(free)
                choice.worker.load += 1
                if queued:
                    self._kick()
                return choice
            if not queued and len(self._waiters) >= self.max_queued:
                raise RouterError(429, f"every worker is saturated ({self.limit} requests in flight each) and "
                                  f"{len(self._waiters)} requests are already queued; retry later",
                                  "router_saturated", retry_after=1)
            fut: asyncio.Future[None] = loop.create_future()
            if queued:
                self._waiters.appendleft(fut)
            else:
                self._waiters.append(fut)
            queued = True
            try:
                await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                self._discard(fut)
                raise RouterError(503, f"no worker slot became free within {self.timeout:.0f} s",
                                  "queue_timeout", retry_after=1) from None
            except BaseException:
                self._discard(fut)
                if fut.done() and not fut.cancelled():
                    self._kick()  # we were woken but will not use the slot: pass it on
                raise

    def release(self, worker: Worker) -> None:
        worker.load -= 1
        self._kick()

    def _discard(self, fut: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)

    def _kick(self) -> None:
        """Wake the first waiter; it takes a slot (and wakes the next) or queues again at the front."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
