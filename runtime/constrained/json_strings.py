"""Keep length-bounded JSON strings valid JSON under xgrammar.

xgrammar compiles a string with ``minLength``/``maxLength`` (and no ``pattern``) to the character class
``[^"\\\\\\r\\n]{m,n}``, which admits raw control characters (U+0000..U+001F) that JSON forbids inside a
string. ``strict_strings`` rewrites such strings into the same class minus the control characters,
expressed as a ``pattern`` — the same strings xgrammar would allow, except those that are not JSON.
"""

from __future__ import annotations

from typing import Any

_CHARS = r'[^"\\\x00-\x1f]'
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "unevaluatedProperties", "unevaluatedItems", "propertyNames")


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
    if _is_string(out) and bounded and plain:
        lo = int(out.pop("minLength", 0))
        hi = out.pop("maxLength", None)
        out["pattern"] = f"^{_CHARS}{{{lo},{'' if hi is None else int(hi)}}}$"
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
