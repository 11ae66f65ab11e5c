"""RuntimeEndpoint: a radixserve (or SGLang) server over its native HTTP API; and Runtime, which starts one.

Only httpx and orjson are needed, so this works from the thin client install. One pooled httpx
client serves every program thread (it is thread-safe), so ``run_batch`` with many threads reuses
connections instead of opening one per request.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from frontend.backends.base import BackendError
from frontend.backends.http import error_message, post_sse
from frontend.backends.native import NativeBackend
from frontend.chat import ChatTemplate, resolve_chat_template


class RuntimeEndpoint(NativeBackend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None,
                 chat_template_name: str | None = None, chat_template: ChatTemplate | str | None = None,
                 timeout: float | None = None):
        """``timeout`` bounds each request's wait for data (None: no bound; CPU generations can be slow).

        The chat template is the server's own (``/get_model_info``) unless one is given.
        """
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers, verify=True if verify is None else verify,
            timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.model_info: dict[str, Any] = self._get("/get_model_info")
        self.chat_template = resolve_chat_template(chat_template or chat_template_name,
                                                   self.model_info.get("chat_template"))

    # ------------------------------------------------------------------ HTTP
    def _get(self, path: str) -> Any:
        resp = self._client.get(self.base_url + path)
        if resp.status_code != 200:
            raise BackendError(f"GET {path}: {error_message(resp)}", resp.status_code)
        return orjson.loads(resp.content)

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        resp = self._client.post(self.base_url + path, content=orjson.dumps(payload),
                                 headers={"Content-Type": "application/json"})
        if resp.status_code != 200:
            raise BackendError(f"POST {path}: {error_message(resp)}", resp.status_code)
        return orjson.loads(resp.content) if resp.content else None

    def _call(self, payload: dict[str, Any]) -> Any:
        return self._post("/generate", payload)

    def _call_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return post_sse(self._client, self.base_url, "/generate", payload)

    # ------------------------------------------------------------------ control
    def get_model_name(self) -> str:
        return str(self.model_info["model_path"])

    def flush_cache(self) -> bool:
        """Drop the server's cached prefixes; False when it refuses (requests are running)."""
        resp = self._client.post(self.base_url + "/flush_cache", content=b"{}",
                                 headers={"Content-Type": "application/json"})
        return resp.status_code == 200

    def get_server_info(self) -> dict[str, Any]:
        return dict(self._get("/get_server_info"))

    def shutdown(self) -> None:
        self._client.close()


class Runtime:
    """Starts ``radixserve serve`` as a subprocess and connects a RuntimeEndpoint to it (``.endpoint``).

    Keyword arguments are server flags (``max_total_tokens=32768`` -> ``--max-total-tokens 32768``;
    ``True`` for a switch). Needs the serve extra installed. Stopped at exit or by ``shutdown()``.
    """

    def __init__(self, model: str = "default", port: int | None = None, launch_timeout: float = 300.0,
                 log_level: str = "error", model_path: str | None = None, **server_args: Any):
        """``model_path`` is SGLang's name for ``model``."""
        import socket

        model = model_path or model

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", model, "--port", str(port),
               "--log-level", log_level]
        for key, value in server_args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value not in (None, False):
                cmd += [flag, str(value)]
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            cmd, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        atexit.register(self.shutdown)
        deadline = time.time() + launch_timeout
        while time.time() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self._proc.returncode} while starting")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.shutdown()
            raise TimeoutError(f"the server did not start within {launch_timeout} s")
        self.endpoint = RuntimeEndpoint(self.url)

    def shutdown(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None
