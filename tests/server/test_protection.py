"""A server that protects itself: API keys, a bounded waiting queue (429), request timeouts, priority
scheduling and the hang watchdog — each against a real server process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.router.conftest import RouterProcess
from tests.server_harness import ServerProcess, assert_kv_clean

KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = ["--num-threads", "1", "--dtype", "float32", "--max-total-tokens", "32768"]
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """API key, two running slots and room for three waiting requests, a generous server-wide timeout."""
    server = ServerProcess(str(tiny_model_dir), [*BASE, "--api-key", KEY, "--max-running-requests", "2",
                                                 "--max-queued-requests", "3", "--request-timeout", "120"]).start()
    yield server
    assert_kv_clean(server.url, headers=AUTH)
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()}"


# ---------------------------------------------------------------------- API key
def test_api_key_required(guarded: ServerProcess) -> None:
    url = guarded.url
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/get_server_info"),
                             ("POST", "/v1/chat/completions"), ("GET", "/metrics")):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    r = httpx.post(url + "/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    info = httpx.get(url + "/get_server_info", headers=AUTH, timeout=30).json()
    assert info["api_key"] == "***", "the key must not be readable from the server's settings"


def test_api_key_openai_client(guarded: ServerProcess) -> None:
    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    out = good.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3)


def test_router_forwards_the_key(guarded: ServerProcess) -> None:
    """A router started with the key checks it on its own endpoints and calls its (keyed) worker with it."""
    router = RouterProcess([guarded.url], ["--api-key", KEY]).start()
    try:
        assert httpx.get(router.url + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(router.url + "/health", timeout=30).status_code == 200
        r = httpx.post(router.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                       headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        info = httpx.get(router.url + "/get_server_info", headers=AUTH, timeout=30)
        # the router's own call to the worker (not a forwarded one) carried the key
        assert info.status_code == 200 and info.json()["dp_size"] == 1, info.text
    finally:
        assert router.stop() == 0


# ---------------------------------------------------------------------- bounded queue
async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, last frame of the stream or the error body)."""
    async with client.stream("POST", url + "/generate", json={**body, "stream": True}, headers=AUTH) as r:
        if r.status_code != 200:
            return r.status_code, (orjson.loads(await r.aread()), r.headers.get("retry-after"))
        last = None
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = orjson.loads(line[6:])
        return 200, last


