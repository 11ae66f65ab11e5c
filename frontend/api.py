"""The public DSL: ``@function``, ``gen``, ``select``, roles, and the default backend (SGLang's names)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from frontend.choices import ChoicesSamplingMethod, token_length_normalized
from frontend.dtypes import normalize_dtype
from frontend.global_config import global_config
from frontend.ir import (
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    as_expr,
    program_defaults,
    schema_text,
)
from frontend.state import ProgramState


def set_default_backend(backend: Any) -> None:
    """The backend ``run``/``run_batch`` use when none is passed (``global_config.default_backend``)."""
    global_config.default_backend = backend


def get_default_backend() -> Any:
    return global_config.default_backend


def flush_cache(backend: Any = None) -> bool:
    """Drop the server's cached prefixes; False when there is no backend or the server refuses."""
    from frontend.run import resolve_backend

    if backend is None and global_config.default_backend is None:
        return False
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """The server's ``/get_server_info``; None when there is no backend (as in SGLang)."""
    from frontend.run import resolve_backend

    if backend is None and global_config.default_backend is None:
        return None
    return resolve_backend(backend).get_server_info()


class SglFunction:
    """A program: a Python function whose first parameter is the state ``s``.

    ``num_api_spec_tokens`` is accepted for SGLang compatibility; API speculative execution is not
    implemented (with a chat model, each ``gen`` must follow ``assistant_begin``).
    """

    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise TypeError(f"{func.__name__}: the first parameter of a program must be named 's'")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not inspect.Parameter.empty]
        self.required_args = [p.name for p in params[1:] if p.default is inspect.Parameter.empty
                              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"bind: {self.func.__name__} has no argument(s) {sorted(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, n: int = 1, stop: str | Sequence[str] | None = None,
            stop_token_ids: Sequence[int] | None = None, stop_regex: str | Sequence[str] | None = None,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
            stream: bool = False, backend: Any = None, use_thread: bool = True, **kwargs: Any) -> ProgramState:
        """Run once. Sampling arguments are defaults for every ``gen`` that does not set its own;
        ``use_thread=False`` executes each expression as it is appended, on the caller's thread."""
        from frontend.run import resolve_backend, run_program

        defaults = program_defaults(
            max_new_tokens=max_new_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids, stop_regex=stop_regex,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program(self, resolve_backend(backend), args, kwargs, defaults, stream, use_thread=use_thread)

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]], *, max_new_tokens: int = 128,
                  n: int = 1, stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                  stop_regex: str | Sequence[str] | None = None, temperature: float = 1.0, top_p: float = 1.0,
                  top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool | None = None,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  generator_style: bool = False) -> Any:
        """Run once per element (a kwargs dict, or a list of positional values): the finished states in
        input order, as a list, or with ``generator_style=True`` as an iterator yielding each in turn."""
        from frontend.run import resolve_backend, run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch: batch_kwargs must be a list")
        if not batch_kwargs:
            return iter([]) if generator_style else []
        normalized = [self._as_kwargs(item) for item in batch_kwargs]
        defaults = program_defaults(
            max_new_tokens=max_new_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids, stop_regex=stop_regex,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program_batch(self, resolve_backend(backend), normalized, defaults, num_threads, progress_bar,
                                 generator_style=generator_style)

    def cache(self, backend: Any = None) -> dict[str, Any] | None:
        """Prefill the text the program builds before it uses an argument or calls the model, so later
        runs hit the cache; the prefill's meta_info, or None when that text is too short to bother."""
        from frontend.run import cache_program, resolve_backend

        return cache_program(self, resolve_backend(backend))

    def _as_kwargs(self, item: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(item, dict):
            return dict(item)
        if isinstance(item, (list, tuple)) and len(item) <= len(self.arg_names):
            kwargs = dict(zip(self.arg_names, item))
            missing = [n for n in self.required_args if n not in kwargs and n not in self.bind_arguments]
            if not missing:
                return kwargs
        raise TypeError(f"run_batch: {item!r} does not match the arguments of {self.func.__name__} "
                        f"{self.arg_names}")

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """``@function`` or ``@function(...)``: turn ``def prog(s, ...)`` into a runnable program."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
        stop_regex: str | Sequence[str] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        dtype: type | str | None = None, choices: Sequence[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: Any = None) -> Expr:
    """Generate text into variable ``name``; with ``choices`` this is ``select``. SGLang's parameters, in
    SGLang's order.

    ``n`` > 1 samples that many continuations: the variable is the list of them and the state continues
    with the first. ``stop_regex`` (a pattern or a list) ends the generation at the first match.
    ``dtype`` (int, float, bool, str) constrains the output with a regex and stores the Python value;
    ``json_schema`` takes a dict, a JSON string or a pydantic model class.
    """
    if choices:
        return Select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if regex is not None:
        re.compile(regex)  # fail in the program, not on the server
    for pattern in [stop_regex] if isinstance(stop_regex, str) else list(stop_regex or []):
        re.compile(pattern)
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"gen: n must be a positive integer, got {n!r}")
    normalize_dtype(dtype)
    return Gen(name, GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex,
        json_schema=schema_text(json_schema)))


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
            stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
            stop_regex: str | Sequence[str] | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
            frequency_penalty: float | None = None, presence_penalty: float | None = None,
            ignore_eos: bool | None = None, return_logprob: bool | None = None,
            logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
            return_text_in_logprobs: bool | None = None) -> Expr:
    """``gen(dtype=int)``: an integer (stored as a Python int)."""
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs, dtype=int)


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
               stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
               stop_regex: str | Sequence[str] | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               ignore_eos: bool | None = None, return_logprob: bool | None = None,
               logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
               return_text_in_logprobs: bool | None = None) -> Expr:
    """``gen(dtype=str)``: a double-quoted string (the text keeps the quotes, the variable does not)."""
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs, dtype=str)


def select(name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Expr:
    """Append whichever of ``choices`` the model scores highest (by token logprobs) and store it as ``name``."""
    if not choices:
        raise ValueError("select: give at least one choice")
    return Select(name, choices, temperature, choices_method)


def _role(role: str, expr: Expr | str | None) -> ExprList:
    inner = [] if expr is None else [as_expr(expr)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def system(expr: Expr | str | None = None) -> ExprList:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
