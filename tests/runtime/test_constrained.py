"""Grammar-constrained decoding: a random-weight model (its free output is noise) always produces valid
JSON / regex / EBNF output under a constraint, in any batch mix, with chunking, n > 1 and retraction."""

from __future__ import annotations

import json
import re

import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "vaccinated": {"type": "boolean"},
    },
    "required": ["name", "kind", "age"],
    "additionalProperties": False,
}
REGEX = r"(\+1 )?\(\d{3}\) \d{3}-\d{4}"
EBNF = """
root ::= greeting " " name "!"
greeting ::= "hello" | "hi" | "good morning"
name ::= [A-Z] [a-z]{1,8}
"""
PROMPT = list(range(300, 330))


def valid_json(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    import jsonschema

    try:
        jsonschema.validate(obj, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def valid_regex(text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None


def valid_ebnf(text: str) -> bool:
    return re.fullmatch(r"(hello|hi|good morning) [A-Z][a-z]{1,8}!", text) is not None


CASES = [
    ("json_schema", json.dumps(SCHEMA), valid_json),
    ("regex", REGEX, valid_regex),
    ("ebnf", EBNF, valid_ebnf),
]


@pytest.mark.parametrize(("kind", "grammar", "check"), CASES, ids=[c[0] for c in CASES])
def test_200_samples_all_valid_and_free_output_is_not(tiny_engine, kind, grammar, check):
    engine = tiny_engine(max_total_tokens=65536)
    params = {"n": 200, "temperature": 1.0, "max_new_tokens": 160, "seed": 11}
    constrained = engine.generate(input_ids=PROMPT, sampling_params={**params, kind: grammar})
    bad = [o["text"] for o in constrained if not check(o["text"])]
    assert not bad, bad[:3]
    free = engine.generate(input_ids=PROMPT, sampling_params={**params, "n": 20, "max_new_tokens": 40})
    assert not any(check(o["text"]) for o in free), "the model alone does not produce this format"


def test_mixed_batch_chunked_prefill_and_retraction(tiny_engine):
    """Constrained and free requests share steps; long prompts are chunked; the pool forces retraction."""
    engine = tiny_engine(max_total_tokens=420, chunked_prefill_size=16, schedule_conservativeness=0.01)
    prompts = [list(range(1000 + 40 * i, 1000 + 40 * i + 60)) for i in range(8)]
    params = []
    for i in range(8):
        p = {"temperature": 1.0, "seed": i, "max_new_tokens": 96}
        if i % 3 == 0:
            p["json_schema"] = json.dumps(SCHEMA)
        elif i % 3 == 1:
            p["regex"] = REGEX
        params.append(p)
    # Grammars compile on a background thread and a request waits for its own: compiled first, the mixed batch's
    # requests are all admissible on arrival, so its schedule (and the retraction it forces) does not depend on
    # how fast the compile thread ran on a loaded machine.
    engine.generate(input_ids=[[7, 8, 9], [7, 8, 10]],
                    sampling_params=[{"max_new_tokens": 1, "json_schema": json.dumps(SCHEMA)},
                                     {"max_new_tokens": 1, "regex": REGEX}])
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.server_info()["scheduler"]["retractions"] > 0
    for i, o in enumerate(outs):
        if i % 3 == 0:
            assert valid_json(o["text"]), o["text"]
        elif i % 3 == 1:
            assert valid_regex(o["text"]), o["text"]


def test_grammar_output_is_the_same_with_cache_on_and_off(tiny_engine):
    params = {"temperature": 0.9, "seed": 3, "max_new_tokens": 96, "json_schema": json.dumps(SCHEMA)}
    a = tiny_engine().generate(input_ids=[PROMPT, PROMPT[:20]], sampling_params=params)
    b = tiny_engine(disable_radix_cache=True).generate(input_ids=[PROMPT, PROMPT[:20]], sampling_params=params)
    assert [o["text"] for o in a] == [o["text"] for o in b]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("json_schema", "{not json"),
        ("json_schema", json.dumps({"type": "objec"})),
        ("regex", "[a-"),
        ("ebnf", 'root ::= "a" | '),
    ],
)
def test_invalid_grammar_raises_with_the_engine_message(tiny_engine, field, value):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=f"^{field}: "):
        engine.generate(input_ids=PROMPT, sampling_params={field: value, "max_new_tokens": 4})
    assert engine.server_info()["num_waiting_reqs"] == 0


def test_compiled_grammars_are_cached(tiny_engine):
    """A grammar's second use compiles nothing: the same compiled object serves both requests."""
    engine = tiny_engine()
    schema = json.dumps({**SCHEMA, "title": "cache-probe"})
    params = {"json_schema": schema, "max_new_tokens": 1}
    engine.generate(input_ids=PROMPT, sampling_params=params)
    backend = engine.inspect(lambda s: s.grammars.backend)
    assert (backend.compiles, backend.cache_hits) == (1, 0)
    compiled = backend.compile_async("json_schema", schema).result()
    engine.generate(input_ids=PROMPT[::-1], sampling_params=params)
    assert (backend.compiles, backend.cache_hits) == (1, 2)
    assert backend.compile_async("json_schema", schema).result() is compiled
    # a different grammar text is compiled on its own
    engine.generate(input_ids=PROMPT, sampling_params={**params, "json_schema": json.dumps(SCHEMA)})
    assert (backend.compiles, backend.cache_hits) == (2, 3)
