"""The OpenAI Responses API (``/v1/responses``) through the official ``openai`` client, against a real server
over the default SmolLM2 chat model (greedy): text and message input match /v1/chat/completions, streamed
events parse strictly as the client's types and add up to the whole response, a function tool round-trips,
``previous_response_id`` chains hit the radix cache, and bad requests are 4xx in OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, get_args

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent

from runtime.http.responses_format import EventStream, ResponseHeader, outcome
from runtime.http.responses_store import ResponseStore, StoredResponse
from runtime.request.state import RequestState
from tests.server_harness import ServerProcess, assert_kv_clean

QUESTION = "What is 2+2? Answer with one number."  # SmolLM2 answers it in a few tokens and stops
GREEDY: dict[str, Any] = {"model": "default", "temperature": 0, "max_output_tokens": 24}
WEATHER = {"type": "object", "properties": {"town": {"type": "string", "maxLength": 20}}, "required": ["town"],
           "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Current weather in a town",
                     "parameters": WEATHER}]
# the client's event class of each event type (its union is discriminated by the client, not by pydantic)
EVENT_TYPES: dict[str, Any] = {get_args(cls.model_fields["type"].annotation)[0]: cls
                               for cls in get_args(get_args(ResponseStreamEvent)[0])}


def validated(event: dict[str, Any]) -> Any:
    """``event`` validated (not just constructed, as the client does) as the client's model of its type."""
    return EVENT_TYPES[event["type"]].model_validate(event)


@pytest.fixture(scope="module")
def server(smol_server: ServerProcess) -> Iterator[ServerProcess]:
    yield smol_server
    assert_kv_clean(smol_server.url)  # every response, streamed, chained or abandoned, gave its KV back


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat_text(client: OpenAI, messages: list[dict[str, Any]], max_tokens: int = GREEDY["max_output_tokens"]
              ) -> tuple[str, int]:
    r = client.chat.completions.create(model="default", messages=messages, temperature=0,  # type: ignore[arg-type]
                                       max_tokens=max_tokens)
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error response (the client hands over its content)."""
    assert isinstance(exc.body, dict)
    return exc.body


def raw_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed response as JSON, each checked against its ``event:`` name."""
    events = []
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name
                events.append(event)
    return events


# ---------------------------------------------------------------------- text and messages
@pytest.mark.slow
def test_plain_text_input(client):
    r = client.responses.create(input=QUESTION, **GREEDY)
    assert r.object == "response" and r.status == "completed" and r.error is None
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].status == "completed"
    text, prompt_tokens = chat_text(client, [{"role": "user", "content": QUESTION}])
    assert r.output_text == text and "4" in text  # the same prompt as the chat endpoint renders
    assert r.usage.input_tokens == prompt_tokens and 0 < r.usage.output_tokens < GREEDY["max_output_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.max_output_tokens == GREEDY["max_output_tokens"] and r.temperature == 0


@pytest.mark.slow
def test_message_list_with_instructions(client):
    instructions = "You are a terse assistant."
    items = [{"role": "user", "content": "Name a fruit."},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Apple."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}]
    r = client.responses.create(input=items, instructions=instructions, metadata={"case": "list"}, **GREEDY)
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another one?"}]
    text, prompt_tokens = chat_text(client, messages)
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens
    assert r.instructions == instructions and r.metadata == {"case": "list"}


@pytest.mark.slow
def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.responses.create(input=QUESTION, text={"format": {"type": "json_schema", "name": "sum",
                                                                 "schema": schema}}, **GREEDY)
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"answer"}
    assert r.text.format.type == "json_schema"


@pytest.mark.slow
def test_length_limit_makes_an_incomplete_response(client):
    r = client.responses.create(input="Tell me a long story about a dragon.", model="default", temperature=0,
                                max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete" and r.output_text


# ---------------------------------------------------------------------- streaming
def delta_runs_collapsed(kinds: list[str]) -> list[str]:
    """Event types with each run of consecutive text deltas written once."""
    return [k for i, k in enumerate(kinds)
            if not (k == "response.output_text.delta" and i and kinds[i - 1] == k)]


@pytest.mark.slow
def test_streaming_events(client, server):
    whole = client.responses.create(input=QUESTION, **GREEDY)
    events = list(client.responses.create(input=QUESTION, stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == final.output_text == whole.output_text and deltas
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert client.responses.retrieve(final.id).output_text == deltas  # stored once the stream ended

    # the wire format, strictly: every event validates as the client's own event types
    raw = raw_events(server.url, {"input": QUESTION, **GREEDY})
    for event in raw:
        validated(event)
    Response.model_validate(raw[-1]["response"])
    # the same events in the same order; how many deltas carry the text depends on how the detokenizer's outputs
    # met the stream's writes (several tokens may arrive as one delta), so a run of deltas counts once
    assert delta_runs_collapsed([e["type"] for e in raw]) == delta_runs_collapsed(kinds)
    assert "".join(e["delta"] for e in raw if e["type"] == "response.output_text.delta") == deltas


@pytest.mark.slow
def test_abandoned_stream_frees_its_request(server):
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60,
                      json={"input": "Tell me a long story.", "stream": True, "max_output_tokens": 400}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 12:
                break
    assert_kv_clean(server.url)


# ---------------------------------------------------------------------- tools
@pytest.mark.slow
def test_function_tool_round_trip(client):
    question = "What is the weather in Paris?"
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(input=question, tools=TOOLS, tool_choice=forced, **{**GREEDY,
                                                                                        "max_output_tokens": 64})
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"town"}
    assert first.tools[0].name == "get_weather" and first.tool_choice.name == "get_weather"

    second = client.responses.create(
        previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}], **GREEDY)
    assert [o.type for o in second.output] == ["message"] and second.output_text.strip()
    assert second.previous_response_id == first.id
    # the same tools, so the whole first turn (prompt and call) is a cached prefix of the second
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens

    # the call and its result sent back by hand, without the store, make the same prompt
    by_hand = client.responses.create(
        tools=TOOLS, store=False,
        input=[{"role": "user", "content": question},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}], **GREEDY)
    assert by_hand.output_text == second.output_text
    assert by_hand.usage.input_tokens == second.usage.input_tokens


