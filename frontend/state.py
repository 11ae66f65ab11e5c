"""ProgramState (the ``s`` a program receives) and ProgramStateGroup (what ``s.fork(n)`` returns)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from frontend.interpreter import StreamExecutor
from frontend.ir import ConcatenateAndAppend, Expr, ExprList, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr
from frontend.stream_meta import merge_increments


class ProgramState:
    """The state of one running program: its text, messages and variables.

    ``s += expr`` queues an expression; ``s["name"]`` waits for a variable; ``s.text()`` waits for
    everything queued so far.
    """

    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ------------------------------------------------------------------ building
    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        self.stream_executor.submit(as_expr(other))
        return self

    def _role(self, role: str, expr: Expr | str | None) -> Any:
        if expr is not None:
            role_expr = ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])
            self.stream_executor.submit(role_expr)
            return role_expr

        @contextlib.contextmanager
        def scope() -> Iterator[None]:
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Expr | str | None = None) -> Any:
        """``s.system("text")`` appends a system message; ``with s.system():`` opens one."""
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """The text appended inside the block becomes variable ``name``."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Sequence[int] | None = None) -> ProgramStateGroup:
        """``size`` states that continue from this one's text (prefilled once so they all hit the cache).

        ``position_ids_offset`` is accepted for SGLang compatibility and, as in SGLang, not used: each
        fork's positions simply continue from the shared prefix.
        """
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Sequence[int] | None = None) -> Iterator[ProgramState]:
        """``with s.copy() as c:`` a single fork, joined (its new variables gathered) when the block ends."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ------------------------------------------------------------------ reading
    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        return self.stream_executor.error()

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The backend's ``meta_info`` of the gen/select that produced ``name`` (tokens, cached_tokens...)."""
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def text_iter(self, var_name: str | None = None) -> Iterator[Any]:
        """New text as it is generated (``run(stream=True)``); the whole text (or the variable) at once
        otherwise. With ``var_name``, only that variable's text."""
        if not self.stream_executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        if var_name is None:
            yield from self._text_chunks()
            return
        for text, _ in self._var_chunks(var_name):
            yield text

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """``text_iter`` for asyncio code (each wait runs in the default executor).

        With ``var_name`` and ``return_meta_data=True`` it yields ``(text, meta_info)`` pairs, SGLang's
        shape: the meta_info's output logprob lists hold that chunk's tokens only, and
        ``output_token_logprobs_length`` / ``completion_tokens`` count all tokens so far. (Without
        streaming the one pair is the variable and its whole meta_info.)
        """
        loop = asyncio.get_running_loop()
        if not self.stream_executor.stream:
            value = await loop.run_in_executor(None, self.text if var_name is None else
                                               functools.partial(self.get_var, var_name))
            if var_name is not None and return_meta_data:
                yield value, self.get_meta_info(var_name)
            else:
                yield value
            return
        it: Iterator[Any]
        if var_name is None:
            it = self._text_chunks()
        else:
            it = self._var_chunks(var_name)
        sentinel: Any = object()
        while True:
            item = await loop.run_in_executor(None, next, it, sentinel)
            if item is sentinel:
                return
            if var_name is None or return_meta_data:
                yield item
            else:
                yield item[0]

    def _text_chunks(self) -> Iterator[str]:
        exe = self.stream_executor
        prev = 0
        while True:
            exe.stream_text_event.wait()
            exe.stream_text_event.clear()
            finished = exe.is_finished  # read before the text, so a final delta is never missed
            out = exe.text_[prev:]
            prev += len(out)
            if out:
                yield out
            if finished:
                return

    def _var_chunks(self, var_name: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """(new text, meta_info increment) per streamed frame of ``var_name``; a frame without text (a
        token the detokenizer holds back) is merged into the next one."""
        exe = self.stream_executor
        while var_name not in exe.stream_var_event:  # the program has not reached this gen yet
            if exe.is_finished:
                yield "", {}  # SGLang's answer for a variable the program never defines
                return
            time.sleep(0.005)
        event, done = exe.stream_var_event[var_name], exe.variable_event[var_name]
        consumed, pending_text, pending_meta = 0, "", []
        while True:
            event.wait()
            event.clear()
            finished = done.is_set()  # read before the frames, so a final frame is never missed
            frames = exe.stream_frames.get(var_name, [])
            new = frames[consumed:]  # one read: the worker may append while we yield
            consumed += len(new)
            for text, meta in new:
                pending_text += text
                pending_meta.append(meta)
                if pending_text:
                    yield pending_text, merge_increments(pending_meta)
                    pending_text, pending_meta = "", []
            if finished:
                if not frames and var_name in exe.variables:  # set without streaming (a var_scope)
                    yield str(exe.variables[var_name]), exe.meta_info.get(var_name) or {}
                return

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stream_executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states of one fork; ``join()`` gathers their new variables into the parent as lists."""

    def __init__(self, states: Sequence[ProgramState], src_state: ProgramState | None = None):
        self.states = list(states)
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """``gather_variable``: each variable the forks created becomes a list in the parent (one value
        per fork, in order). ``concate_and_append``: the forks' new text is appended to the parent."""
        if self.src_state is None:
            raise ValueError("join: this group has no parent state")
        if mode == "gather_variable":
            parent_vars = self.src_state.stream_executor.variables
            known = set(parent_vars)
            for child in self.states:
                child.stream_executor.sync()
                for name, value in child.stream_executor.variables.items():
                    if name not in known:
                        parent_vars.setdefault(name, []).append(value)
        elif mode == "concate_and_append":
            self.src_state += ConcatenateAndAppend(self.states)
            self.src_state.sync()
        else:
            raise ValueError(f"join: unknown mode {mode!r}")
        for child in self.states:
            child.stream_executor.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """What ``forks[i] += expr`` ends with: the state, extended in place, is stored back."""
        if value is not self.states[i]:
            raise TypeError("a fork's state cannot be replaced; extend it with forks[i] += ...")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Callable[[int], Expr | str] | Expr | str | Sequence[Expr | str]) -> ProgramStateGroup:
        """``forks += expr`` (to every fork), ``forks += [e0, e1, ...]`` or ``forks += lambda i: ...``."""
        if isinstance(other, (Expr, str)):
            for state in self.states:
                state += other
        elif callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            raise TypeError(f"cannot append {type(other).__name__} to a fork group")
        return self
