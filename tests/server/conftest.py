from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_harness import ServerProcess


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One server over the tiny random model for the whole session (stopped cleanly at the end)."""
    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "32768", "--num-threads", "1"]).start()
    yield server
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()}"


@pytest.fixture(scope="session")
def smol_server() -> Iterator[ServerProcess]:
    """The default model, as the README serves it."""
    server = ServerProcess("default", ["--max-total-tokens", "32768"]).start()
    yield server
    server.stop()
