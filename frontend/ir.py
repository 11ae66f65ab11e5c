"""The expressions a program appends to its state (``s += ...``), and generation parameters.

A program never talks to a backend directly: ``s += gen("x")`` queues a ``Gen`` expression on the
state's stream, whose worker thread executes it. Keeping expressions as plain data is what lets the
interpreter run the same program against the HTTP runtime, the in-process Engine or an OpenAI server,
and lets ``run_batch`` dry-run a program up to its first model call to find the shared prefix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

# SGLang programs import the dtype regexes from the IR module (``from sglang.lang.ir import REGEX_INT``).
from frontend.dtypes import REGEX_BOOL as REGEX_BOOL
from frontend.dtypes import REGEX_FLOAT as REGEX_FLOAT
from frontend.dtypes import REGEX_INT as REGEX_INT
from frontend.dtypes import REGEX_STR as REGEX_STR

if TYPE_CHECKING:
    from frontend.choices import ChoicesSamplingMethod
    from frontend.state import ProgramState


@dataclasses.dataclass
class GenParams:
    """Sampling options of one ``gen``; ``None`` means "not given here, inherit the program default".

    Field names are SGLang's ``sampling_params`` names, so ``to_native`` is a straight copy.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    stop_regex: str | Sequence[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | None = None

    def merged_over(self, defaults: GenParams) -> GenParams:
        """These values where given, else ``defaults``'."""
        out = dataclasses.replace(defaults)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(out, f.name, value)
        return out

    @property
    def stop_list(self) -> list[str]:
        return _str_list(self.stop)

    @property
    def stop_regex_list(self) -> list[str]:
        return _str_list(self.stop_regex)

    def to_native(self) -> dict[str, Any]:
        """The ``sampling_params`` object of a native ``/generate`` request (unset fields omitted)."""
        out: dict[str, Any] = {}
        for name in ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                     "frequency_penalty", "presence_penalty", "ignore_eos", "regex", "json_schema"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop_list:
            out["stop"] = self.stop_list
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        # Sent only when used, so programs that do not use them also run on servers without them.
        if self.stop_regex_list:
            out["stop_regex"] = self.stop_regex_list
        if self.n is not None and self.n != 1:
            out["n"] = self.n
        return out

    def logprob_fields(self) -> dict[str, Any]:
        """The top-level logprob options of a native request (unset fields omitted)."""
        out: dict[str, Any] = {}
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def _str_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def program_defaults(**overrides: Any) -> GenParams:
    """The defaults ``fn.run(...)`` starts from (SGLang's: 128 new tokens, temperature 1.0)."""
    base = GenParams(max_new_tokens=128, n=1, stop=(), stop_token_ids=(), stop_regex=(), temperature=1.0,
                     top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False)
    return GenParams(**{k: v for k, v in overrides.items() if v is not None}).merged_over(base)


def schema_text(schema: Any) -> str | None:
    """A JSON schema given as a dict, a JSON string or a pydantic model class, as the JSON text servers take."""
    if schema is None or isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    to_schema = getattr(schema, "model_json_schema", None)  # pydantic v2 model class
    if callable(to_schema):
        return json.dumps(to_schema())
    raise TypeError(f"json_schema: expected a dict, a JSON string or a pydantic model, got {type(schema)!r}")


# ---------------------------------------------------------------------------- expressions
class Expr:
    """Base of every expression; ``a + b`` builds an ``ExprList`` (strings become constant text)."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList(_as_list(self) + _as_list(as_expr(other)))

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList(_as_list(as_expr(other)) + _as_list(self))


def as_expr(value: Expr | str | Any) -> Expr:
    """Strings (and anything printable) become constant text; expressions pass through."""
    if isinstance(value, Expr):
        return value
    if value is None:
        raise ValueError("cannot append None to a program state")
    return ConstantText(str(value))


def _as_list(e: Expr) -> list[Expr]:
    return list(e.expr_list) if isinstance(e, ExprList) else [e]


class ExprList(Expr):
    def __init__(self, expr_list: Sequence[Expr]):
        self.expr_list = list(expr_list)

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class ConstantText(Expr):
    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class Gen(Expr):
    def __init__(self, name: str | None, params: GenParams):
        self.name = name
        self.params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class Select(Expr):
    def __init__(self, name: str | None, choices: Sequence[str], temperature: float,
                 choices_method: ChoicesSamplingMethod):
        if not choices:
            raise ValueError("select: give at least one choice")
        if not all(isinstance(c, str) for c in choices):
            raise TypeError("select: choices must be strings")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class RoleBegin(Expr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class RoleEnd(Expr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class VarScopeBegin(Expr):
    """Start of ``with s.var_scope(name)``: the text appended inside becomes variable ``name``."""

    def __init__(self, name: str):
        self.name = name


class VarScopeEnd(Expr):
    def __init__(self, name: str):
        self.name = name


class CommitLazy(Expr):
    """Send the state's text as a prefill-only request, so that forks of it hit the cache."""


class ConcatenateAndAppend(Expr):
    """``join("concate_and_append")``: append each fork's new text to the parent, in order."""

    def __init__(self, states: Sequence[ProgramState]):
        self.states = list(states)


def names_defined(expr: Expr) -> list[str]:
    """Variables an expression will set; their events are created when it is queued, so that a
    reader waits for the value instead of failing with a KeyError while the worker is behind."""
    if isinstance(expr, (Gen, Select)) and expr.name is not None:
        return [expr.name]
    if isinstance(expr, VarScopeBegin):
        return [expr.name]
    if isinstance(expr, ExprList):
        return [n for e in expr.expr_list for n in names_defined(e)]
    return []
