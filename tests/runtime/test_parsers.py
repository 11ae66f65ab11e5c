"""Tool-call formats, reasoning splitting, and the assistant-message assembly (streamed == whole)."""

from __future__ import annotations

import json

import pytest

from runtime.core.messages import FinishReason
from runtime.http.chat_render import tool_setup
from runtime.http.openai_format import chat_delta, chat_finish_reason, chat_message
from runtime.parsers.output import Parsed, ReasoningParser, ReasoningThenCalls, ToolCallParser, parse_whole
from runtime.parsers.streams import ReasoningStream, ToolCallStream
from runtime.parsers.tool_formats import HermesFormat, Llama3JsonFormat, ToolCall, check_tools, make_tool_format
from runtime.request.state import RequestState

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"town": {"type": "string"}}, "required": ["town"]}}}]


def feed_in_pieces(stream, text: str, size: int):
    outs = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
    return outs, stream.finish()


HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"town": "Lyon"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Nice, \\"FR\\""}}\n</tool_call>')


def test_hermes_parse_keeps_argument_text_exactly():
    content, calls = HermesFormat().parse(HERMES_TEXT)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"town": "Lyon"}'), ("get_weather", '{"town": "Nice, \\"FR\\""}')]
    assert HermesFormat().render_call(calls[0]) in HERMES_TEXT


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_tool_stream_equals_whole_parse(size):
    stream = ToolCallStream(HermesFormat())
    outs, (tail_text, tail_calls) = feed_in_pieces(stream, HERMES_TEXT, size)
    text = "".join(o[0] for o in outs) + tail_text
    calls = [c for o in outs for c in o[1]] + tail_calls
    content, whole = HermesFormat().parse(HERMES_TEXT)
    assert text.strip() == content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]


def test_broken_call_stays_content():
    text = "<tool_call>\n{not json}\n</tool_call> and more"
    content, calls = HermesFormat().parse(text)
    assert calls == [] and "not json" in content
    stream = ToolCallStream(HermesFormat())
    out, calls = stream.feed(text)
    rest, more = stream.finish()
    assert calls == more == [] and "not json" in out + rest


def test_llama3_json_format():
    fmt = Llama3JsonFormat()
    text = '{"name": "get_weather", "parameters": {"town": "Oslo"}}; {"name": "get_weather", "parameters": {}}'
    content, calls = fmt.parse(text)
    assert content == "" and [c.arguments for c in calls] == ['{"town": "Oslo"}', "{}"]
    assert fmt.parse("Just text, no call.") == ("Just text, no call.", [])
    assert make_tool_format(None, "{% if ipython %}{% endif %}").name == "llama3"
    assert make_tool_format(None, "<tool_call>").name == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        make_tool_format("xml", None)


def test_structural_tags_are_valid_xgrammar():
    from runtime.constrained.grammar import validate_grammar

    specs = check_tools(TOOLS)
    for fmt in (HermesFormat(), Llama3JsonFormat()):
        for choice in ("auto", "required", "get_weather"):
            validate_grammar("structural_tag", fmt.structural_tag(specs, choice))


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_reasoning_stream(size):
    text = "<think>\nstep one\nstep two\n</think>\n\nThe answer is 4."
    outs, tail = feed_in_pieces(ReasoningStream(), text, size)
    reasoning = "".join(o[0] for o in outs) + tail[0]
    content = "".join(o[1] for o in outs) + tail[1]
    assert reasoning.strip() == "step one\nstep two"
    assert content == "The answer is 4."
    # a model that does not think: everything is content
    outs, tail = feed_in_pieces(ReasoningStream(), "No thinking here.", size)
    assert "".join(o[1] for o in outs) + tail[1] == "No thinking here."
    # the prompt opened <think> already (deepseek-r1 style)
    outs, tail = feed_in_pieces(ReasoningStream(implied_start=True), "hmm</think>done", size)
    assert ("".join(o[0] for o in outs) + tail[0], "".join(o[1] for o in outs) + tail[1]) == ("hmm", "done")


def hermes_thinking_parser() -> ReasoningThenCalls:
    return ReasoningThenCalls(ReasoningParser({"implied_start": False}), ToolCallParser(HermesFormat()))


def test_output_parser_whole_and_streamed_agree():
    text = "<think>plan</think>\n" + HERMES_TEXT
    parsed = parse_whole(hermes_thinking_parser(), text)
    msg = chat_message(parsed, reasoning_field=True)
    assert msg["reasoning_content"] == "plan" and msg["content"] == "Let me check."
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"town": "Lyon"}',
                                                                        '{"town": "Nice, \\"FR\\""}']
    streamed = hermes_thinking_parser()
    pieces = [streamed.feed(text[i : i + 4]) for i in range(0, len(text), 4)] + [streamed.finish()]
    deltas, calls_sent = [], 0
    for piece in pieces:
        deltas.append(chat_delta(piece, calls_sent))
        calls_sent += len(piece.calls)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"]["arguments"] for c in calls] == [c["function"]["arguments"] for c in msg["tool_calls"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me check."
    assert [(c.name, c.arguments) for c in sum(pieces, Parsed()).calls] == [(c.name, c.arguments)
                                                                           for c in parsed.calls]
    # a choice that stopped after calling tools finished for "tool_calls"; one cut by the limit did not
    state = RequestState("r")
    state.finished = FinishReason("stop")
    assert chat_finish_reason(state, len(parsed.calls)) == "tool_calls"
    assert chat_finish_reason(state, 0) == "stop"
    state.finished = FinishReason("length")
    assert chat_finish_reason(state, len(parsed.calls)) == "length"


def test_tool_setup_without_template_support_renders_history_as_text():
    fmt = HermesFormat()
    call = ToolCall("get_weather", '{"town": "Lyon"}', "call_1")
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call.to_openai()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    setup = tool_setup(messages, TOOLS, "auto", fmt, chat_template="{{ messages }}")
    assert setup.messages[0]["role"] == "system" and "<tools>" in setup.messages[0]["content"]
    assert setup.messages[2]["content"] == fmt.render_call(call)
    assert setup.messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert json.loads(setup.structural_tag or "{}")["format"]["type"] == "triggered_tags"
    # a template that knows tools gets them as-is, with arguments as objects
    setup = tool_setup(messages, TOOLS, "required", fmt, chat_template="{% for t in tools %}{% endfor %}")
    assert setup.template_kwargs["tools"] == TOOLS
    assert setup.messages[1]["tool_calls"][0]["function"]["arguments"] == {"town": "Lyon"}
    assert json.loads(setup.structural_tag or "{}")["format"]["type"] == "tags_with_separator"
