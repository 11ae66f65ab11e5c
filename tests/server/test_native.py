"""The SGLang-native API of a real server process, and the server's process lifecycle."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server_harness import ServerProcess, alive_after, is_idle, scrape_metrics, server_info_when


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def sse_frames(resp) -> list:
    frames = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            frames.append(payload if payload == "[DONE]" else json.loads(payload))
    return frames


def wait_idle(server, timeout=20.0):
    return server_info_when(server.url, is_idle, "idle", timeout)


def wait_running(server, timeout=60.0):
    """Once a request runs: waiting for it, rather than sleeping a fixed time, holds on a loaded host too."""
    return server_info_when(server.url, lambda i: i["num_running_reqs"] == 1, "running one request", timeout)


def test_generate_fields(tiny_server):
    r = post(tiny_server, "/generate", {"text": "Hello world, this is", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}, "rid": "fields-1"})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "fields-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == 6 == len(out["output_ids"])
    assert meta["prompt_tokens"] > 0 and isinstance(meta["cached_tokens"], int)


def test_batch_input_ids_and_logprobs(tiny_server):
    r = post(tiny_server, "/generate", {
        "input_ids": [[11, 12, 13, 14], [21, 22, 23]],
        "sampling_params": [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 3, "temperature": 0}],
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True,
    })
    assert r.status_code == 200
    a, b = r.json()
    assert len(a["output_ids"]) == 2 and len(b["output_ids"]) == 3
    inp = a["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == [11, 12, 13, 14] and inp[0][0] is None
    assert all(isinstance(e[2], str) for e in inp)
    outp = a["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in outp] == a["output_ids"] and all(e[0] <= 0 for e in outp)
    assert len(a["meta_info"]["output_top_logprobs"][0]) == 2


def test_streaming_frames_are_cumulative(tiny_server):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    full = post(tiny_server, "/generate", body).json()
    with httpx.stream("POST", tiny_server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = sse_frames(r)
    assert frames[-1] == "[DONE]"
    texts = [f["text"] for f in frames[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"]
    assert frames[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_prefill_only_then_shared_prefix_hits(tiny_server):
    prefix = "The following is a long shared system prompt. " * 12
    r = post(tiny_server, "/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 0
    n = r.json()["meta_info"]["prompt_tokens"]
    r = post(tiny_server, "/generate", {"text": prefix + "And now a question?",
                                         "sampling_params": {"max_new_tokens": 2}})
    assert r.json()["meta_info"]["cached_tokens"] >= n - 1


def test_server_info_health_flush_metrics(tiny_server):
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    assert httpx.get(tiny_server.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(tiny_server.url + "/get_model_info").json()
    assert info["is_generation"] and info["context_length"] > 0 and info["model_path"]
    wait_idle(tiny_server)
    r = post(tiny_server, "/flush_cache", {})
    assert r.status_code == 200
    info = wait_idle(tiny_server)
    kv = info["kv"]
    assert kv["free"] + kv["evictable"] + kv["protected"] + kv["private"] == kv["capacity"]
    assert info["cache"]["cached_tokens"] == 0 and info["max_total_tokens"] == 32768
    before = scrape_metrics(tiny_server.url)
    post(tiny_server, "/generate", {"text": "metrics please",
                                    "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    # a request's counters move with its outputs, before its reply is sent
    after = scrape_metrics(tiny_server.url)
    names = {name for name, _ in after}
    for name in ("radixserve_num_running_reqs", "radixserve_num_queue_reqs", "radixserve_token_usage",
                 "radixserve_cache_hit_rate", "radixserve_time_to_first_token_seconds_bucket",
                 "radixserve_inter_token_latency_seconds_bucket", "radixserve_generation_tokens_total"):
        assert name in names, name
    grew = {name: after[(name, ())] - before[(name, ())] for name in
            ("radixserve_requests_total", "radixserve_generation_tokens_total", "radixserve_prompt_tokens_total")}
    assert grew["radixserve_requests_total"] == 1 and grew["radixserve_generation_tokens_total"] == 2, grew
    assert grew["radixserve_prompt_tokens_total"] > 0, grew


def test_abort_request_endpoint(tiny_server):
    import threading

    result = {}

    def run():
        result["r"] = post(tiny_server, "/generate", {"text": "abort me", "rid": "to-abort", "sampling_params": {
            "max_new_tokens": 3000, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    wait_running(tiny_server)
    assert post(tiny_server, "/abort_request", {"rid": "to-abort"}).status_code == 200
    t.join(30)
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(tiny_server, "/abort_request", {}).status_code == 400
    wait_idle(tiny_server)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_client_frees_its_kv(tiny_server, stream):
    body = {"text": "a client that leaves " * 20, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            "stream": stream}
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        if stream:
            sock.recv(100)  # the stream has started
        busy = wait_running(tiny_server)
        assert busy["kv"]["private"] > 0
    info = wait_idle(tiny_server)  # the close aborted it within a step or two
    assert info["kv"]["private"] == 0 and info["kv"]["protected"] == 0


def test_bad_native_inputs_get_4xx_and_server_stays_healthy(tiny_server):
    cases = [
        (b"{not json", 400),
        (json.dumps([1, 2]).encode(), 400),
        (json.dumps({"sampling_params": {}}).encode(), 400),
        (json.dumps({"text": 5}).encode(), 400),
        (json.dumps({"text": "x", "input_ids": [1]}).encode(), 400),
        (json.dumps({"text": "x", "sampling_params": {"temperature": "hot"}}).encode(), 400),
        (json.dumps({"text": "x", "sampling_params": {"top_p": 1.5}}).encode(), 400),
        (json.dumps({"text": "x", "sampling_params": {"max_new_tokens": 10**6}}).encode(), 400),
        (json.dumps({"text": "x", "sampling_params": {"n": 100000}}).encode(), 400),
        (json.dumps({"input_ids": [10**9]}).encode(), 400),
        (json.dumps({"text": "x", "stream": "yes"}).encode(), 400),
        (json.dumps({"text": ["a", "b"], "sampling_params": [{}]}).encode(), 400),
    ]
    for body, status in cases:
        r = httpx.post(tiny_server.url + "/generate", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    ok = post(tiny_server, "/generate", {"text": "still fine", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_sigterm_stops_every_process(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "2048"]).start()
    kids = server.children()
    assert len(kids) >= 2
    assert server.stop(signal.SIGTERM) == 0
    assert alive_after(kids) == [], "no orphan processes"


def child_bound_to(server: ServerProcess, name: str) -> int:
    """PID of the server's child process that binds the ``name`` IPC socket ("scheduler", "detokenizer"):
    each receiving side binds its own ``ipc://…/name`` path, so the socket names the process for sure."""
    inodes = set()
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and "radixserve-ipc-" in parts[7] and parts[7].endswith("/" + name):
                inodes.add(f"socket:[{parts[6]}]")
    found = set()
    for pid in server.children():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        found.add(pid)
    assert len(found) == 1, f"{name}: {found} among {server.children()}"
    return found.pop()


