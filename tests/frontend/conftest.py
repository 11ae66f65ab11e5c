"""Fixtures of the frontend (DSL) tests: one tiny-model server for the session, backends over it.

The server fixture follows tests/server/conftest.py (copied, not imported, so each test directory
owns its fixtures).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import frontend as sgl
from tests.server_harness import ServerProcess, assert_kv_clean


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One server over the tiny random model for the whole session (stopped cleanly at the end), in float32:
    its outputs are compared with an in-process Engine's within tests/oracle.py's float32 tolerances."""
    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "32768", "--dtype", "float32"]).start()
    yield server
    assert_kv_clean(server.url)
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()}"


@pytest.fixture(scope="session")
def endpoint(tiny_server: ServerProcess) -> Iterator[sgl.RuntimeEndpoint]:
    backend = sgl.RuntimeEndpoint(tiny_server.url)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def constrained(tiny_server: ServerProcess) -> bool:
    """Whether the server enforces ``regex`` (constrained decoding): typed-gen and JSON tests need it."""
    import re

    body = {"text": "Pick a number:", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                         "regex": "[0-9]{3}"}}
    resp = httpx.post(tiny_server.url + "/generate", json=body, timeout=60)
    return resp.status_code == 200 and re.fullmatch("[0-9]{3}", resp.json()["text"]) is not None


@pytest.fixture
def need_constrained(constrained: bool) -> None:
    assert constrained, "the server did not enforce a regex: constrained decoding is broken"
