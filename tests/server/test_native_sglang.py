"""SGLang parity of the native API: what SGLang's clients send to /generate and read back (fields at their
defaults, absent features refused by name, stop_regex, stream_interval, streamed logprobs), and the
/server_info and /model_info spellings. SGLang's own frontend against the server: test_sglang_client.py."""

from __future__ import annotations

import math
import re

import httpx
import pytest

from tests.server.test_native import post, sse_frames


def test_server_info_and_model_info_beside_the_get_forms(tiny_server):
    model = httpx.get(tiny_server.url + "/model_info", timeout=30)
    assert model.status_code == 200 and model.json() == httpx.get(tiny_server.url + "/get_model_info").json()
    server = httpx.get(tiny_server.url + "/server_info", timeout=30)
    assert server.status_code == 200
    assert set(server.json()) == set(httpx.get(tiny_server.url + "/get_server_info", timeout=30).json())


# What SGLang's clients may send when the caller set nothing: every sampling field, and top-level fields of
# features this server does not have, at their defaults (null, false, empty, a null per prompt).
SGLANG_DEFAULT_SAMPLING = {
    "stop": [], "stop_token_ids": [], "stop_regex": [], "top_k": 1 << 30, "min_p": 0.0, "n": 1, "beam_width": None,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "stream_interval": None, "logit_bias": None, "sampling_seed": None, "custom_params": None, "watermark": None,
    "frequency_penalty": None, "presence_penalty": None, "repetition_penalty": None, "min_new_tokens": None,
}
SGLANG_DEFAULT_TOP_LEVEL = {
    "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None, "lora_path": None,
    "custom_logit_processor": None, "return_hidden_states": False, "session_params": None,
    "token_ids_logprob": None, "bootstrap_host": None, "bootstrap_room": None, "data_parallel_rank": None,
    "return_routed_experts": False, "routed_experts_start_len": 0, "modalities": None, "log_metrics": True,
    "custom_labels": None, "routing_key": None, "conversation_id": None, "background": False,
    "return_entropy": False, "watermark": None, "return_text_in_logprobs": False,
}


def test_sglang_defaults_are_accepted(tiny_server):
    r = post(tiny_server, "/generate", {
        "text": "Hello world", "sampling_params": {"max_new_tokens": 3, "temperature": 0, **SGLANG_DEFAULT_SAMPLING},
        **SGLANG_DEFAULT_TOP_LEVEL, "return_prompt_token_ids": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 3 and len(out["prompt_token_ids"]) == out["meta_info"]["prompt_tokens"]
    batch = post(tiny_server, "/generate", {"text": ["a b", "c d"], "lora_path": [None, None],
                                            "sampling_params": {"max_new_tokens": 1}})
    assert batch.status_code == 200 and len(batch.json()) == 2


@pytest.mark.parametrize(("field", "value"), [
    ("image_data", "https://example.com/cat.png"), ("lora_path", "my-adapter"), ("input_embeds", [[0.5, 0.5]]),
    ("custom_logit_processor", '{"callable": "x"}'), ("return_hidden_states", True), ("session_params", {"id": "s"}),
    ("token_ids_logprob", [1, 2]), ("data_parallel_rank", 3), ("lora_path", [None, "my-adapter"]),
])
def test_absent_features_are_refused_by_name(tiny_server, field, value):
    text = ["a", "b"] if isinstance(value, list) and field == "lora_path" else "a"
    r = post(tiny_server, "/generate", {"text": text, field: value, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(("field", "value"), [("beam_width", 2), ("watermark", {"enabled": True}),
                                              ("choice", ["a", "b"]), ("stop_regex", "[unclosed")])
def test_absent_or_bad_sampling_fields_are_refused_by_name(tiny_server, field, value):
    r = post(tiny_server, "/generate", {"text": "a", "sampling_params": {field: value}})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_streamed_logprobs_are_sent_once_with_a_running_count(tiny_server):
    # 48 tokens: the stream sends the request's state each time its reader wakes, so outputs that arrive while a
    # busy host keeps the reader waiting merge into one frame; with 10 a loaded CI host once saw a single frame
    body = {"text": "Counting: one two three", "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    full = post(tiny_server, "/generate", body).json()["meta_info"]
    assert full["output_token_logprobs_length"] == len(full["output_token_logprobs"]) == 48
    with httpx.stream("POST", tiny_server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        frames = sse_frames(r)[:-1]
    assert len(frames) > 1
    got, tops = [], []
    for f in frames:
        meta = f["meta_info"]
        got += meta["output_token_logprobs"]
        tops += meta["output_top_logprobs"]
        # what SGLang's frontend checks (sglang.test.test_programs.test_stream_logprobs)
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == len(got)
        assert len(f["output_ids"]) == meta["completion_tokens"]  # text and ids stay cumulative
    assert [e[1] for e in got] == [e[1] for e in full["output_token_logprobs"]] == frames[-1]["output_ids"]
    assert all(math.isclose(a[0], b[0], abs_tol=1e-4) for a, b in zip(got, full["output_token_logprobs"]))
    assert len(tops) == 48 and all(len(t) == 2 for t in tops)


def test_stream_interval_thins_the_frames(tiny_server):
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True, "stream_interval": 4}}
    with httpx.stream("POST", tiny_server.url + "/generate", json=body, timeout=60) as r:
        frames = sse_frames(r)[:-1]
    counts = [f["meta_info"]["completion_tokens"] for f in frames]
    assert counts[-1] == 13 and len(frames) <= 5, counts
    assert all(b - a >= 4 for a, b in zip(counts, counts[1:-1])), counts  # only the last may come sooner


def test_stop_regex_over_http(tiny_server):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    base = post(tiny_server, "/generate", {"text": "Once upon a time", "sampling_params": params}).json()["text"]
    pattern = re.escape(base[8:10]) + ".?" + re.escape(base[11])  # a match that starts mid-output
    m = re.search(pattern, base)
    assert m is not None
    body = {"text": "Once upon a time", "sampling_params": {**params, "stop_regex": [pattern]}}
    out = post(tiny_server, "/generate", body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"] == base[: m.start()]
    with httpx.stream("POST", tiny_server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        texts = [f["text"] for f in sse_frames(r)[:-1]]
    assert texts[-1] == out["text"] and all(len(t) <= m.start() for t in texts)
