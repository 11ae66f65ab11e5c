"""TokenizerManager: the main process's side of every request.

It tokenizes prompts and renders chat templates, runs the intake's checks (``runtime.request.intake``), sends
``TokenizedRequest`` messages to the scheduler, and resolves each request's handle as the detokenizer's
``BatchStrOut`` messages arrive (one receive loop for all requests). It also carries control queries
(server info, cache flush) and keeps the scheduler's latest status for /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from runtime.config import ServerArgs
from runtime.core.messages import AbortCause, AbortRequest, BatchStrOut, ControlQuery, ControlReply, SchedulerStatus
from runtime.models.tokenizer import load_chat_template
from runtime.parsers.tool_formats import make_tool_format
from runtime.request.intake import Limits, SingleRequest, prepare
from runtime.request.state import RequestState
from runtime.request.tracker import RequestHandle, RequestTracker
from runtime.server.ipc import Endpoints, decode, encode

logger = logging.getLogger(__name__)
CONTROL_TIMEOUT = 120.0


class ServerUnavailable(RuntimeError):
    """A child process died or hung: the server can no longer serve (HTTP 503)."""


class QueueFull(RuntimeError):
    """The waiting queue is at --max-queued-requests (HTTP 429 with Retry-After)."""

    def __init__(self, queued: int, limit: int):
        super().__init__(f"the server is overloaded: {queued} requests are waiting (limit {limit}); retry later")
        self.retry_after = 1


class ReqHandle(RequestHandle):
    """A request of the server's: the receive loop applies its outputs (text from the detokenizer process) and
    wakes its waiter."""

    def __init__(self, single: SingleRequest):
        super().__init__(single)
        self.changed = asyncio.Event()
        self.failed: str | None = None

    @property
    def done(self) -> bool:
        return self.state.finished is not None or self.failed is not None

    async def updates(self) -> AsyncIterator[RequestState]:
        """The state after each change, until the request finishes."""
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.failed is not None:
                raise ServerUnavailable(self.failed)
            yield self.state
            if self.state.finished is not None:
                return

    async def result(self) -> RequestState:
        async for _ in self.updates():
            pass
        return self.state


class TokenizerManager:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, model_info: dict[str, Any]):
        from runtime.models.loader import load_tokenizer

        self.args = args
        self.model_info = model_info
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.chat_template = load_chat_template(args.chat_template)
        self.tool_format = make_tool_format(args.tool_call_parser, self.chat_template_text)
        self.context_length = int(model_info["context_length"])
        self.vocab_size = int(model_info["vocab_size"])
        self.limits = Limits(self.vocab_size, self.context_length, int(model_info["max_total_tokens"]),
                             args.max_running_requests)
        self.endpoints = endpoints
        self.handles: RequestTracker[ReqHandle] = RequestTracker()  # sent and not finished, by rid
        self.status: SchedulerStatus | None = None
        self.status_time = time.monotonic()  # when the last status arrived (the watchdog's heartbeat)
        self.dead: str | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._expiring: set[asyncio.Future[None]] = set()
        self._controls: dict[str, asyncio.Future[ControlReply]] = {}
        self.on_output: Any = None  # callback(handle, previous_completion_tokens) for metrics
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._to_sched = self._ctx.socket(zmq.PUSH)
        self._to_sched.setsockopt(zmq.LINGER, 0)
        self._to_sched.connect(self.endpoints.scheduler)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(self.endpoints.tokenizer)
        self._task = asyncio.create_task(self._recv_loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self._ctx:
            self._ctx.destroy(linger=0)

    def mark_dead(self, reason: str) -> None:
        """A child process died: fail every pending request and refuse new ones."""
        self.dead = reason
        for handle in self.handles.close(ServerUnavailable(reason)):
            handle.failed = reason
            handle.changed.set()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(ServerUnavailable(reason))

    @property
    def chat_template_text(self) -> str | None:
        return self.chat_template or getattr(self.tokenizer, "chat_template", None)

    # ------------------------------------------------------------------ tokenization
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def prepare(self, single: SingleRequest) -> None:
        """Tokenize and check one request; raises IntakeError (naming the field) for a bad one."""
        prepare(single, self.tokenize, self.limits)

    # ------------------------------------------------------------------ requests
    @property
    def queued_estimate(self) -> int:
        """Requests sent and not finished that the scheduler is not running, as far as its last status says.
        The status is at most about half a second old; between two, new requests count as queued, so a burst
        is judged conservatively."""
        running = self.status.num_running if self.status is not None else 0
        return max(0, len(self.handles) - running)

    def check_capacity(self, count: int) -> None:
        """Raise QueueFull if ``count`` more requests would overfill the waiting queue."""
        limit = self.args.max_queued_requests
        if limit is None:
            return
        queued = self.queued_estimate
        if queued + count > limit:
            raise QueueFull(queued, limit)

    async def submit(self, single: SingleRequest, checked: bool = False) -> ReqHandle:
        """Send one request to the scheduler (``checked``: ``prepare`` already ran on it)."""
        if self.dead:
            raise ServerUnavailable(self.dead)
        self.handles.check_free(single.rid)
        if not checked:
            self.prepare(single)
        handle = ReqHandle(single)
        self.handles.add(handle)
        timeout = single.options.timeout
        if timeout is None:
            timeout = self.args.request_timeout
        if timeout is not None:
            self._timers[single.rid] = asyncio.get_running_loop().call_later(timeout, self._expire, single.rid,
                                                                             timeout)
        await self._to_sched.send(encode(single.message()))
        return handle

    async def abort(self, rid: str, message: str = "aborted by request", cause: AbortCause = AbortCause.CLIENT) -> None:
        if self.dead:
            return
        await self._to_sched.send(encode(AbortRequest(rid, message, cause)))

    def _expire(self, rid: str, timeout: float) -> None:
        """A request ran past its deadline: abort it (the scheduler frees its KV and reports the abort)."""
        self._timers.pop(rid, None)
        if rid in self.handles:
            logger.info("request %s timed out after %.3g s; aborting it", rid, timeout)
            task = asyncio.ensure_future(self.abort(
                rid, f"timeout: the request did not finish within {timeout:g} s", AbortCause.TIMEOUT))
            self._expiring.add(task)  # held until sent (the loop keeps only weak references to tasks)
            task.add_done_callback(self._expiring.discard)

    def _cancel_timer(self, rid: str) -> None:
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()

    async def control(self, query: ControlQuery) -> ControlReply:
        """Send a query to the scheduler and wait for its reply."""
        if self.dead:
            raise ServerUnavailable(self.dead)
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._controls[query.req_id] = fut
        try:
            await self._to_sched.send(encode(query))
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT)
        finally:
            self._controls.pop(query.req_id, None)

    # ------------------------------------------------------------------ receive loop
    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self._inbox.recv())
            if isinstance(msg, BatchStrOut):
                now = time.perf_counter()
                for item in msg.outputs:
                    handle = self.handles.route(item.out)  # a finished request's handle leaves the registry
                    if handle is None:
                        continue
                    before = handle.state.completion_tokens
                    handle.apply(item.out, item.text)
                    if self.on_output is not None:
                        self.on_output(handle, before, now)
                    if item.out.finished is not None:
                        self._cancel_timer(item.out.rid)
                    handle.changed.set()
            elif isinstance(msg, SchedulerStatus):
                self.status = msg
                self.status_time = time.monotonic()
            elif isinstance(msg, ControlReply):
                fut = self._controls.get(msg.req_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
