"""The OpenAI-compatible API through the official ``openai`` client, against a real server process.

Greedy outputs are compared with the in-process Engine over the same weights and the same prompt ids
(chat prompts rendered with the same chat template), streaming or not, sync or async: equal texts, or
texts that part no earlier than a float near-tie of the Engine's reference (tests/oracle.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runtime.engine import Engine
from runtime.models.tokenizer import apply_chat_template
from tests.conftest import checked_engine
from tests.oracle import WITH_TOP2, Greedy, assert_text_agrees
from tests.server_harness import ServerProcess, assert_kv_clean

GREEDY = {"temperature": 0, "max_tokens": 16}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about cats."}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with checked_engine(tiny_model_dir, max_total_tokens=8192, dtype="float32") as eng:
        yield eng


@pytest.fixture(scope="module")
def model_name(tiny_server: ServerProcess) -> str:
    return str(httpx.get(tiny_server.url + "/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def aclient(tiny_server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


def engine_ref(engine: Engine, ids: list[int], max_tokens: int = 16, **sp: Any) -> dict[str, Any]:
    """The Engine's greedy result with its top-2 logprobs: the reference a server's text is held to."""
    return dict(engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_tokens, "temperature": 0,
                                                                **sp}, **WITH_TOP2))


def same_text(engine: Engine, ref: dict[str, Any], text: str, what: str = "", want: str | None = None) -> None:
    assert_text_agrees(ref, text, lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True), what, want)


def chat_ids(engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
    return apply_chat_template(engine.tokenizer, messages)


def prompt_ids(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer(text).input_ids)


def check_usage(usage: Any) -> None:
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= usage.prompt_tokens


# ---------------------------------------------------------------------- models
def test_models(client: Any, model_name: str, tiny_server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "radixserve"
    assert httpx.get(tiny_server.url + "/v1/models").json()["data"][0]["max_model_len"] == 4096
    assert client.models.retrieve("default").id == model_name


# ---------------------------------------------------------------------- completions
def test_completions_match_engine(client: Any, engine: Engine, model_name: str) -> None:
    prompt = "The capital of France is"
    ids = prompt_ids(engine, prompt)
    want = engine_ref(engine, ids)
    resp = client.completions.create(model=model_name, prompt=prompt, **GREEDY)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == model_name
    same_text(engine, want, resp.choices[0].text, "completion")
    assert resp.choices[0].finish_reason in ("stop", "length")
    check_usage(resp.usage)
    assert resp.usage.prompt_tokens == len(ids)
    # token ids, a batch of prompts, the alias "default", streaming: all the same text
    same_text(engine, want, client.completions.create(model="default", prompt=ids, **GREEDY).choices[0].text, "ids")
    batch = client.completions.create(model=model_name, prompt=[prompt, "Once upon a time"], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    same_text(engine, want, batch.choices[0].text, "batch[0]")
    same_text(engine, engine_ref(engine, prompt_ids(engine, "Once upon a time")), batch.choices[1].text, "batch[1]")
    stream = client.completions.create(model=model_name, prompt=prompt, stream=True, **GREEDY)
    same_text(engine, want, "".join(c.choices[0].text for c in stream if c.choices), "stream")
    echo = client.completions.create(model=model_name, prompt=prompt, echo=True, **GREEDY).choices[0].text
    assert echo.startswith(prompt), echo
    same_text(engine, want, echo[len(prompt):], "echo")


def test_completions_logprobs_and_echo(client: Any, engine: Engine, model_name: str) -> None:
    prompt = "Two plus two equals"
    n_prompt = len(prompt_ids(engine, prompt))
    resp = client.completions.create(model=model_name, prompt=prompt, logprobs=2, echo=True, temperature=0,
                                     max_tokens=4, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 and tok in t for t, tok in zip(lp.top_logprobs[1:], lp.tokens[1:]))
    assert "".join(lp.tokens[:n_prompt]) == prompt and resp.choices[0].text.startswith(prompt)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # greedy: the chosen token is the most likely one
    for top, tok in zip(lp.top_logprobs[n_prompt:], lp.tokens[n_prompt:]):
        assert top[tok] == max(top.values())
    # max_tokens 0 with echo scores the prompt alone
    score = client.completions.create(model=model_name, prompt=prompt, logprobs=0, echo=True, max_tokens=0)
    assert score.choices[0].text == prompt
    assert score.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-4)


def test_stop_strings_are_trimmed(client: Any, engine: Engine, model_name: str) -> None:
    prompt = "A list of animals:"
    ref = engine_ref(engine, prompt_ids(engine, prompt), 24, ignore_eos=True)
    full = ref["text"]
    stop = full[8:11]
    assert stop.strip(), full
    want = full[: full.find(stop)]
    # the stop string lies where the server's tokens must equal the reference's (before any near tie)
    tie = Greedy.from_native(ref).near_tie()
    if tie is not None:
        agreed = engine.tokenizer.decode(ref["output_ids"][:tie], skip_special_tokens=True)
        assert len(agreed) >= full.find(stop) + len(stop), f"a near tie at step {tie}: pick another prompt"
    resp = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=24, stop=[stop],
                                     extra_body={"ignore_eos": True})
    same_text(engine, ref, resp.choices[0].text, "trimmed", want)
    assert resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=24, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    same_text(engine, ref, "".join(c.choices[0].text for c in stream if c.choices), "trimmed stream", want)


def test_null_fields_mean_defaults(tiny_server: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 4, "n": None, "stream": None,
            "logprobs": None, "stop": None, "temperature": None, "stream_options": None, "metadata": {"a": "b"}}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


# ---------------------------------------------------------------------- chat
def test_chat_matches_engine(client: Any, engine: Engine, model_name: str) -> None:
    want = engine_ref(engine, chat_ids(engine, MESSAGES))
    resp = client.chat.completions.create(model=model_name, messages=MESSAGES, **GREEDY)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert msg.role == "assistant"
    same_text(engine, want, msg.content, "chat")
    assert resp.choices[0].logprobs is None
    check_usage(resp.usage)
    # content parts, the developer role, max_completion_tokens: the same prompt and limit
    parts = [{"role": "developer", "content": "You are terse."},
             {"role": "user", "content": [{"type": "text", "text": "Tell me about cats."}]}]
    same = client.chat.completions.create(model=model_name, messages=parts, temperature=0,
                                          max_completion_tokens=16)
    same_text(engine, want, same.choices[0].message.content, "content parts")
    # streaming: the first delta carries the role; the helper assembles the same text
    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                 stream=True, **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    same_text(engine, want, "".join(c.choices[0].delta.content or "" for c in chunks), "chat stream")
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with client.chat.completions.stream(model=model_name, messages=MESSAGES, **GREEDY) as s:
        text = "".join(e.delta for e in s if e.type == "content.delta")
        snapshot = s.current_completion_snapshot  # (get_final_completion raises on finish_reason "length")
    same_text(engine, want, text, "stream helper")
    same_text(engine, want, snapshot.choices[0].message.content, "stream snapshot")


def test_chat_async_and_include_usage(aclient: Any, engine: Engine, model_name: str) -> None:
    want = engine_ref(engine, chat_ids(engine, MESSAGES))
    hello = engine_ref(engine, prompt_ids(engine, "Hello"))

    async def main() -> None:
        resp = await aclient.chat.completions.create(model=model_name, messages=MESSAGES,
                                                     **GREEDY)
        same_text(engine, want, resp.choices[0].message.content, "async chat")
        stream = await aclient.chat.completions.create(
            model=model_name, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
            **GREEDY)
        chunks = [c async for c in stream]
        same_text(engine, want, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), "async stream")
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        check_usage(chunks[-1].usage)
        assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
        async with aclient.chat.completions.stream(model=model_name, messages=MESSAGES,
                                                   stream_options={"include_usage": True}, **GREEDY) as s:
            async for _ in s:
                pass
            final = s.current_completion_snapshot
        same_text(engine, want, final.choices[0].message.content, "async stream helper")
        assert final.usage is not None
        comp = await aclient.completions.create(model=model_name, prompt="Hello", stream=True, **GREEDY)
        same_text(engine, hello, "".join([c.choices[0].text async for c in comp if c.choices]), "async completion")

    asyncio.run(main())


def test_cached_tokens_for_a_repeated_prompt(client: Any, model_name: str) -> None:
    long = [{"role": "user", "content": "Remember these words: " + " ".join(f"w{i}" for i in range(300))}]
    first = client.chat.completions.create(model=model_name, messages=long, max_tokens=2)
    second = client.chat.completions.create(model=model_name, messages=long, max_tokens=2)
    check_usage(first.usage)
    assert second.usage.prompt_tokens_details.cached_tokens > 200


def test_n_with_seed(client: Any, model_name: str) -> None:
    args = {"model": model_name, "messages": MESSAGES, "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 8}
    a = client.chat.completions.create(**args)
    b = client.chat.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    one = client.chat.completions.create(**{**args, "n": 1})
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert a.usage.completion_tokens > one.usage.completion_tokens
    stream = client.chat.completions.create(stream=True, **args)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_chat_logprobs(client: Any, model_name: str) -> None:
    resp = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                          logprobs=True, top_logprobs=3, temperature=0, max_tokens=6,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 6 == resp.usage.completion_tokens
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and bytes(e.bytes or []).decode(errors="replace") == e.token
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
    stream = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                            logprobs=True, top_logprobs=3, temperature=0, max_tokens=6,
                                            stream=True, extra_body={"ignore_eos": True})
    streamed = [e for c in stream for e in (c.choices[0].logprobs.content or [] if c.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_client_disconnect_aborts(tiny_server: ServerProcess, model_name: str) -> None:
    """Requests of clients that went away stop long before their 3,500 tokens (~20 s here) are done."""
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 3500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert next(r.iter_lines()).startswith("data: ")
    with pytest.raises(httpx.TimeoutException):  # non-streaming: the client gives up waiting
        httpx.post(tiny_server.url + "/v1/completions", timeout=0.5,
                   json={"model": model_name, "prompt": "x", "max_tokens": 3500, "ignore_eos": True})
    assert_kv_clean(tiny_server.url, timeout=5)


# ---------------------------------------------------------------------- concurrency
def test_64_concurrent_streams_equal_solo_runs(aclient: Any, client: Any, engine: Engine,
                                               model_name: str) -> None:
    topics = ["cats", "the sea", "bread", "trains", "music", "rain", "chess", "stars"]
    jobs: list[tuple[str, Any, int]] = []
    for i in range(64):
        topic = topics[i % len(topics)]
        if i % 2:
            jobs.append(("completion", f"Story {i} about {topic}:", 8 + i % 9))
        else:
            jobs.append(("chat", [{"role": "user", "content": f"Write line {i} about {topic}."}], 8 + i % 9))

    async def run(kind: str, prompt: Any, max_tokens: int) -> str:
        if kind == "chat":
            stream = await aclient.chat.completions.create(model=model_name, messages=prompt, stream=True,
                                                           temperature=0, max_tokens=max_tokens)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        comp = await aclient.completions.create(model=model_name, prompt=prompt, stream=True, temperature=0,
                                                max_tokens=max_tokens)
        return "".join([c.choices[0].text async for c in comp if c.choices])

    async def main() -> list[str]:
        return await asyncio.gather(*(run(*job) for job in jobs))

    together = asyncio.run(main())
    # both the 64 concurrent streams and the solo runs are held to one reference with its top-2 logprobs
    refs = engine.generate(input_ids=[chat_ids(engine, p) if kind == "chat" else prompt_ids(engine, p)
                                      for kind, p, _ in jobs],
                           sampling_params=[{"max_new_tokens": m, "temperature": 0} for _, _, m in jobs], **WITH_TOP2)
    for (kind, prompt, max_tokens), got, ref in zip(jobs, together, refs):
        if kind == "chat":
            alone = client.chat.completions.create(model=model_name, messages=prompt, temperature=0,
                                                   max_tokens=max_tokens).choices[0].message.content
        else:
            alone = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                              max_tokens=max_tokens).choices[0].text
        same_text(engine, ref, got, f"{kind} {prompt!r} among 64 streams")
        same_text(engine, ref, alone, f"{kind} {prompt!r} alone")


# ---------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_smol_chat_smoke(smol_server: ServerProcess) -> None:
    client: Any = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0)
    resp = client.chat.completions.create(model="default", temperature=0, max_tokens=32,
                                          messages=[{"role": "user", "content": "Name three fruits."}])
    text = resp.choices[0].message.content or ""
    assert any(f in text.lower() for f in ("apple", "banana", "orange", "grape", "mango", "strawberr")), text
    assert resp.usage is not None and resp.usage.completion_tokens > 0
