"""The DSL against a real server over the native API (tiny random model)."""

from __future__ import annotations

import json
import re

import pytest

import frontend as sgl
from frontend.run import shared_prefix

LONG_PREFIX = ("You are a careful assistant. Read the notes below and continue them.\n"
               + "".join(f"Note {i}: the value of item {i} is {i * 7} units.\n" for i in range(12)))


@pytest.mark.parametrize("choices", [
    ["yes", "no"], ["Paris", "Paris, France", "Rome"], [" yes", " no", " maybe later"], ["été", "hiver", "中文"],
    ["only"], ["A", "B", "C", "D"],
])
@pytest.mark.parametrize("prompt", ["The answer is ", "Question: is the sky blue?\nAnswer:", "x"])
def test_select_returns_one_of_the_choices(endpoint, choices, prompt) -> None:
    @sgl.function
    def prog(s):
        s += prompt + sgl.select("pick", choices) + "."

    state = prog.run(backend=endpoint)
    assert state.error() is None
    assert state["pick"] in choices
    assert state.text() == prompt + state["pick"] + "."
    meta = state.get_meta_info("pick")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == len(choices) and choices[scores.index(max(scores))] == state["pick"]


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_select_methods(endpoint, method) -> None:
    @sgl.function
    def prog(s):
        s += sgl.user("Pick a colour")
        s += sgl.assistant(sgl.select("colour", ["red", "green", "dark blue"], choices_method=method))

    state = prog.run(backend=endpoint)
    assert state["colour"] in ("red", "green", "dark blue")
    assert state.messages()[-1] == {"role": "assistant", "content": state["colour"]}


def test_select_is_greedy_only(endpoint) -> None:
    @sgl.function
    def prog(s):
        s += "x" + sgl.select("c", ["a", "b"], temperature=0.7)

    state = prog.run(backend=endpoint)
    assert isinstance(state.error(), sgl.FeatureNotSupported)


def test_gen_meta_info_and_server_errors(endpoint) -> None:
    @sgl.function
    def prog(s, t):
        s += "Hello" + sgl.gen("x", max_tokens=5, temperature=t, ignore_eos=True)

    state = prog.run(0, backend=endpoint)
    meta = state.get_meta_info("x")
    assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] >= 1 and "cached_tokens" in meta
    bad = prog.run(-1, backend=endpoint)  # an out-of-range temperature: the server's 400 becomes the error
    assert isinstance(bad.error(), sgl.BackendError) and "temperature" in str(bad.error())
    with pytest.raises(RuntimeError):
        bad["x"]


def test_fork_branches_hit_the_shared_prefix(endpoint) -> None:
    @sgl.function
    def forked(s, n):
        s += LONG_PREFIX
        forks = s.fork(n)
        for i, f in enumerate(forks):
            f += f"Note {12 + i}:" + sgl.gen("note", max_tokens=4, ignore_eos=True)
        forks.join()
        return forks

    assert endpoint.flush_cache()
    state = forked.run(4, backend=endpoint, temperature=0)
    prefix_tokens = endpoint.cache_prefix(LONG_PREFIX)["prompt_tokens"]
    assert len(state["note"]) == 4
    for branch in state.ret_value:
        meta = branch.get_meta_info("note")
        assert meta["cached_tokens"] >= prefix_tokens - 1, (meta, prefix_tokens)


QUESTIONS = [f"What is {i} times {i + 3}?" for i in range(8)]


@sgl.function
def fewshot(s, question):
    s += LONG_PREFIX + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=4, stop="\n")


def test_run_batch_threads_progress_and_prefix_cache(endpoint, capsys) -> None:
    assert endpoint.flush_cache()
    batch = [{"question": q} for q in QUESTIONS]
    prefix = shared_prefix(fewshot, endpoint, batch, sgl.ir.program_defaults())
    assert prefix.startswith(LONG_PREFIX) and prefix.endswith("What is")
    meter = sgl.CacheMeter(endpoint)
    states = fewshot.run_batch(batch, backend=endpoint, temperature=0, num_threads=4, progress_bar=True)
    assert "8/8" in capsys.readouterr().err
    prefix_tokens = endpoint.cache_prefix(prefix)["prompt_tokens"]
    for state, q in zip(states, QUESTIONS):
        assert state.text().startswith(LONG_PREFIX + "Question: " + q)
        assert state.get_meta_info("answer")["cached_tokens"] >= prefix_tokens - 1
    assert meter.hit_rate() is not None and meter.hit_rate() > 0.6


def test_streaming_text_iter(endpoint) -> None:
    @sgl.function
    def prog(s):
        s += sgl.user("Tell me a story")
        s += sgl.assistant(sgl.gen("story", max_tokens=48, ignore_eos=True))

    state = prog.run(backend=endpoint, stream=True, temperature=0)
    chunks = list(state.text_iter("story"))
    # Outputs that arrive while the reader is busy merge into one frame, so the count of chunks depends on
    # timing; over 48 decode steps a reader that keeps up at all sees more than one.
    assert len(chunks) >= 2 and "".join(chunks) == state["story"]
    state2 = prog.run(backend=endpoint, stream=True, temperature=0)
    assert "".join(state2.text_iter()) == state2.text()
    assert state2["story"] == state["story"]
    assert prog.run(backend=endpoint, temperature=0)["story"] == state["story"]  # same as non-streaming


# ---------------------------------------------------------------------------- constrained decoding
@pytest.mark.parametrize("dtype", [int, float, bool, str])
def test_typed_gen_returns_the_type(endpoint, need_constrained, dtype) -> None:
    @sgl.function
    def prog(s):
        s += sgl.user("Give me a value")
        s += sgl.assistant("Value: " + sgl.gen("v", dtype=dtype, max_tokens=16))

    for temperature in (0.0, 1.0):
        state = prog.run(backend=endpoint, temperature=temperature)
        assert state.error() is None, state.error()
        assert type(state["v"]) is dtype


def test_gen_int_and_regex(endpoint, need_constrained) -> None:
    @sgl.function
    def prog(s):
        s += "Code: " + sgl.gen("code", regex=r"(cat|dog)-[0-9]{2}", max_tokens=12)
        s += " Count: " + sgl.gen_int("count", max_tokens=8)

    state = prog.run(backend=endpoint, temperature=0)
    assert re.fullmatch(r"(cat|dog)-[0-9]{2}", state["code"])
    assert isinstance(state["count"], int)


def test_gen_json_schema(endpoint, need_constrained) -> None:
    """The output is one complete JSON value that matches the schema, ended by the grammar, not cut."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "ok": {"type": "boolean"}}, "required": ["name", "ok"],
              "additionalProperties": False}
    # Every token the grammar allows adds at least one byte, and the longest valid output is
    # {"name":"<8 chars of up to 4 bytes>","ok":false}: 54 bytes, then the stop token. 128 is plenty, so a
    # "length" finish can only mean the grammar let the output run on.
    max_tokens = 128

    @sgl.function
    def prog(s):
        s += sgl.user("Describe yourself as JSON")
        s += sgl.assistant(sgl.gen("json", json_schema=schema, max_tokens=max_tokens))

    state = prog.run(backend=endpoint, temperature=0)
    assert state.error() is None, state.error()
    meta = state.get_meta_info("json")
    assert meta["finish_reason"]["type"] == "stop", meta
    assert meta["completion_tokens"] < max_tokens
    jsonschema.validate(json.loads(state["json"]), schema)