def test_full_queue_answers_429(guarded: ServerProcess) -> None:
    """A burst beyond 2 running + 3 waiting: every request either completes or gets 429 with Retry-After."""

    async def burst() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            body = {"text": "count with me:", "sampling_params": {**LONG, "max_new_tokens": 300}}
            return await asyncio.gather(*(_stream(client, guarded.url, body) for _ in range(12)))

    results = asyncio.run(burst())
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    for status, payload in results:
        if status == 200:
            assert payload["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
        else:
            body, retry_after = payload
            assert body["error"]["type"] == "rate_limit_error" and retry_after is not None and int(retry_after) >= 1
    assert_kv_clean(guarded.url, headers=AUTH)
    # the queue drained: a new request is admitted again
    r = httpx.post(guarded.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200


# ---------------------------------------------------------------------- timeouts
def test_timeout_aborts_and_frees_kv(guarded: ServerProcess) -> None:
    started = time.monotonic()
    r = httpx.post(guarded.url + "/generate", headers=AUTH, timeout=120,
                   json={"text": "a long story", "sampling_params": LONG, "timeout": 0.3})
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert err["type"] == "timeout_error" and "0.3 s" in err["message"]
    assert time.monotonic() - started < 30
    assert_kv_clean(guarded.url, headers=AUTH)


def test_timeout_ends_a_stream_with_abort(guarded: ServerProcess) -> None:
    async def one() -> tuple[int, Any]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await _stream(client, guarded.url, {"text": "a long story", "sampling_params": LONG,
                                                       "timeout": 0.5})

    status, last = asyncio.run(one())
    assert status == 200
    fin = last["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and "timeout" in fin["message"], fin
    assert 0 < last["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
    assert_kv_clean(guarded.url, headers=AUTH)


def test_a_stream_refused_before_its_first_token_keeps_its_status(guarded: ServerProcess) -> None:
    """A /generate stream whose request times out while it waits in the queue (both running slots are held) has
    sent nothing yet: it is answered 408 like a request that is not streamed, not a 200 with an abort frame."""

    async def scenario() -> tuple[int, Any]:
        async with httpx.AsyncClient(timeout=120) as client, contextlib.AsyncExitStack() as blockers:
            reading = []  # the blockers' line readers, kept: a reader collected early closes its connection
            for i in range(2):  # hold both running slots (leaving the block disconnects them: aborted)
                r = await blockers.enter_async_context(client.stream(
                    "POST", guarded.url + "/generate", headers=AUTH,
                    json={"text": f"blocker {i}", "sampling_params": LONG, "stream": True}))
                assert r.status_code == 200
                reading.append(r.aiter_lines())
                while not (await anext(reading[-1])).startswith("data: "):
                    pass
            return await _stream(client, guarded.url, {"text": "queued", "sampling_params": LONG, "timeout": 0.3})

    status, payload = asyncio.run(scenario())
    assert status == 408, payload
    body, _ = payload
    assert body["error"]["type"] == "timeout_error" and "0.3 s" in body["error"]["message"], body
    assert_kv_clean(guarded.url, headers=AUTH)


def test_bad_protection_fields(guarded: ServerProcess) -> None:
    for extra, param in (({"timeout": -1}, "timeout"), ({"timeout": "soon"}, "timeout"),
                         ({"priority": "high"}, "priority")):
        r = httpx.post(guarded.url + "/generate", headers=AUTH, timeout=30,
                       json={"text": "x", "sampling_params": {"max_new_tokens": 1}, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------- priority
def test_priority_order(tiny_model_dir: Path) -> None:
    """One running slot: while a long request holds it, two low-priority requests and then a high-priority one
    wait; when the slot frees, the high-priority one is admitted (and finishes) first. Each step waits for the
    server to report the state the next one needs (the blocker streaming, each request queued): timed delays
    alone had let the blocker reach the scheduler after the others on a loaded host."""
    server = ServerProcess(str(tiny_model_dir), [*BASE, "--max-running-requests", "1",
                                                 "--enable-priority-scheduling", "--schedule-policy", "fcfs"]).start()
    finished: list[str] = []

    async def run(client: httpx.AsyncClient, name: str, priority: int) -> None:
        r = await client.post(server.url + "/generate", json={
            "text": f"request {name}", "priority": priority,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        finished.append(name)

    async def blocker(client: httpx.AsyncClient, running: asyncio.Event) -> None:
        body = {"text": "request blocker", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
                "stream": True}
        async with client.stream("POST", server.url + "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    running.set()  # its first token is out: it holds the only slot
        finished.append("blocker")

    async def waiting(client: httpx.AsyncClient, count: int) -> None:
        for _ in range(1500):
            info = (await client.get(server.url + "/get_server_info")).json()
            if info["num_waiting_reqs"] >= count:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{count} requests never waited together: {info}")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            running = asyncio.Event()
            tasks = [asyncio.create_task(blocker(client, running))]
            await asyncio.wait_for(running.wait(), 120)
            for name, priority in (("low1", 0), ("low2", 0), ("high", 10)):
                tasks.append(asyncio.create_task(run(client, name, priority)))
                await waiting(client, len(tasks) - 1)
            assert not finished, f"the blocker should still hold the slot when all arrived: {finished}"
            await asyncio.gather(*tasks)

    try:
        asyncio.run(scenario())
        assert finished == ["blocker", "high", "low1", "low2"], finished
        assert_kv_clean(server.url)
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------------- hang watchdog
def test_hung_scheduler_gives_503_and_exit(tiny_model_dir: Path) -> None:
    """A scheduler that stops (SIGSTOP: alive, but making no progress) is declared hung within the watchdog
    timeout: the pending request gets 503, new requests get 503, and the server exits non-zero."""
    server = ServerProcess(str(tiny_model_dir), [*BASE, "--watchdog-timeout", "2"]).start()
    try:
        pid = httpx.get(server.url + "/get_server_info", timeout=30).json()["scheduler_pid"]
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 503, r.text
        assert "no status" in r.json()["error"]["message"]
        assert time.monotonic() - started < 2 + 5
        assert server.proc is not None
        code = server.proc.wait(timeout=60)
        assert code == 1, server.log()
        assert "failing pending requests with 503" in server.log()
    finally:
        server.stop()
