"""The OpenAI backend: against the server's /v1 API (completion and chat modes), and error handling
against a scripted OpenAI-style server (httpx.MockTransport)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import frontend as sgl
from tests.oracle import WITH_TOP2, dsl_agrees


@pytest.fixture(scope="module")
def v1_url(tiny_server) -> str:
    return tiny_server.url + "/v1"


@pytest.fixture(scope="module")
def completion_backend(v1_url) -> Iterator[sgl.OpenAI]:
    backend = sgl.OpenAI(base_url=v1_url, is_chat_model=False)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def chat_backend(v1_url) -> Iterator[sgl.OpenAI]:
    backend = sgl.OpenAI(base_url=v1_url)
    yield backend
    backend.shutdown()


@sgl.function
def qa(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, ignore_eos=True))
    s += sgl.user("Sure?")
    s += sgl.assistant(sgl.select("sure", SURE))


SURE = ["yes", "no", "not really"]


def test_completion_mode_matches_the_native_api(completion_backend, endpoint, tiny_model_dir) -> None:
    """The same answer and choice as the native API, or a divergence at a float near-tie (tests/oracle.py)."""
    from runtime.models.folders import load_tokenizer

    assert completion_backend.get_chat_template() == endpoint.get_chat_template()  # fetched from the server
    a = qa.run("Why is the sky blue?", backend=completion_backend, temperature=0)
    b = qa.run("Why is the sky blue?", backend=endpoint, temperature=0, **WITH_TOP2)
    assert a.error() is None, a.error()
    assert b.error() is None, b.error()
    tok = load_tokenizer(str(tiny_model_dir))

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    assert a["sure"] in SURE
    if dsl_agrees(b, a, "answer", decode):
        dsl_agrees(b, a, "sure", decode, SURE)  # echoed prompt logprobs score the same tokens
    meta = a.get_meta_info("answer")
    assert meta["completion_tokens"] == 8 and meta["cached_tokens"] is not None
    assert completion_backend.token_usage.prompt_tokens > 0


def test_completion_mode_streaming_and_typed_gen(completion_backend, need_constrained) -> None:
    @sgl.function
    def prog(s):
        s += "Count: " + sgl.gen("n", dtype=int, max_tokens=8) + "\nStory:" + sgl.gen("story", max_tokens=6)

    state = prog.run(backend=completion_backend, stream=True, temperature=0)
    assert "".join(state.text_iter()) == state.text()
    assert isinstance(state["n"], int)


def test_chat_mode(chat_backend) -> None:
    state = qa.run("Why is the sky blue?", backend=chat_backend, temperature=0)
    assert state.error() is None, state.error()
    assert isinstance(state["answer"], str) and state["sure"] in ("yes", "no", "not really")
    assert state.messages()[2] == {"role": "assistant", "content": state["answer"].lstrip()}

    @sgl.function
    def mid_turn(s):
        s += sgl.user("Hi")
        s += sgl.assistant("Well, " + sgl.gen("rest", max_tokens=4))

    err = mid_turn.run(backend=chat_backend).error()
    assert isinstance(err, sgl.FeatureNotSupported) and "assistant_begin" in str(err)


def test_chat_mode_json_schema(chat_backend, need_constrained) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}

    @sgl.function
    def prog(s):
        s += sgl.user("JSON please")
        s += sgl.assistant(sgl.gen("j", json_schema=schema, max_tokens=32))

    state = prog.run(backend=chat_backend, temperature=0)
    if state.get_meta_info("j")["finish_reason"] == "length":
        pytest.skip("the random model used up max_tokens inside the JSON")
    assert isinstance(json.loads(state["j"])["ok"], bool)


# ---------------------------------------------------------------------------- scripted server
def scripted(handler: Any) -> sgl.OpenAI:
    client = httpx.Client(transport=httpx.MockTransport(handler))
    return sgl.OpenAI("m", base_url="http://fake/v1", is_chat_model=False, chat_template="chatml",
                      http_client=client, max_retries=0)


def completion(text: str, **extra: Any) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": "stop", **extra}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


def test_rejected_features_are_named() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if "regex" in body:
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument: regex"}})
        return httpx.Response(200, json=completion("fine"))

    backend = scripted(handler)

    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", max_tokens=2) + sgl.gen("y", regex="[0-9]+")

    state = prog.run(backend=backend)
    assert state["x"] == "fine"
    err = state.error()
    assert isinstance(err, sgl.FeatureNotSupported) and "regex" in str(err) and "Unrecognized" in str(err)

    @sgl.function
    def uncond(s):
        s += "a" + sgl.select("c", ["x", "y"], choices_method=sgl.unconditional_likelihood_normalized)

    assert isinstance(uncond.run(backend=backend).error(), sgl.FeatureNotSupported)


def test_select_falls_back_to_first_token_logprobs() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("echo"):
            return httpx.Response(400, json={"error": {"message": "echo is not supported"}})
        top = [{" blue": -0.1, " red": -2.0, " green": -3.0}]
        return httpx.Response(200, json=completion(" blue", logprobs={"tokens": [" blue"], "token_logprobs": [-0.1],
                                                                       "top_logprobs": top, "text_offset": [0]}))

    @sgl.function
    def prog(s):
        s += "The sky is" + sgl.select("c", [" red", " blue", " purple"])

    state = prog.run(backend=scripted(handler))
    assert state["c"] == " blue"
    assert state.get_meta_info("c")["first_token_scores"][2] == float("-inf")


def test_server_without_logprobs_is_a_clear_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("echo"):
            return httpx.Response(400, json={"error": {"message": "no echo"}})
        return httpx.Response(200, json=completion("x"))

    @sgl.function
    def prog(s):
        s += "q" + sgl.select("c", ["a", "b"])

    err = prog.run(backend=scripted(handler)).error()
    assert isinstance(err, sgl.FeatureNotSupported) and "logprobs" in str(err)
