"""Every bad input to the OpenAI endpoints gets a 4xx in OpenAI's error shape, and the server stays healthy."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"

# (name, path, body: a dict sent as JSON or raw bytes, status, the field the error names or None)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("malformed JSON", COMP, b'{"prompt": "a",', 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("body not an object", CHAT, b"[1, 2]", 400, None),
    ("missing prompt", COMP, {"max_tokens": 4}, 400, "prompt"),
    ("empty prompt list", COMP, {"prompt": []}, 400, "prompt"),
    ("empty prompt text", COMP, {"prompt": ""}, 400, "prompt"),
    ("mixed prompt list", COMP, {"prompt": [1, "a"]}, 400, "prompt"),
    ("token id outside the vocabulary", COMP, {"prompt": [10**9]}, 400, "prompt"),
    ("max_tokens as a string", COMP, {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("negative max_tokens", COMP, {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("stream as a string", COMP, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("n as a boolean", COMP, {"prompt": "a", "n": True}, 400, "n"),
    ("stop of numbers", COMP, {"prompt": "a", "stop": [1]}, 400, "stop"),
    ("temperature too high", COMP, {"prompt": "a", "temperature": 2.5}, 400, "temperature"),
    ("negative temperature", CHAT, {"messages": USER, "temperature": -0.1}, 400, "temperature"),
    ("top_p over 1", COMP, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("n of 0", COMP, {"prompt": "a", "n": 0}, 400, "n"),
    ("n too large", CHAT, {"messages": USER, "n": 100000}, 400, "n"),
    ("logprobs over 5", COMP, {"prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("top_logprobs over 20", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("presence_penalty over 2", COMP, {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty under -2", CHAT, {"messages": USER, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("logit_bias key not a token id", COMP, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias out of range", COMP, {"prompt": "a", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("prompt + max_tokens over the context", COMP, {"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
    ("chat over the context", CHAT, {"messages": USER, "max_tokens": 5000}, 400, "max_tokens"),
    ("max_completion_tokens over the context", CHAT, {"messages": USER, "max_completion_tokens": 4096}, 400,
     "max_completion_tokens"),
    # the prompt alone fills the context: lowering max_tokens cannot help, so the error names the prompt
    ("prompt alone over the context", COMP, {"prompt": [5] * 5000, "max_tokens": 1}, 400, "prompt"),
    ("suffix", COMP, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("best_of", COMP, {"prompt": "a", "best_of": 3}, 400, "best_of"),
    ("unknown model (completions)", COMP, {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("unknown model (chat)", CHAT, {"model": "gpt-4", "messages": USER}, 404, "model"),
    ("missing messages", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("missing role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("user message without content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("content of a wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content"),
    ("unknown response_format", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("json_schema format without a schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
     400, "response_format.json_schema.schema"),
    ("invalid JSON schema", CHAT, {"messages": USER, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("invalid regex, streaming", COMP, {"prompt": "a", "regex": "([", "stream": True}, 400, "regex"),
    ("bad input, streaming", CHAT, {"messages": USER, "stream": True, "temperature": 9}, 400, "temperature"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(tiny_server: ServerProcess, path: str, body: Any, status: int, param: str | None) -> None:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": {"max_tokens": 4, **body}}
    r = httpx.post(tiny_server.url + path, headers={"content-type": "application/json"}, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    if param is not None:
        assert param.split(".")[0] in error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"


def test_unknown_model_card(tiny_server: ServerProcess) -> None:
    r = httpx.get(tiny_server.url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_client_exceptions(tiny_server: ServerProcess) -> None:
    client: Any = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=USER)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="default", prompt="a", temperature=7)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt="a", max_tokens=10**6, stream=True)


def test_server_healthy_after_bad_inputs(tiny_server: ServerProcess) -> None:
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    client: Any = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    resp = client.chat.completions.create(model="default", messages=USER, max_tokens=4)
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.usage is not None
    info = httpx.get(tiny_server.url + "/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["kv"]["private"] == 0
