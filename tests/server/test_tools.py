"""Tool calling on /v1/chat/completions through the official openai client, with a random-weight model:
every call the grammar produces is valid, streamed and whole responses agree, an agent loop stays cached."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

WEATHER = {
    "type": "object",
    "properties": {
        "town": {"type": "string", "maxLength": 16},
        "units": {"enum": ["metric", "imperial"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["town", "units"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "exact": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a town",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Lyon, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


def assert_valid(call, only: str | None = None) -> None:
    name = call.function.name
    assert name in SCHEMAS and (only is None or name == only)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_constrained_calls_are_always_valid(client, choice):
    r = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       n=100, temperature=1.0, max_tokens=200, seed=7, parallel_tool_calls=False)
    only = None if choice == "required" else "add"
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message
        assert len(c.message.tool_calls) == 1
        assert_valid(c.message.tool_calls[0], only)


def test_parallel_calls_are_each_valid(client):
    """With parallel calls the model may add call after call; every complete one is valid (only a call
    cut off by max_tokens is left as text)."""
    r = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       n=20, temperature=1.0, max_tokens=200, seed=5)
    calls = [call for c in r.choices for call in (c.message.tool_calls or [])]
    assert len(calls) >= 20
    for call in calls:
        assert_valid(call)


@pytest.mark.slow
def test_auto_calls_are_valid_once_opened(smol_server):
    """``auto`` leaves text free, but a call the model opens is constrained to the tools' schemas. The real
    model, mid-way through an agent transcript whose earlier turns called the tool, calls it again in some
    samples and writes text in others; every call it makes is valid."""
    weather = {**WEATHER, "properties": {**WEATHER["properties"], "town": {"type": "string", "maxLength": 24}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a town",
                                               "parameters": weather}}]

    def called(i: int, town: str) -> dict:
        args = json.dumps({"town": town, "units": "metric"})
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}]}

    messages = [
        {"role": "user", "content": "What's the weather in Paris?"}, called(1, "Paris"),
        {"role": "tool", "tool_call_id": "c1", "content": "Paris: sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Paris, 21 C."},
        {"role": "user", "content": "And in Rome?"}, called(2, "Rome"),
        {"role": "tool", "tool_call_id": "c2", "content": "Rome: cloudy, 18 C"},
        {"role": "assistant", "content": "It is cloudy in Rome, 18 C."},
        {"role": "user", "content": "And in Berlin?"},
    ]
    c = OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="default", messages=messages, tools=tools, tool_choice="auto", n=32,
                                  temperature=1.0, max_tokens=48, seed=1)
    calls = [call for ch in r.choices for call in (ch.message.tool_calls or [])]
    assert calls, "the model calls the tool in some samples"
    assert any(not ch.message.tool_calls for ch in r.choices), "and answers in text in others (auto)"
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather)


def test_streamed_calls_equal_whole_response(client):
    kw = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
              max_tokens=200, seed=11, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert len(expected) == 1
    parts: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = parts.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    assert [tuple(v) for _, v in sorted(parts.items())] == expected
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == expected
    assert final.choices[0].finish_reason == "tool_calls"


def test_agent_loop_keeps_the_transcript_cached(client):
    history = list(MESSAGES)
    previous_prompt = 0
    for step in range(4):
        r = client.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=120,
                                           parallel_tool_calls=False)
        msg = r.choices[0].message
        assert msg.tool_calls, msg
        if step:
            # everything up to the previous request is served from the cache
            assert r.usage.prompt_tokens_details.cached_tokens >= previous_prompt
        previous_prompt = r.usage.prompt_tokens
        history.append(msg.model_dump(exclude_none=True))
        history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": f"result {step}: 42"})


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools"),
        ([{"type": "function", "function": {"name": "x", "parameters": {"type": "objec"}}}], "required", "tools"),
        ([{"type": "function", "function": {"name": "x", "parameters": "not a schema"}}], "auto", "tools"),
        ([TOOLS[0], TOOLS[0]], "auto", "tools"),
        ([{"type": "retrieval"}], "auto", "tools"),
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
    ],
)
def test_bad_tool_definitions_get_400(tiny_server, tools, choice, param):
    body = {"model": "default", "messages": MESSAGES, "tool_choice": choice, "max_tokens": 8}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(tiny_server.url + "/health").status_code == 200


def test_tools_with_response_format_is_refused(tiny_server):
    body = {"model": "default", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_dir):
    from tests.server_harness import ServerProcess

    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "4096", "--num-threads", "1",
                                                 "--reasoning-parser", "deepseek-r1"]).start()
    yield server
    assert server.stop() == 0


def test_reasoning_content_is_split_out_streaming_too(reasoning_server):
    """With the deepseek-r1 parser the prompt has opened <think>: text before </think> is reasoning. The
    random model never closes it, so everything it writes is reasoning_content."""
    c = OpenAI(base_url=reasoning_server.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="default", messages=MESSAGES, temperature=0, max_tokens=12)
    whole = c.chat.completions.create(**kw)
    msg = whole.choices[0].message.model_dump()
    assert msg["reasoning_content"] and not msg["content"]
    streamed = "".join((getattr(ch.choices[0].delta, "reasoning_content", None) or "")
                       for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == msg["reasoning_content"]
