"""Running programs: one (``run``), many (``run_batch``), and the shared-prefix prefill before a batch.

Prefix sharing for a batch: before the programs fan out, each one is dry-run up to its first model call
against a backend that only records text (side effects of the program before its first ``gen`` run
twice). The longest common prefix of those texts -- cut back to a whitespace boundary, so a tokenizer
that attaches spaces to the following word tokenizes it the same way as the full prompts -- is sent once
as a prefill-only request. Every program's first request then hits the cache instead of N concurrent
requests each computing the same few-shot block.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import tqdm

from frontend.backends.base import BaseBackend
from frontend.global_config import global_config
from frontend.interpreter import StreamExecutor
from frontend.ir import GenParams, program_defaults
from frontend.state import ProgramState

if TYPE_CHECKING:
    from frontend.api import SglFunction

MIN_SHARED_PREFIX_CHARS = 64  # below this a separate prefill request costs more than it saves
_MARK = "\x00"  # never in a real prompt: where a traced argument's value starts


def resolve_backend(backend: Any) -> BaseBackend:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...) first")
    backend = getattr(backend, "endpoint", backend)  # a Runtime wraps its endpoint
    if not isinstance(backend, BaseBackend):
        raise TypeError(f"backend: expected a frontend backend, got {type(backend).__name__}")
    return backend


def _run_internal(state: ProgramState, program: SglFunction, args: Sequence[Any], kwargs: dict[str, Any],
                  sync: bool) -> None:
    exe = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except BaseException as exc:
        if exe.stream:  # nobody to raise to in the background thread: report through error()
            if exe.error_ is None:  # keep the root cause when this is a read of a failed gen's variable
                exe.error_ = exc
            return
        raise
    finally:
        exe.end()
    if sync:
        exe.sync()
    if global_config.verbosity >= 2:
        print(state.text())


def run_program(program: SglFunction, backend: BaseBackend, args: Sequence[Any], kwargs: dict[str, Any],
                default_params: GenParams, stream: bool, sync: bool = False, use_thread: bool = True) -> ProgramState:
    kwargs = {**program.bind_arguments, **kwargs}
    state = ProgramState(StreamExecutor(backend, kwargs, default_params, stream=stream, use_thread=use_thread))
    if stream:
        threading.Thread(target=_run_internal, args=(state, program, args, kwargs, sync), daemon=True).start()
    else:
        _run_internal(state, program, args, kwargs, sync)
    return state


def run_program_batch(program: SglFunction, backend: BaseBackend, batch_kwargs: Sequence[dict[str, Any]],
                      default_params: GenParams, num_threads: int | str, progress_bar: bool,
                      generator_style: bool = False) -> list[ProgramState] | Iterator[ProgramState]:
    """Run one program per kwargs dict on ``num_threads`` threads; results in input order, all finished
    (with ``generator_style``, an iterator that yields each state once it is finished, in input order)."""
    if len(batch_kwargs) > 1 and global_config.enable_precache_with_tracing:
        prefix = shared_prefix(program, backend, batch_kwargs, default_params)
        if len(prefix) >= MIN_SHARED_PREFIX_CHARS:
            backend.cache_prefix(prefix)
    if num_threads == "auto":
        num_threads = max(96, multiprocessing.cpu_count() * 16)
    threads = max(1, min(int(num_threads), len(batch_kwargs)))
    states = _run_batch_iter(program, backend, batch_kwargs, default_params, threads, progress_bar)
    return states if generator_style else list(states)


def _run_batch_iter(program: SglFunction, backend: BaseBackend, batch_kwargs: Sequence[dict[str, Any]],
                    default_params: GenParams, threads: int, progress_bar: bool) -> Iterator[ProgramState]:
    bar = tqdm.tqdm(total=len(batch_kwargs)) if progress_bar else None

    def one(kwargs: dict[str, Any]) -> ProgramState:
        # Synced, so a worker thread stays busy until its program is done: num_threads then bounds the
        # number of programs in flight, and the progress bar counts finished programs.
        state = run_program(program, backend, (), kwargs, default_params, stream=False, sync=True)
        if bar is not None:
            bar.update()
        return state

    try:
        if threads == 1:
            for kw in batch_kwargs:
                yield one(kw)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="sgl-batch") as pool:
            futures = [pool.submit(one, kw) for kw in batch_kwargs]
            for f in futures:
                yield f.result()
    finally:
        if bar is not None:
            bar.close()


def cache_program(program: SglFunction, backend: BaseBackend) -> dict[str, Any] | None:
    """Prefill the program's argument-independent head: its text up to the first model call or the first
    place an argument's value shows (each argument is traced as a marker string)."""
    markers = {name: f"{_MARK}{name}{_MARK}" for name in program.arg_names if name not in program.bind_arguments}
    text = trace_prefix(program, backend, markers, program_defaults())
    cut = text.find(_MARK)
    prefix = _word_boundary(text[:cut]) if cut != -1 else text
    return backend.cache_prefix(prefix) if len(prefix) >= MIN_SHARED_PREFIX_CHARS else None


# ---------------------------------------------------------------------------- prefix discovery
class _StopTrace(BaseException):
    """Raised at the first model call of a dry run (a BaseException so programs' ``except Exception``
    blocks do not swallow it)."""


class _TracingBackend(BaseBackend):
    """Records text; any model call ends the dry run."""

    def __init__(self, real: BaseBackend):
        self.chat_template = real.get_chat_template()
        self.is_chat_model = real.is_chat_model

    def commit_lazy_operations(self, s: Any) -> None:
        raise _StopTrace

    def generate(self, s: Any, params: GenParams) -> Any:
        raise _StopTrace

    def generate_stream(self, s: Any, params: GenParams) -> Any:
        raise _StopTrace

    def select(self, *args: Any, **kwargs: Any) -> Any:
        raise _StopTrace


def trace_prefix(program: SglFunction, backend: BaseBackend, kwargs: dict[str, Any],
                 default_params: GenParams) -> str:
    """The text a program has built when it first needs the model ("" if the dry run fails)."""
    kwargs = {**program.bind_arguments, **kwargs}
    exe = StreamExecutor(_TracingBackend(backend), kwargs, default_params, use_thread=False)
    try:
        program.func(ProgramState(exe), **kwargs)
    except _StopTrace:
        pass
    except Exception:  # the real run will report it
        return ""
    return exe.text_


def shared_prefix(program: SglFunction, backend: BaseBackend, batch_kwargs: Sequence[dict[str, Any]],
                  default_params: GenParams) -> str:
    texts = [trace_prefix(program, backend, kw, default_params) for kw in batch_kwargs]
    prefix = _common_prefix(texts)
    if any(len(t) > len(prefix) for t in texts):  # the programs diverge inside a word: back off
        prefix = _word_boundary(prefix)
    return prefix


def _word_boundary(prefix: str) -> str:
    """``prefix`` cut back to its last whitespace ("" if it has none)."""
    cut = max(prefix.rfind(c) for c in " \n\t")
    return prefix[:cut] if cut > 0 else ""


def _common_prefix(texts: Sequence[str]) -> str:
    """Longest common prefix (the lexicographic min and max differ first where any pair does)."""
    if not texts:
        return ""
    lo, hi = min(texts), max(texts)
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]
