"""The front of the runtime: what the server and the in-process Engine both do with a call's requests.

The server's tokenizer manager and the ``Engine`` take requests the same way, through one ``RequestFront``:

* ``admit`` checks that the waiting queue has room for the whole call (``--max-queued-requests``: else
  ``QueueFull``, before anything is tokenized) and runs the intake on every request (tokenize, then
  ``intake.check``), so one bad request or a full queue refuses the call before any request is sent;
* ``track`` registers a request's handle just before it is sent and starts its deadline (its own ``timeout``,
  else ``--request-timeout``): past it the request is aborted with ``AbortCause.TIMEOUT`` through the
  scheduler's ordinary abort path, which frees its KV;
* ``route`` hands each of the scheduler's outputs to its handle and stops the deadline of a request that
  finished; ``fail_all`` ends every request at once when the scheduler is gone.

What differs between the two is only how a deadline fires (a timer on the server's event loop, a timer thread
in the Engine) and how the abort reaches the scheduler (a ZMQ message, the in-process queue): the owner
passes both in. How a request that ended in an error abort is reported differs too, by design: the HTTP layer
answers a status (``runtime/http/errors.ABORT_STATUS``), the Engine raises ``rejection``'s error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol

from runtime.core.errors import IntakeError
from runtime.core.messages import AbortCause, AbortRequest, FinishReason, ReqOutput, SchedulerStatus
from runtime.models.tokenizer import tokenize
from runtime.request.intake import Limits, SingleRequest, prepare
from runtime.request.tracker import H, RequestTracker

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at ``--max-queued-requests`` (the server answers 429 with Retry-After)."""

    def __init__(self, queued: int, limit: int):
        super().__init__(f"the waiting queue is full: {queued} requests are waiting (limit {limit}); retry later")
        self.retry_after = 1


class RequestTimeout(RuntimeError):
    """A request ran past its timeout and was aborted (the server answers 408; the Engine raises this)."""


def rejection(fin: FinishReason | None) -> Exception | None:
    """The error of a request that ended in an error abort (None: it did not): a timeout, or a request the
    runtime found it could not run after the intake passed it (a grammar the compiler refuses)."""
    if fin is None or fin.type != "abort":
        return None
    message = fin.message or "the request was aborted"
    if fin.cause is AbortCause.TIMEOUT:
        return RequestTimeout(message)
    if fin.cause is AbortCause.INVALID:
        return IntakeError.of(ValueError(message))
    return None


class Timer(Protocol):
    def cancel(self) -> None: ...


# start_timer(seconds, fire) -> a started timer: how the owner runs a deadline
StartTimer = Callable[[float, Callable[[], None]], Timer]


def thread_timer(seconds: float, fire: Callable[[], None]) -> Timer:
    """A deadline on a timer thread (the Engine's callers may be any threads, or none waiting)."""
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


class RequestFront(Generic[H]):
    """Limits, capacity and deadlines of the requests one owner sends to its scheduler."""

    def __init__(self, limits: Limits, tokenizer: Any, *, max_queued_requests: int | None,
                 request_timeout: float | None, start_timer: StartTimer, send_abort: Callable[[AbortRequest], None],
                 status: Callable[[], SchedulerStatus | None]):
        self.limits = limits
        self.tokenizer = tokenizer
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.handles: RequestTracker[H] = RequestTracker()  # sent and not finished, by rid
        self._start_timer = start_timer
        self._send_abort = send_abort
        self._status = status  # the scheduler's latest status (how many it runs)
        self._timers: dict[str, Timer] = {}
        self._lock = threading.Lock()  # an Engine tracks on its callers' threads and routes on the scheduler's

    # ------------------------------------------------------------------ before sending
    def tokenize(self, text: str) -> list[int]:
        return tokenize(self.tokenizer, text)

    def prepare(self, single: SingleRequest) -> None:
        """Tokenize and check one request; raises IntakeError (naming the field) for a bad one."""
        prepare(single, self.tokenize, self.limits)

    @property
    def queued_estimate(self) -> int:
        """Requests sent and not finished that the scheduler is not running, as far as its last status says.
        The status is at most about half a second old; between two, new requests count as queued, so a burst
        is judged conservatively."""
        status = self._status()
        running = status.num_running if status is not None else 0
        return max(0, len(self.handles) - running)

    def check_capacity(self, count: int) -> None:
        """Raise QueueFull if ``count`` more requests would overfill the waiting queue."""
        limit = self.max_queued_requests
        if limit is None:
            return
        queued = self.queued_estimate
        if queued + count > limit:
            raise QueueFull(queued, limit)

    def admit(self, singles: Sequence[SingleRequest], bounded: bool = True) -> None:
        """Room in the queue for the whole call (``bounded``; a health probe is not), then the intake on every
        request: nothing of the call is sent unless all of it may be."""
        if bounded:
            self.check_capacity(len(singles))
        for s in singles:
            self.prepare(s)

    # ------------------------------------------------------------------ while running
    def track(self, handle: H) -> None:
        """Register a handle before its request is sent (IntakeError for a rid in use, the ``fail_all`` error
        once the scheduler is gone) and start its deadline."""
        self.handles.add(handle)
        options = handle.single.options
        seconds = options.timeout if options.timeout is not None else self.request_timeout
        if seconds is not None:
            timer = self._start_timer(seconds, lambda: self._expire(handle.rid, seconds))
            with self._lock:
                self._timers[handle.rid] = timer

    def route(self, out: ReqOutput) -> H | None:
        """The handle ``out`` belongs to (None: unknown or already failed); a finished request's handle leaves
        the registry and its deadline stops."""
        handle = self.handles.route(out)
        if out.finished is not None:
            self._cancel(out.rid)
        return handle

    def fail_all(self, error: BaseException) -> list[H]:
        """The scheduler is gone: every handle leaves (returned, for the owner to wake), no deadline fires, and
        ``track`` raises ``error`` from now on."""
        with self._lock:
            timers, self._timers = list(self._timers.values()), {}
        for timer in timers:
            timer.cancel()
        return self.handles.close(error)

    def _cancel(self, rid: str) -> None:
        with self._lock:
            timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, rid: str, seconds: float) -> None:
        """A request ran past its deadline: abort it (the scheduler frees its KV and reports the abort)."""
        with self._lock:
            self._timers.pop(rid, None)
        if rid in self.handles:
            logger.info("request %s timed out after %.3g s; aborting it", rid, seconds)
            self._send_abort(AbortRequest(rid, f"timeout: the request did not finish within {seconds:g} s",
                                          AbortCause.TIMEOUT))