@pytest.mark.slow
def test_streamed_function_call(client):
    events = list(client.responses.create(input="What is the weather in Lyon?", tools=TOOLS, stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          parallel_tool_calls=False, **{**GREEDY, "max_output_tokens": 64}))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    args = next(e for e in events if e.type == "response.function_call_arguments.done")
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.status == "in_progress"
    final = events[-1].response
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.arguments == args.arguments and call.id == args.item_id and json.loads(call.arguments)["town"]


# ---------------------------------------------------------------------- chaining
@pytest.mark.slow
def test_previous_response_id_chains_through_the_cache(client):
    short = {**GREEDY, "max_output_tokens": 12}
    first = client.responses.create(input="My name is Ada. Say hello to me.", **short)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **short)
    # the second prompt starts with the first prompt and its answer: the radix cache holds all of the first
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    text, prompt_tokens = chat_text(client, [{"role": "user", "content": "My name is Ada. Say hello to me."},
                                             {"role": "assistant", "content": first.output_text},
                                             {"role": "user", "content": "What is my name?"}], 12)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    third = client.responses.create(input="Thanks.", previous_response_id=second.id, **short)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens


@pytest.mark.slow
def test_unknown_previous_response_id_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(input="hi", previous_response_id="resp_nope", **GREEDY)
    assert error_of(err.value)["param"] == "previous_response_id"


@pytest.mark.slow
def test_retrieve_delete_and_store_false(client):
    r = client.responses.create(input=QUESTION, **GREEDY)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(input=QUESTION, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="and?", previous_response_id=unstored.id, **GREEDY)


# ---------------------------------------------------------------------- bad requests
BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "frobnicate": True}, "frobnicate"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10 ** 7}, "max_output_tokens"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_requests_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="default", extra_body=body)
    body = error_of(err.value)
    assert body["param"] == param and body["type"] == "invalid_request_error"
    assert body["message"].startswith(param)


# ---------------------------------------------------------------------- the pure parts, no server
def test_store_is_a_bounded_lru():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}))
    assert store.get("a") is not None  # "a" is now the most recent
    store.put("c", StoredResponse({"id": "c"}))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a")


def test_event_stream_with_reasoning_and_calls_parses_as_the_clients_types():
    """Reasoning, text and a call, as a reasoning parser and a tool parser would hand them over."""
    stream = EventStream(ResponseHeader("resp_1", "m", 0))
    state = RequestState("r", text="...", prompt_tokens=3, completion_tokens=5)
    events = stream.start()
    for delta in ({"reasoning_content": "think"}, {"reasoning_content": "ing"}, {"content": "\n"},
                  {"content": "Hi"}, {"tool_calls": [{"id": "call_1", "function": {"name": "f",
                                                                                    "arguments": "{}"}}]}):
        events += stream.feed(delta)
    closing, final = stream.finish(state, outcome(state))
    events += closing
    parsed = [validated(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "thinking"
    assert final["output"][1]["content"][0]["text"] == "\nHi"  # held-back whitespace joins the text
    assert Response.model_validate(final).output_text == "\nHi"
    assert parsed[-1].type == "response.completed"
