"""TokenizerManager: the main process's side of every request.

It renders chat templates and takes requests through the ``RequestFront`` it shares with the Engine
(``runtime.request.front``: the queue bound, the intake, per-request deadlines), sends ``TokenizedRequest``
messages to the scheduler, and resolves each request's handle as the detokenizer's ``BatchStrOut`` messages
arrive (one receive loop for all requests). It also carries control queries (server info, cache flush) and
keeps the scheduler's latest status for /metrics, the queue bound and the watchdog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from runtime.config import ServerArgs
from runtime.core.messages import AbortCause, AbortRequest, BatchStrOut, ControlQuery, ControlReply, SchedulerStatus
from runtime.models.tokenizer import load_chat_template
from runtime.parsers.tool_formats import make_tool_format
from runtime.request.front import RequestFront
from runtime.request.intake import Limits, SingleRequest
from runtime.request.state import RequestState
from runtime.request.tracker import RequestHandle
from runtime.server.ipc import Endpoints, decode, encode

logger = logging.getLogger(__name__)
CONTROL_TIMEOUT = 120.0


class ServerUnavailable(RuntimeError):
    """A child process died or hung: the server can no longer serve (HTTP 503)."""


class ReqHandle(RequestHandle):
    """A request of the server's: the receive loop applies its outputs (text from the detokenizer process) and
    wakes its waiter."""

    def __init__(self, single: SingleRequest):
        super().__init__(single)
        self.changed = asyncio.Event()
        self.failed: str | None = None
        self.last_token_at: float | None = None  # when an output last brought tokens (``token_gap``)

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

    def token_gap(self, now: float) -> float | None:
        """Seconds since the previous output that brought tokens (None before the first), for the
        inter-token latency; ``now`` becomes that time."""
        last, self.last_token_at = self.last_token_at, now
        return None if last is None else now - last

    async def result(self) -> RequestState:
        async for _ in self.updates():
            pass
        return self.state


class TokenizerManager:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, model_info: dict[str, Any]):
        from runtime.models.folders import load_tokenizer

        self.args = args
        self.model_info = model_info
        self.tokenizer = load_tokenizer(args.tokenizer or args.model, model_info.get("tokenizer_class"))
        self.chat_template = load_chat_template(args.chat_template)
        self.tool_format = make_tool_format(args.tool_call_parser, self.chat_template_text)
        self.context_length = int(model_info["context_length"])
        self.vocab_size = int(model_info["vocab_size"])
        limits = Limits(self.vocab_size, self.context_length, int(model_info["max_total_tokens"]),
                        args.max_running_requests)
        self.front: RequestFront[ReqHandle] = RequestFront(
            limits, self.tokenizer, max_queued_requests=args.max_queued_requests,
            request_timeout=args.request_timeout, start_timer=self._call_later, send_abort=self._send_soon,
            status=lambda: self.status)
        self.endpoints = endpoints
        self.status: SchedulerStatus | None = None
        self.status_time = time.monotonic()  # when the last status arrived (the watchdog's heartbeat)
        self.dead: str | None = None
        self._sending: set[asyncio.Future[Any]] = set()
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
        for handle in self.front.fail_all(ServerUnavailable(reason)):
            handle.failed = reason
            handle.changed.set()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(ServerUnavailable(reason))

    @property
    def chat_template_text(self) -> str | None:
        return self.chat_template or getattr(self.tokenizer, "chat_template", None)

    @property
    def limits(self) -> Limits:
        return self.front.limits

    @property
    def pending(self) -> int:
        """Requests sent and not finished (the watchdog's evidence of work)."""
        return len(self.front.handles)

    def tokenize(self, text: str) -> list[int]:
        return self.front.tokenize(text)

    # ------------------------------------------------------------------ requests
    async def submit(self, single: SingleRequest) -> ReqHandle:
        """Send one request the front admitted (``RequestFront.admit``: queue room, the intake)."""
        if self.dead:
            raise ServerUnavailable(self.dead)
        handle = ReqHandle(single)
        self.front.track(handle)
        await self._to_sched.send(encode(single.message()))
        return handle

    async def abort(self, rid: str, message: str = "aborted by request", cause: AbortCause = AbortCause.CLIENT) -> None:
        if self.dead:
            return
        await self._to_sched.send(encode(AbortRequest(rid, message, cause)))

    @staticmethod
    def _call_later(seconds: float, fire: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(seconds, fire)

    def _send_soon(self, abort: AbortRequest) -> None:
        """An abort from a deadline (a timer callback on the event loop, which cannot await the send)."""
        if self.dead:
            return
        task = asyncio.ensure_future(self._to_sched.send(encode(abort)))
        self._sending.add(task)  # held until sent (the loop keeps only weak references to tasks)
        task.add_done_callback(self._sending.discard)

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
                    handle = self.front.route(item.out)  # a finished request's handle leaves, its deadline stops
                    if handle is None:
                        continue
                    before = handle.state.completion_tokens
                    handle.apply(item.out, item.text)
                    if self.on_output is not None:
                        self.on_output(handle, before, now)
                    handle.changed.set()
            elif isinstance(msg, SchedulerStatus):
                self.status = msg
                self.status_time = time.monotonic()
            elif isinstance(msg, ControlReply):
                fut = self._controls.get(msg.req_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
