from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_harness import ServerProcess, assert_kv_clean


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One server over the tiny random model for the whole session (stopped cleanly at the end), in float32:
    its outputs are compared with an in-process Engine's within tests/oracle.py's float32 tolerances."""
    server = ServerProcess(str(tiny_model_dir), ["--max-total-tokens", "32768", "--num-threads", "1",
                                                 "--dtype", "float32"]).start()
    yield server
    assert_kv_clean(server.url)
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()}"


@pytest.fixture(scope="session")
def smol_server() -> Iterator[ServerProcess]:
    """The default model, as the README serves it."""
    server = ServerProcess("default", ["--max-total-tokens", "32768"]).start()
    yield server
    server.stop()
