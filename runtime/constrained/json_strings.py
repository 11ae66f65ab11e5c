"""Keep length-bounded JSON strings valid JSON under xgrammar.

xgrammar compiles a string with ``minLength``/``maxLength`` (and no ``pattern``) to the character class
``[^"\\\\\\r\\n]{m,n}``, which admits raw control characters (U+0000..U+001F) that JSON forbids inside a
string. ``strict_strings`` rewrites such strings into the same class minus the control characters,
expressed as a ``pattern`` — the same strings xgrammar would allow, except those that are not JSON.

xgrammar's regex compiler fails on a repetition count above about 128 (``C{200,}`` is rejected with an
internal check), so larger bounds are written as nested repetitions of at most ``_CHUNK`` that accept
exactly the same lengths and stay unambiguous (an ambiguous form compiles many times slower). Compile
time still grows with the bound (minLength 400: ~3 s, maxLength 2,000: ~30 s on one core), so bounds
above ``_STRICT_MAX`` keep xgrammar's own faster form, control characters and all.
"""

from __future__ import annotations

from typing import Any

_CHARS = r'[^"\\\x00-\x1f]'
_CHUNK = 64
_STRICT_MAX = 512
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "unevaluatedProperties", "unevaluatedItems", "propertyNames")


def _rep(unit: str, n: int) -> str:
    """``unit`` exactly ``n`` times, as nested groups with no count above ``_CHUNK``."""
    if n <= _CHUNK:
        return f"(?:{unit}){{{n}}}" if n else ""
    q, r = divmod(n, _CHUNK)
    return _rep(f"(?:{unit}){{{_CHUNK}}}", q) + _rep(unit, r)


def _up_to(unit: str, m: int) -> str:
    """``unit`` 0..m times, unambiguously: fewer than ``q*_CHUNK`` in one branch, the rest in the other."""
    if m <= _CHUNK:
        return f"(?:{unit}){{0,{m}}}" if m else ""
    q, r = divmod(m, _CHUNK)
    below = _up_to(f"(?:{unit}){{{_CHUNK}}}", q - 1) + f"(?:{unit}){{0,{_CHUNK - 1}}}"
    return f"(?:{below}|{_rep(unit, q * _CHUNK)}(?:{unit}){{0,{r}}})"


def length_pattern(lo: int, hi: int | None) -> str:
    """An anchored pattern for JSON string contents of ``lo`` to ``hi`` (None: unbounded) characters."""
    tail = f"{_CHARS}*" if hi is None else _up_to(_CHARS, hi - lo)
    return f"^{_rep(_CHARS, lo)}{tail}$"


def _is_string(schema: dict[str, Any]) -> bool:
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and t == ["string"])


def strict_strings(schema: Any) -> Any:
    """A copy of ``schema`` with every length-bounded, pattern-free string given a control-free pattern."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    bounded = "minLength" in out or "maxLength" in out
    plain = not any(k in out for k in ("pattern", "format", "enum", "const"))
    largest = out.get("maxLength", out.get("minLength", 0))
    if _is_string(out) and bounded and plain and isinstance(largest, int) and largest <= _STRICT_MAX:
        lo = int(out.pop("minLength", 0))
        hi = out.pop("maxLength", None)
        out["pattern"] = length_pattern(lo, None if hi is None else int(hi))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_strings(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_strings(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_strings(out[key])
    return out
