"""Length-bounded JSON strings: the rewritten pattern accepts exactly the lengths the schema allows, and
xgrammar compiles it even for bounds above its regex repetition limit."""

from __future__ import annotations

import json
import re

import pytest

from runtime.constrained.json_strings import length_pattern, strict_strings

BOUNDS = [(0, None), (3, 10), (0, 64), (0, 65), (64, 64), (0, 130), (200, None), (130, 400), (1, 4500)]


@pytest.mark.parametrize(("lo", "hi"), BOUNDS)
def test_pattern_accepts_exactly_the_allowed_lengths(lo, hi):
    rx = re.compile(length_pattern(lo, hi))
    top = hi if hi is not None else lo + 200
    for n in range(top + 3):
        assert bool(rx.fullmatch("é" * n)) == (n >= lo and (hi is None or n <= hi)), n
    assert not rx.fullmatch("a" * lo + "\n"), "control characters are not JSON string content"
    assert not rx.fullmatch('"' * max(lo, 1))


def test_no_repetition_count_above_the_chunk():
    counts = [int(c) for c in re.findall(r"\{(?:\d+,)?(\d+)\}", length_pattern(300, 5000))]
    assert counts and max(counts) <= 64


def test_large_bounds_keep_the_schema_untouched():
    schema = {"type": "string", "minLength": 1000}
    assert strict_strings(schema) == schema
    assert "pattern" in strict_strings({"type": "string", "minLength": 400})


def test_xgrammar_compiles_a_string_longer_than_its_repetition_limit(tiny_model_dir):
    """minLength 200 once failed inside xgrammar (a single ``{200,}`` repetition)."""
    import xgrammar as xgr

    from runtime.constrained.grammar import GrammarBackend
    from runtime.models.folders import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id or 0])
    schema = {"type": "object", "properties": {"b": {"type": "string", "minLength": 200}}, "required": ["b"]}
    compiled = backend.compile_async("json_schema", json.dumps(schema)).result()
    backend.shutdown()
    assert xgr.GrammarMatcher(compiled).accept_string('{"b": "' + "x" * 200 + '"}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"b": "' + "x" * 199 + '"}')
