"""The scheduler's loop, one for the server's scheduler process and the in-process ``Engine``.

Between two steps it takes everything its transport has queued — requests, aborts and typed control queries
(``runtime.core.messages``) — so they apply between steps, never during one; then it runs
``Scheduler.step()``, hands the step's outputs to the transport, flushes KV-cache events (when a publisher is
attached) and pushes ``Scheduler.status()`` about twice a second. How long it waits for messages follows
the scheduler: not at all while a step has work, a few milliseconds while only grammar compilations are
pending (their results are collected by the next step), and up to the transport's ``idle_timeout`` when
idle (the server wakes every half second to notice that its parent died; the Engine blocks until a message
or its shutdown comes).

Only the transport differs (``runtime.server.transports``): ZMQ sockets between processes, or queues
between an Engine's callers and its scheduler thread. The loop knows nothing about either.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from runtime.core.messages import (
    AbortRequest,
    CacheTreeQuery,
    ControlQuery,
    ControlReply,
    DashboardStatsQuery,
    FlushCacheQuery,
    IntegrityCheckQuery,
    ReqOutput,
    SchedulerStatus,
    ServerInfoQuery,
    TokenizedRequest,
)
from runtime.server.dashboard_queries import cache_tree, live_stats

if TYPE_CHECKING:
    from runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
STATUS_INTERVAL = 0.5
GRAMMAR_POLL_S = 0.005

Incoming = TokenizedRequest | AbortRequest | ControlQuery


class Transport(ABC):
    """The scheduler loop's connection to its callers."""

    # seconds an idle loop waits for a message before it asks ``stopped`` again (None: until one comes)
    idle_timeout: float | None

    @abstractmethod
    def receive(self, timeout: float | None) -> list[Incoming]:
        """Wait up to ``timeout`` seconds (None: without limit) for a message, then take all that are queued."""

    @abstractmethod
    def deliver(self, outputs: list[ReqOutput]) -> None:
        """One step's outputs (never empty)."""

    @abstractmethod
    def reply(self, reply: ControlReply) -> None: ...

    @abstractmethod
    def publish_status(self, status: SchedulerStatus) -> None: ...

    @abstractmethod
    def stopped(self, idle: bool) -> bool:
        """Whether the loop ends now (asked after each iteration; ``idle``: the scheduler has nothing to do)."""


class EventSink(Protocol):
    def flush(self) -> None: ...


@dataclass(kw_only=True)
class InspectQuery(ControlQuery):
    """``fn(scheduler)`` run between two steps, its value in the reply's ``data["value"]``: for tests and
    benchmarks that read or adjust the Engine's scheduler (``Engine.inspect``). In-process only: a function
    does not cross a process boundary, so the server's transport never carries one."""

    fn: Callable[[Scheduler], Any]


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, transport: Transport, events: EventSink | None = None):
        self.scheduler = scheduler
        self.transport = transport
        self.events = events
        self._last_status = 0.0

    def run(self) -> None:
        """Step until the transport says stop; an exception ends the loop (its driver reports it)."""
        sched = self.scheduler
        while True:
            timeout = 0.0 if sched.busy else (GRAMMAR_POLL_S if sched.compiling else self.transport.idle_timeout)
            for msg in self.transport.receive(timeout):
                self.handle(msg)
            outputs = sched.step()
            if outputs:
                self.transport.deliver(outputs)
            if self.events is not None:
                self.events.flush()
            self._maybe_status()
            if self.transport.stopped(sched.idle):
                return

    def handle(self, msg: Incoming) -> None:
        if isinstance(msg, TokenizedRequest):
            self.scheduler.submit(msg)
        elif isinstance(msg, AbortRequest):
            self.scheduler.abort(msg.rid, msg.message, msg.cause)
        elif isinstance(msg, ControlQuery):
            self.transport.reply(self.control(msg))

    def control(self, msg: ControlQuery) -> ControlReply:
        try:
            return ControlReply(msg.req_id, *self._answer(msg))
        except Exception as exc:
            logger.exception("control query %s failed", type(msg).__name__)
            return ControlReply(msg.req_id, False, {"message": str(exc)}, error=exc)

    def _answer(self, msg: ControlQuery) -> tuple[bool, dict[str, Any]]:
        """(ok, data) of one query; the dashboard's are read-only views (runtime/server/dashboard_queries.py)."""
        sched = self.scheduler
        if isinstance(msg, ServerInfoQuery):
            # the pid lets an operator (or a test) find the scheduler among the server's processes
            return True, {**sched.server_info(), "scheduler_pid": os.getpid()}
        if isinstance(msg, FlushCacheQuery):
            ok = sched.flush_cache()
            return ok, {} if ok else {"message": "the cache cannot be flushed while requests are queued or running"}
        if isinstance(msg, IntegrityCheckQuery):
            return True, dict(sched.check_integrity())
        if isinstance(msg, CacheTreeQuery):
            return True, cache_tree(sched, msg.max_nodes, msg.min_tokens)
        if isinstance(msg, DashboardStatsQuery):
            return True, live_stats(sched)
        if isinstance(msg, InspectQuery):
            return True, {"value": msg.fn(sched)}
        return False, {"message": f"unknown control query {type(msg).__name__}"}

    def _maybe_status(self) -> None:
        now = time.perf_counter()
        if now - self._last_status >= STATUS_INTERVAL:
            self._last_status = now
            self.transport.publish_status(self.scheduler.status())
