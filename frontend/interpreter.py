"""StreamExecutor: executes the expressions of one program state, in order, on its own worker thread.

``s += gen("x")`` only queues the expression and returns, so a program keeps building (and its forks
run their generations concurrently) until it reads a value: ``s["x"]`` waits for that variable's event.
This is why every state stream has its own thread: ``for f in s.fork(3): f += gen(...)`` sends three
requests at once and the server batches them over the shared, cached prefix.

A failure in the worker is recorded (``error()``), wakes every waiter, and turns later expressions of
that stream into no-ops; reading a variable that was never produced re-raises it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import uuid
from typing import TYPE_CHECKING, Any

from frontend.dtypes import convert, dtype_regex, dtype_stops, normalize_dtype
from frontend.ir import (
    CommitLazy,
    ConcatenateAndAppend,
    ConstantText,
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    names_defined,
)
from frontend.stream_meta import StreamMeta

if TYPE_CHECKING:
    from frontend.backends.base import BaseBackend
    from frontend.chat import ChatTemplate

logger = logging.getLogger(__name__)


class StreamExecutor:
    def __init__(self, backend: BaseBackend, arguments: dict[str, Any], default_params: GenParams,
                 chat_template: ChatTemplate | None = None, stream: bool = False, use_thread: bool = True):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_params = default_params
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.use_thread = use_thread

        self.text_ = ""  # the whole prompt so far, as the completion API sees it
        self.messages_: list[dict[str, Any]] = []  # the same conversation in the chat API's form
        self.variables: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        self.error_: BaseException | None = None
        self.is_finished = False
        self._scope_start: dict[str, int] = {}
        self._ended = False

        # Streaming: set whenever text (or a variable being generated) grows.
        self.stream_text_event = threading.Event()
        self.stream_var_event: dict[str, threading.Event] = {}
        self.stream_buffers: dict[str, str] = {}
        # Per streamed variable, its chunks as they arrived: (new text, that frame's meta_info increment).
        self.stream_frames: dict[str, list[tuple[str, dict[str, Any]]]] = {}

        self._queue: queue.Queue[Expr | None] = queue.Queue()
        if use_thread:
            self._worker = threading.Thread(target=self._work, name=f"sgl-stream-{self.sid[:8]}", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------------ called from the program
    def submit(self, expr: Expr | str) -> None:
        expr = as_expr(expr)
        for name in names_defined(expr):
            self.variable_event[name] = threading.Event()
            self.stream_var_event[name] = threading.Event()
        if self.use_thread:
            self._queue.put(expr)
        else:
            self._execute(expr)

    def sync(self) -> None:
        """Wait until every queued expression has run."""
        if self.use_thread:
            self._queue.join()

    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise RuntimeError(f"variable {name!r} was not produced: the program failed") from self.error_
        raise KeyError(name)

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: str, timeout: float | None = None) -> Any:
        event = self.variable_event.get(name)
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"timed out waiting for {name!r}")
        return self.meta_info.get(name)

    def fork(self, size: int = 1) -> list[StreamExecutor]:
        """``size`` executors continuing from this one's text; a prefix worth sharing is prefilled first."""
        size = int(size)
        self.sync()
        if size > 1 and self.text_:
            # One prefill-only request for the shared prefix, so each branch's first request hits the cache
            # instead of all of them computing the same prefix at once.
            self.submit(CommitLazy())
            self.sync()
        children = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.arguments, self.default_params, self.chat_template,
                                   self.stream, self.use_thread)
            child.variables = dict(self.variables)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            children.append(child)
        return children

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.messages_

    def error(self) -> BaseException | None:
        self.sync()
        return self.error_

    def end(self) -> None:
        """No more expressions: the worker finishes what is queued, then exits."""
        if self._ended:
            return
        self._ended = True
        if self.use_thread:
            self._queue.put(None)
        else:
            self._finish()
        self.backend.end_program(self)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # during interpreter shutdown anything may already be gone
            self.end()

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    self._finish()
                    return
                if self.error_ is None:
                    self._execute(expr)
                else:
                    self._release(expr)
            except Exception as exc:
                logger.error("program stream %s failed: %s", self.sid[:8], exc, exc_info=True)
                self.error_ = exc
                self._release_all()
            finally:
                self._queue.task_done()
                self.stream_text_event.set()

    def _finish(self) -> None:
        self.is_finished = True
        self._release_all()
        self.stream_text_event.set()

    def _release(self, expr: Expr) -> None:
        """Wake readers of the variables a skipped expression would have set."""
        for name in names_defined(expr):
            self._set_event(name)

    def _release_all(self) -> None:
        for name in list(self.variable_event):
            self._set_event(name)

    def _set_event(self, name: str) -> None:
        self.variable_event[name].set()
        if name in self.stream_var_event:
            self.stream_var_event[name].set()

    # ------------------------------------------------------------------ expressions
    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ConstantText):
            self.text_ += expr.value
        elif isinstance(expr, ExprList):
            for e in expr.expr_list:
                self._execute(e)
        elif isinstance(expr, Gen):
            self._execute_gen(expr)
        elif isinstance(expr, Select):
            self._execute_select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self._scope_start[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self.variables[expr.name] = self.text_[self._scope_start.pop(expr.name):]
            self._set_event(expr.name)
        elif isinstance(expr, CommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(expr, ConcatenateAndAppend):
            for state in expr.states:
                child = state.stream_executor
                child.sync()
                self.text_ += child.text_[child.fork_start_text_pos or 0:]
        else:
            raise TypeError(f"cannot execute {expr!r}")

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"{role}: roles cannot nest (inside {self.cur_role})")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and default_system:
            # What the model's template does when a conversation has no system message.
            self._role_begin("system")
            self.text_ += default_system
            self._role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.text_ += prefix
        self.cur_role = role
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end: the open role is {self.cur_role}")
        content = self.text_[self.cur_role_begin_pos or 0:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.text_ += suffix
        self.cur_role = None
        self.cur_role_begin_pos = None
        self.messages_.append({"role": role, "content": content})

    def resolve_params(self, params: GenParams) -> GenParams:
        """The gen's own values over the program's defaults, the template's stop strings, dtype as regex."""
        out = params.merged_over(self.default_params)
        stops = out.stop_list
        dtype = normalize_dtype(out.dtype)
        if dtype is not None:
            if out.regex is not None and out.regex != dtype_regex(dtype):
                logger.warning("gen: both dtype and regex given; dtype wins (as in SGLang)")
            out.regex = dtype_regex(dtype)
            stops += dtype_stops(dtype)
        out.dtype = dtype
        stops += [s for s in self.chat_template.stop_str if s not in stops]
        out.stop = stops
        return out

    def _execute_gen(self, expr: Gen) -> None:
        params = self.resolve_params(expr.params)
        name = expr.name
        if not self.stream:
            comp, meta = self.backend.generate(self, params)
            if isinstance(comp, list):  # n > 1: the state continues with the first sample (as in SGLang)
                self.text_ += comp[0]
                value: Any = [convert(c, params.dtype) if params.dtype else c for c in comp]
            else:
                self.text_ += comp
                value = convert(comp, params.dtype) if params.dtype else comp
        else:
            if (params.n or 1) > 1:
                raise ValueError("gen: n > 1 samples cannot be streamed")
            comp, meta, frames = "", {}, StreamMeta()
            chunks: list[tuple[str, dict[str, Any]]] = []
            if name is not None:
                self.stream_frames[name] = chunks  # a gen that reuses a name starts its stream afresh
            for delta, frame_meta in self.backend.generate_stream(self, params):
                increment, meta = frames.feed(frame_meta)
                self.text_ += delta
                comp += delta
                if name is not None:
                    chunks.append((delta, increment))
                    self.meta_info[name] = meta
                    self.stream_buffers[name] = comp
                    self.stream_var_event[name].set()
                self.stream_text_event.set()
            value = convert(comp, params.dtype) if params.dtype else comp
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self._set_event(name)

    def _execute_select(self, expr: Select) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self.text_ += decision.decision
        if expr.name is not None:
            self.variables[expr.name] = decision.decision
            self.stream_buffers[expr.name] = decision.decision
            self.stream_frames[expr.name] = [(decision.decision, dict(decision.meta_info or {}))]
            self.meta_info[expr.name] = decision.meta_info
            self._set_event(expr.name)
