"""/openapi.json tells the truth: real request bodies, real answers and errors — then schemathesis fuzzes every
route against it with all of its checks (a 5xx, a hang, an undocumented status or content type, a
schema-violating body accepted or a schema-valid one refused beyond tests/server/schemathesis.toml's
documented exceptions all fail), and the server's KV books are clean afterwards."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_harness import ServerProcess, assert_kv_clean

CONFIG = Path(__file__).with_name("schemathesis.toml")
CONTEXT = 256
RUNNING = 4


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """A short context and few running slots keep every generation the fuzzer asks for small."""
    server = ServerProcess(str(tiny_model_dir), ["--num-threads", "1", "--context-length", str(CONTEXT),
                                                 "--max-total-tokens", "16384", "--max-running-requests", str(RUNNING),
                                                 "--max-queued-requests", "64"]).start()
    yield server
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()}"


def test_document_declares_bodies_answers_and_errors(fuzzed: ServerProcess) -> None:
    doc = httpx.get(fuzzed.url + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    ops = {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}
    for route, model in ((("post", "/generate"), "GenerateRequest"),
                         (("post", "/v1/completions"), "CompletionRequest"),
                         (("post", "/v1/chat/completions"), "ChatCompletionRequest"),
                         (("post", "/v1/responses"), "ResponsesRequest")):
        op = ops[route]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}, route
        assert {"200", "400", "408", "429", "503"} <= set(op["responses"]), route
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for (method, path), op in ops.items():
        assert "422" not in op["responses"], f"{method} {path}: validation errors are 400s here"
        for status, answer in op["responses"].items():
            if status >= "400":
                assert answer["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    assert "requestBody" not in ops[("get", "/v1/models")]
    assert "text/plain" in ops[("get", "/metrics")]["responses"]["200"]["content"]
    # limits that are server settings are in the document
    sampling = schemas["SamplingParamsBody"]["properties"]
    assert {"type": "integer", "minimum": 0, "maximum": CONTEXT} in sampling["max_new_tokens"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": RUNNING} in schemas["CompletionRequest"]["properties"]["n"][
        "anyOf"]
    assert schemas["SamplingParamsBody"]["additionalProperties"] is False


def test_undeclared_methods_answer_405_with_allow(fuzzed: ServerProcess) -> None:
    r = httpx.request("TRACE", fuzzed.url + "/v1/responses/abc", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "405"
    assert r.headers["allow"] == "DELETE, GET"


def test_schemathesis_all_checks(fuzzed: ServerProcess, tmp_path: Path) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    out = subprocess.run([str(cli), "--config-file", str(CONFIG), "run", fuzzed.url + "/openapi.json",
                          "--checks", "all", "--max-examples", "15", "--workers", "1", "--seed", "7",
                          "--no-color"], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path)  # where schemathesis keeps its cache
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    assert httpx.get(fuzzed.url + "/health", timeout=30).status_code == 200
    assert "unexpected error" not in fuzzed.log_tail(10**8), "a route raised (a 500 reached a client)"
    assert_kv_clean(fuzzed.url)
