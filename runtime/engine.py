"""Engine: the runtime in-process. ``Engine(model=..., **options).generate(...)``.

The scheduler runs on a background thread: the same Scheduler and the same ``SchedulerLoop`` the server's
scheduler process runs, over an in-process queue transport instead of ZMQ sockets
(``runtime/server/transports.py``). The front half is the server's too: the same ``RequestFront``
(``runtime.request.front``: ``max_queued_requests``, the intake, each request's ``timeout`` or the Engine's
``request_timeout``), and each request's ``DecodeStream``, run on its caller's thread as the server's
detokenizer process runs it. Control calls are the server's typed control queries. ``generate`` may be called
from many threads at once and each call waits only for its own requests. Results are SGLang-native dicts:
``{"text", "output_ids", "meta_info"}``.

Where the server answers an HTTP status the Engine raises: an ``IntakeError`` (a ValueError naming the field as
``generate`` names it: ``prompt``, not /generate's ``text``) for a refused request, ``QueueFull`` when the
waiting queue is at ``max_queued_requests``, ``RequestTimeout`` for a request past its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from runtime.config import ServerArgs
from runtime.core.errors import IntakeError, fields_named
from runtime.core.messages import (
    AbortRequest,
    ControlQuery,
    ControlReply,
    FlushCacheQuery,
    IntegrityCheckQuery,
    ReqOutput,
    ServerInfoQuery,
)
from runtime.executor.model_runner import ModelRunner
from runtime.models.folders import load_tokenizer
from runtime.models.tokenizer import eos_token_ids
from runtime.request.front import RequestFront, rejection, thread_timer
from runtime.request.intake import SingleRequest, from_native
from runtime.request.state import StreamPacer
from runtime.request.tracker import DecodingHandle
from runtime.scheduler.scheduler import Scheduler
from runtime.server.scheduler_loop import InspectQuery, SchedulerLoop
from runtime.server.transports import QueueTransport

logger = logging.getLogger(__name__)
# The runtime's field names -> generate()'s (its prompt is ``prompt`` where /generate's is ``text``)
ENGINE_NAMES = {"text": "prompt"}


class _Call(DecodingHandle):
    """One request's handle: the scheduler thread puts its outputs in ``updates``, and its caller's thread
    detokenizes and applies them."""

    def __init__(self, single: SingleRequest, tokenizer: Any):
        super().__init__(single, tokenizer)
        self.updates: queue.SimpleQueue[ReqOutput | BaseException] = queue.SimpleQueue()

    def next_update(self) -> None:
        """Wait for the next output and apply it; RuntimeError if the scheduler thread failed."""
        item = self.updates.get()
        if isinstance(item, BaseException):
            raise RuntimeError("the scheduler thread failed") from item
        self.apply_output(item)


T = TypeVar("T")


def on_short_lived_thread(build: Callable[[], T]) -> T:
    """``build()`` on a thread that ends when it returns. Loading a model runs OpenMP parallel regions, and
    libgomp keeps a team of worker threads for every thread that has started one: built on the caller's
    thread, the model would leave a second team beside the scheduler thread's, and with more teams than cores
    libgomp's workers sleep between regions (a batch-1 decode step measured 21 ms instead of 9.5 ms). A team
    ends with its thread."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="radixserve-build")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class Engine:
    def __init__(self, model: str = "default", **options: Any):
        self.args = ServerArgs(model=model, **options).resolve()
        self.runner = on_short_lived_thread(lambda: ModelRunner(self.args))
        self.tokenizer = load_tokenizer(self.args.tokenizer or self.runner.model_path)
        eos = eos_token_ids(self.tokenizer, self.runner.hf_config, self.runner.model_path)
        self.scheduler = on_short_lived_thread(lambda: Scheduler(self.args, self.runner, self.tokenizer, eos))
        self._transport = QueueTransport(self._route)
        self.front: RequestFront[_Call] = RequestFront(
            self.scheduler.limits, self.tokenizer, max_queued_requests=self.args.max_queued_requests,
            request_timeout=self.args.request_timeout, start_timer=thread_timer, send_abort=self._transport.send,
            status=lambda: self._transport.last_status)
        self._loop = SchedulerLoop(self.scheduler, self._transport)
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="radixserve-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        cache_salt: str | list[str] | None = None,
        stream: bool = False,
        priority: int | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Generate for a prompt, a list of prompts, or token ids.

        Returns one dict for a single sequence, a list for a batch or ``n > 1``, or (``stream=True``,
        single sequence only) an iterator of dicts whose ``text`` is cumulative (one per
        ``sampling_params["stream_interval"]`` new tokens when set, the last always). ``priority``: higher runs
        first with ``enable_priority_scheduling``; ``timeout``: seconds, past which the request is aborted and
        ``RequestTimeout`` raised (default: the Engine's ``request_timeout``).
        Invalid arguments raise ValueError (an IntakeError) naming the field, and a full waiting queue
        ``QueueFull``, before anything is queued.
        """
        with fields_named(ENGINE_NAMES):
            # the same intake as /generate, whose body carries these names
            call = from_native({"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params,
                                "rid": rid, "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                                "top_logprobs_num": top_logprobs_num, "cache_salt": cache_salt, "stream": stream,
                                "priority": priority, "timeout": timeout}, self.front.limits.max_n)
            if stream and len(call.requests) != 1:
                raise IntakeError("stream", "streaming takes a single prompt with n = 1")
            self.front.admit(call.requests)
        calls = [_Call(s, self.tokenizer) for s in call.requests]
        if stream:
            return self._stream(calls[0], return_text_in_logprobs)
        self._send_all(calls)
        results = [self._wait(c, return_text_in_logprobs) for c in calls]
        for c in calls:  # as a call over HTTP: one request that ended in an error makes the call that error
            error = rejection(c.state.finished)
            if error is not None:
                raise error
        return results if call.is_batch else results[0]

    def abort(self, rid: str) -> None:
        self._transport.send(AbortRequest(rid))

    def flush_cache(self) -> bool:
        return self._ask(FlushCacheQuery()).ok

    def check_integrity(self) -> dict[str, int]:
        return dict(self._answer(IntegrityCheckQuery()))

    def server_info(self) -> dict[str, Any]:
        """Queues, KV accounting (integrity-checked), cache and scheduler statistics."""
        return self._answer(ServerInfoQuery())

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._transport.close()
            self._thread.join(timeout=30)
            self.runner.close()  # tensor-parallel ranks stop now, not when the runner is collected
            if not self._thread.is_alive():  # a scheduler thread stuck in a step may still read the pool
                with contextlib.suppress(Exception):  # a failed scheduler's error already reached its callers
                    self.scheduler.close()  # the forward worker ends its step in flight before the pool goes
                self.runner.release_memory()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ helpers
    def _send(self, call: _Call) -> None:
        self._check_alive()
        self.front.track(call)  # raises for a rid in use, or once the scheduler thread has died
        self._transport.send(call.single.message())

    def _send_all(self, calls: list[_Call]) -> None:
        """Send a call's requests; if one cannot be sent, abort those that were (nobody will wait for them)."""
        sent: list[_Call] = []
        try:
            for c in calls:
                self._send(c)
                sent.append(c)
        except BaseException:
            for c in sent:
                self.abort(c.single.rid)
            raise

    def _wait(self, call: _Call, text_in_logprobs: bool) -> dict[str, Any]:
        while call.state.finished is None:
            call.next_update()
        return self._result(call, text_in_logprobs)

    def _stream(self, call: _Call, text_in_logprobs: bool) -> Iterator[dict[str, Any]]:
        self._send(call)
        pacer = StreamPacer(call.single.sampling.stream_interval)
        try:
            while call.state.finished is None:
                call.next_update()
                error = rejection(call.state.finished)
                if error is not None:
                    raise error
                if pacer.due(call.state):
                    yield self._result(call, text_in_logprobs)
        finally:
            if call.state.finished is None:
                self.abort(call.single.rid)

    def _result(self, call: _Call, text_in_logprobs: bool) -> dict[str, Any]:
        token_text = (lambda t: self.tokenizer.decode([t])) if text_in_logprobs else None
        return call.state.to_native(call.single.options, token_text)

    def _check_alive(self) -> None:
        """Requests and control calls fail at once (instead of waiting forever) once the thread has died."""
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError("the Engine's scheduler thread has stopped") from self._error

    def _ask(self, query: ControlQuery) -> ControlReply:
        self._check_alive()
        return self._transport.ask(query, self._check_alive)  # it may die while this call waits

    def _answer(self, query: ControlQuery) -> dict[str, Any]:
        """A query's data; the exception it raised on the scheduler thread, re-raised here, if it failed."""
        reply = self._ask(query)
        if reply.error is not None:
            raise reply.error
        if not reply.ok:
            raise RuntimeError(reply.data.get("message", f"{type(query).__name__} failed"))
        return reply.data

    def inspect(self, fn: Callable[[Scheduler], T]) -> T:
        """``fn(scheduler)`` on the scheduler thread between two steps (tests and benchmarks read and adjust
        the scheduler this way)."""
        value: T = self._answer(InspectQuery(fn=fn))["value"]
        return value

    # ------------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as exc:  # surface the failure to every waiting caller
            logger.exception("scheduler thread failed")
            self._error = exc
            refusal = RuntimeError("the Engine's scheduler thread has stopped")
            refusal.__cause__ = exc  # for a request registered after this (``_send`` checks first)
            for call in self.front.fail_all(refusal):
                call.updates.put(exc)

    def _route(self, outputs: list[ReqOutput]) -> None:
        """One step's outputs to their requests' handles (on the scheduler thread; the callers detokenize)."""
        for out in outputs:
            call = self.front.route(out)  # a finished request's deadline stops here
            if call is not None:
                call.updates.put(out)