def test_the_detokenizer_does_not_load_torch(tiny_server):
    """The detokenizer needs the tokenizer, not the model code: torch would cost it a second or more of
    start-up and a few hundred MB. (The HTTP server loads torch on purpose: xgrammar, which validates grammars
    there, needs it.)"""
    def loads_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    assert loads_torch(child_bound_to(tiny_server, "scheduler"))
    assert not loads_torch(child_bound_to(tiny_server, "detokenizer"))


class HeldRequest:
    """A /generate request the server has accepted and cannot answer: the detokenizer (every output passes
    through it) is frozen before it is sent, and it is held until the scheduler has seen it, which happens
    only after the HTTP side registered it as pending."""

    def __init__(self, server: ServerProcess, detokenizer: int):
        before = httpx.get(server.url + "/get_server_info", timeout=30).json()["scheduler"]["finished_requests"]
        os.kill(detokenizer, signal.SIGSTOP)
        self.detokenizer = detokenizer
        self.response: httpx.Response | None = None
        self.thread = threading.Thread(target=self._send, args=(server,))
        self.thread.start()
        deadline = time.time() + 30
        while True:
            info = httpx.get(server.url + "/get_server_info", timeout=30).json()
            if info["num_running_reqs"] + info["num_waiting_reqs"] > 0 \
                    or info["scheduler"]["finished_requests"] > before:
                break
            assert time.time() < deadline, info
            time.sleep(0.02)
        assert self.thread.is_alive(), "the held request was answered although no output can reach the server"

    def _send(self, server: ServerProcess) -> None:
        self.response = post(server, "/generate", {"text": "hold me", "sampling_params": {"max_new_tokens": 4}})

    def result(self) -> httpx.Response:
        self.thread.join(30)
        assert self.response is not None
        return self.response

    def release(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.detokenizer, signal.SIGCONT)


