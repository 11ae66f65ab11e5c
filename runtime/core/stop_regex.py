"""Regular-expression stop conditions (SGLang's ``stop_regex``): checking, trimming, and streaming hold-back.

A pattern stops a request at its first non-empty match in the decoded output (an empty match would stop a
request before it says anything, which no caller means). Matching uses Python's ``re``. Three consumers:

* the scheduler (``scheduler/stop.py``) asks whether the output's tail now holds a match; how much tail it
  must decode comes from ``tail_chars``: the longest text a pattern can match, or ``None`` (decode it all)
  for unbounded patterns and for anchors and look-arounds, whose meaning depends on the text before a window;
* the detokenizer trims the final text at the match (``first_match``);
* while streaming, the detokenizer holds back text from which a match could still begin
  (``hold_from``), so a client never receives text past a stop. Partial matching needs the ``regex``
  package (a dependency of ``transformers``); a pattern it cannot compile holds back everything unreleased.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

MAX_PATTERNS = 32
MAX_PATTERN_BYTES = 256
UNBOUNDED = 1 << 30

try:  # Python 3.11 moved the parser; its node codes are the stable ``re`` internals
    import re._constants as _sre_constants
    import re._parser as _sre_parse
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _sre_constants
    import sre_parse as _sre_parse


def check_patterns(patterns: list[str]) -> None:
    """Raises ValueError naming ``stop_regex`` for a list the server cannot use."""
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"stop_regex: at most {MAX_PATTERNS} patterns, got {len(patterns)}")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError("stop_regex: must be a non-empty string or a list of non-empty strings")
        if len(p.encode("utf-8")) > MAX_PATTERN_BYTES:
            raise ValueError(f"stop_regex: a pattern is limited to {MAX_PATTERN_BYTES} bytes")
        try:
            compiled(p)
        except (re.error, RecursionError, OverflowError) as exc:
            raise ValueError(f"stop_regex: {p!r} is not a valid regular expression: {exc}") from None


@lru_cache(maxsize=1024)
def compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def first_match(patterns: list[str], text: str, pos: int = 0) -> tuple[str, int, int] | None:
    """(pattern, start, end) of the earliest non-empty match of any pattern at or after ``pos``."""
    best: tuple[str, int, int] | None = None
    for p in patterns:
        for m in compiled(p).finditer(text, pos):
            if m.end() > m.start():
                if best is None or m.start() < best[1]:
                    best = (p, m.start(), m.end())
                break
    return best


def match_of(pattern: str, text: str) -> tuple[int, int] | None:
    """(start, end) of the first non-empty match of one pattern."""
    found = first_match([pattern], text)
    return (found[1], found[2]) if found else None


# ---------------------------------------------------------------------- how much tail to decode
_ONE_CHAR = {"LITERAL", "NOT_LITERAL", "IN", "ANY", "CATEGORY", "RANGE", "RANGE_UNI_IGNORE"}


def _max_len(nodes: Any) -> int:
    """The most characters a parsed (sub)pattern can match; UNBOUNDED when it has no limit, or when the
    match depends on text before it (anchors, look-arounds, back-references)."""
    total = 0
    for op, av in nodes:
        name = str(op)
        if name in _ONE_CHAR:
            total += 1
        elif name == "SUBPATTERN":
            total += _max_len(av[-1])
        elif name == "BRANCH":
            total += max(_max_len(branch) for branch in av[1])
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, inner = av
            if high == _sre_constants.MAXREPEAT:
                return UNBOUNDED
            total += high * _max_len(inner)
        elif name == "ATOMIC_GROUP":
            total += _max_len(av)
        else:  # AT (^, $, \b), ASSERT, ASSERT_NOT, GROUPREF, GROUPREF_EXISTS, ...
            return UNBOUNDED
        if total >= UNBOUNDED:
            return UNBOUNDED
    return total


@lru_cache(maxsize=1024)
def tail_chars(pattern: str) -> int | None:
    """The longest text the pattern can match, or None when the whole output must be searched."""
    try:
        n = _max_len(_sre_parse.parse(pattern))
    except Exception:  # the pattern compiled with ``re``, so this is only a parser we do not know
        return None
    return None if n >= UNBOUNDED else n


# ---------------------------------------------------------------------- streaming hold-back
@lru_cache(maxsize=1024)
def _partial_compiled(pattern: str) -> Any:
    try:
        import regex
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    try:
        return regex.compile(pattern)
    except Exception:
        return None


def hold_from(patterns: list[str], text: str, pos: int) -> int:
    """Where ``text`` must stop being released: the earliest start (>= ``pos``) of a match or of a prefix
    of a match that more text could complete; ``len(text)`` when nothing can match.

    ``pos`` is the end of the text already released: a position before it was not the start of a
    possible match then, and appending text cannot make it one."""
    hold = len(text)
    for p in patterns:
        rx = _partial_compiled(p)
        if rx is None:
            return pos
        for m in rx.finditer(text, pos, partial=True):
            if m.partial or m.end() > m.start():
                hold = min(hold, m.start())
                break
    return max(hold, pos)
