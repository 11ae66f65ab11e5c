"""Typed ``gen(dtype=int|float|bool|str)``: the regex the server is asked to enforce, and the conversion back.

As in SGLang, a dtype becomes a ``regex`` in ``sampling_params`` (overriding any ``regex`` given) and,
for numbers, ``" "`` and ``"\\n"`` stop strings, so the number ends where the model would start the next
word. The state's text keeps the model's raw output; the variable gets the Python value.

Conversion reads the longest valid prefix, because a regex-constrained output can still be cut short
by ``max_tokens`` (e.g. ``"3."``): that must still give a number, not an exception.
"""

from __future__ import annotations

import json
import re
from typing import Any

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_INT_PREFIX = re.compile(r"\s*([-+]?\d+)")
_FLOAT_PREFIX = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+))")


class DtypeError(ValueError):
    """The model's output cannot be read as the requested type (the server did not enforce the regex)."""


def normalize_dtype(dtype: Any) -> str | None:
    """``int``/``"int"`` -> ``"int"`` etc.; ``None`` stays ``None``."""
    if dtype is None:
        return None
    names = {int: "int", float: "float", bool: "bool", str: "str"}
    if dtype in names:
        return names[dtype]
    if isinstance(dtype, str) and dtype in ("int", "float", "bool", "str", "string"):
        return "str" if dtype == "string" else dtype
    raise ValueError(f"dtype: expected int, float, bool or str, got {dtype!r}")


def dtype_regex(dtype: str) -> str:
    return {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}[dtype]


def dtype_stops(dtype: str) -> list[str]:
    return [" ", "\n"] if dtype in ("int", "float") else []


def convert(text: str, dtype: str) -> Any:
    """The Python value of a typed gen's output; raises DtypeError when nothing of that type is there."""
    if dtype == "int":
        m = _INT_PREFIX.match(text)
        if m:
            return int(m.group(1))
    elif dtype == "float":
        m = _FLOAT_PREFIX.match(text)
        if m:
            return float(m.group(1))
    elif dtype == "bool":
        head = text.strip()[:1]
        if head in ("T", "t"):
            return True
        if head in ("F", "f"):
            return False
    elif dtype == "str":
        return _unquote(text)
    raise DtypeError(f"expected {dtype}, the model produced {text[:80]!r} "
                     "(does the backend enforce regex-constrained decoding?)")


def _unquote(text: str) -> str:
    """``'"abc"'`` -> ``'abc'``; an unterminated quote (cut by max_tokens) keeps what was generated."""
    s = text.strip()
    if s.startswith('"'):
        end = s.find('"', 1)
        body = s[1:end] if end != -1 else s[1:]
        try:
            return str(json.loads(f'"{body}"'))
        except ValueError:
            return body
    return s
