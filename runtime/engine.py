"""Engine: the runtime in-process. ``Engine(model=..., **options).generate(...)``.

The scheduler runs on a background thread (the same Scheduler the server's scheduler process runs);
``generate`` may be called from many threads at once and each call waits only for its own requests.
Results are SGLang-native dicts: ``{"text", "output_ids", "meta_info"}``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from runtime.config import ServerArgs
from runtime.core.errors import IntakeError
from runtime.core.messages import ReqOutput
from runtime.executor.model_runner import ModelRunner
from runtime.models.loader import load_tokenizer
from runtime.models.tokenizer import eos_token_ids
from runtime.request.decode_stream import DecodeStream
from runtime.request.intake import Limits, SingleRequest, from_native, prepare
from runtime.request.state import RequestState
from runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
GRAMMAR_POLL_S = 0.005


class _Call:
    """One request's mailbox between the scheduler thread and the caller."""

    def __init__(self, single: SingleRequest, tokenizer: Any):
        self.single = single
        self.state = RequestState(single.rid)
        self.decoder = DecodeStream(tokenizer, single.sampling)
        self.updates: queue.SimpleQueue[ReqOutput | BaseException] = queue.SimpleQueue()


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
        self.limits = Limits(self.runner.vocab_size, self.runner.context_length, self.runner.allocator.capacity,
                             self.args.max_running_requests)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._calls: dict[str, _Call] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="radixserve-scheduler", daemon=True)
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
    ) -> Any:
        """Generate for a prompt, a list of prompts, or token ids.

        Returns one dict for a single sequence, a list for a batch or ``n > 1``, or (``stream=True``,
        single sequence only) an iterator of dicts whose ``text`` is cumulative.
        Invalid arguments raise ValueError (an IntakeError) naming the field, before anything is queued.
        """
        # the same intake as /generate, whose body carries these names
        call = from_native({"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params, "rid": rid,
                            "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                            "top_logprobs_num": top_logprobs_num, "cache_salt": cache_salt, "stream": stream},
                           self.limits.max_n)
        if stream and len(call.requests) != 1:
            raise IntakeError("stream", "streaming takes a single prompt with n = 1")
        calls = [self._prepare(s) for s in call.requests]
        if stream:
            return self._stream(calls[0], return_text_in_logprobs)
        for c in calls:
            self._send(c)
        results = [self._wait(c, return_text_in_logprobs) for c in calls]
        return results if call.is_batch else results[0]

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> bool:
        return bool(self._control(lambda s: s.flush_cache()))

    def check_integrity(self) -> dict[str, int]:
        return dict(self._control(lambda s: s.check_integrity()))

    def server_info(self) -> dict[str, Any]:
        """Queues, KV accounting (integrity-checked), cache and scheduler statistics."""
        return dict(self._control(lambda s: s.server_info()))

    def shutdown(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._inbox.put(("wake", None))
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ helpers
    def _prepare(self, single: SingleRequest) -> _Call:
        prepare(single, lambda text: list(self.tokenizer(text).input_ids), self.limits)
        return _Call(single, self.tokenizer)

    def _send(self, call: _Call) -> None:
        s = call.single
        self._check_alive()
        with self._lock:
            if s.rid in self._calls:
                raise IntakeError("rid", f"request id {s.rid!r} is already in use")
            self._calls[s.rid] = call
        self._inbox.put(("submit", s.message()))

    def _apply(self, call: _Call, out: ReqOutput) -> None:
        text = call.decoder.add(out.new_token_ids, out.finished)
        call.state.update(out, text)

    def _wait(self, call: _Call, text_in_logprobs: bool) -> dict[str, Any]:
        while call.state.finished is None:
            item = call.updates.get()
            if isinstance(item, BaseException):
                raise RuntimeError("the scheduler thread failed") from item
            self._apply(call, item)
        return self._result(call, text_in_logprobs)

    def _stream(self, call: _Call, text_in_logprobs: bool) -> Iterator[dict[str, Any]]:
        self._send(call)
        try:
            while call.state.finished is None:
                item = call.updates.get()
                if isinstance(item, BaseException):
                    raise RuntimeError("the scheduler thread failed") from item
                self._apply(call, item)
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

    def _control(self, fn: Any) -> Any:
        self._check_alive()
        box: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inbox.put(("control", (fn, box)))
        while True:
            try:
                result = box.get(timeout=0.5)
                break
            except queue.Empty:
                self._check_alive()  # it may die while this call waits
        if isinstance(result, BaseException):
            raise result
        return result

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        sched = self.scheduler
        try:
            while not self._stopped.is_set():
                # block while idle; poll briefly while only grammar compilations are pending
                timeout: float | None = None if sched.idle else (0.0 if sched.busy else GRAMMAR_POLL_S)
                while True:
                    try:
                        kind, payload = self._inbox.get(block=timeout != 0.0, timeout=timeout or None)
                    except queue.Empty:
                        break
                    timeout = 0.0
                    self._handle(kind, payload)
                for out in sched.step():
                    with self._lock:
                        call = self._calls.get(out.rid)
                        if out.finished is not None:
                            self._calls.pop(out.rid, None)
                    if call is not None:
                        call.updates.put(out)
        except BaseException as exc:  # surface the failure to every waiting caller
            logger.exception("scheduler thread failed")
            self._error = exc
            with self._lock:
                for call in self._calls.values():
                    call.updates.put(exc)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "submit":
            self.scheduler.submit(payload)
        elif kind == "abort":
            self.scheduler.abort(payload)
        elif kind == "control":
            fn, box = payload
            try:
                box.put(fn(self.scheduler))
            except BaseException as exc:
                box.put(exc)