def read_http_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of the one response on ``sock``, read until the server closes it."""
    data = b""
    sock.settimeout(30)
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def assert_exits_with_children(server: ServerProcess, kids: list[int], code: int = 1) -> None:
    assert server.proc is not None
    server.proc.wait(30)
    assert server.proc.returncode == code, server.log()
    assert alive_after(kids) == [], "no orphan processes"


def test_scheduler_death_gives_503_and_nonzero_exit(tiny_model_dir):
    """A request pending when the scheduler dies is answered 503; the server exits 1 with no child left."""
    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "2048"]).start()
    kids = server.children()
    sched, detok = child_bound_to(server, "scheduler"), child_bound_to(server, "detokenizer")
    assert sched != detok and {sched, detok} <= set(kids)
    held = HeldRequest(server, detok)
    try:
        os.kill(sched, signal.SIGKILL)
        r = held.result()
    finally:
        held.release()
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "scheduler process exited" in err["message"], err
    assert_exits_with_children(server, kids)


def test_a_stream_that_loses_the_server_ends_with_an_error_frame(tiny_model_dir):
    """After its 200 only a frame can say what went wrong: a /generate stream whose scheduler dies ends with
    SGLang's error frame (the 503's message, its type and status) and [DONE], not a dropped connection."""
    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "2048"]).start()
    kids = server.children()
    sched = child_bound_to(server, "scheduler")
    body = {"text": "a long story", "stream": True, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[6:])
        os.kill(sched, signal.SIGKILL)
        rest = list(lines)
    assert first["meta_info"]["completion_tokens"] >= 1
    assert rest[-1] == "data: [DONE]", rest[-3:]
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable", err
    assert "scheduler process exited" in err["message"], err
    assert_exits_with_children(server, kids)


def test_requests_get_503_once_a_child_died(tiny_model_dir):
    """A request reaching the server after it noticed a dead child gets 503, not a hang or a dropped
    connection, and the server then exits 1.

    The request's headers go out before the kill and its body only after the server has declared itself
    dead (a request pending at the time has been answered 503): uvicorn has started its handler, so the
    graceful stop that follows the death waits for it, and the handler submits it to a dead server."""
    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "2048"]).start()
    kids = server.children()
    detok = child_bound_to(server, "detokenizer")
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode()
    late = socket.create_connection(("127.0.0.1", server.port))
    try:
        late.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        held = HeldRequest(server, detok)
        os.kill(detok, signal.SIGKILL)
        pending = held.result()
        assert pending.status_code == 503, pending.text  # the server knows: it is dead from here on
        assert "detokenizer process exited" in pending.json()["error"]["message"]
        late.sendall(body[5:])
        status, answer = read_http_response(late)
    finally:
        late.close()
    assert status == 503, answer
    err = json.loads(answer)["error"]
    assert err["type"] == "service_unavailable" and "detokenizer process exited" in err["message"], err
    assert_exits_with_children(server, kids)
