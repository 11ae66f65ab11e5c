"""A headless Chromium driven over the DevTools protocol (CDP), for tests of the dashboard pages.

``--dump-dom`` snapshots a page at an arbitrary moment (before or after its fetches ran), so the tests drive
the browser instead: navigate, then evaluate JavaScript in the page until it shows what is expected.
Only Debian's ``chromium`` (or ``chromium-browser`` / ``google-chrome``) and the ``websockets`` package.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class Chromium:
    """``with Chromium() as b: b.goto(url); b.wait_for("js expression")``."""

    def __init__(self, width: int = 1400, height: int = 1000):
        exe = find_chromium()
        if exe is None:
            raise RuntimeError("no chromium found on PATH")
        self.profile = tempfile.mkdtemp(prefix="radixserve-chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._ids = itertools.count(1)
        self._stack = contextlib.ExitStack()
        self.ws: Any = None

    def __enter__(self) -> Chromium:
        from websockets.sync.client import connect

        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.time() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                 if t["type"] == "page"]
        self.ws = self._stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=64 * 2**20))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:  # skip events until our answer
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Evaluate ``expression`` until it is truthy; returns its value (fails with the last one)."""
        deadline = time.time() + timeout
        value = None
        while time.time() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError as exc:  # the page is still loading
                value = f"error: {exc}"
                time.sleep(0.2)
                continue
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"the page never satisfied {expression!r} (last value {value!r})")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
