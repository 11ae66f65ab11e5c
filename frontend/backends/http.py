"""HTTP helpers shared by the backends that talk to a server: error text and server-sent events."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from frontend.backends.base import BackendError


def error_message(resp: httpx.Response) -> str:
    """The server's error text: OpenAI-style ``{"error": {"message"}}``, ``{"detail"}``, or the body."""
    try:
        body = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        return resp.text[:500] or f"HTTP {resp.status_code}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


def post_sse(client: httpx.Client, base_url: str, path: str, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST ``payload`` and yield each ``data:`` frame of the streamed answer until ``[DONE]``; a non-200
    answer or an ``error`` frame raises BackendError with the server's message."""
    with client.stream("POST", base_url + path, content=orjson.dumps(payload),
                       headers={"Content-Type": "application/json"}) as resp:
        if resp.status_code != 200:
            resp.read()
            raise BackendError(f"POST {path}: {error_message(resp)}", resp.status_code)
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            frame = orjson.loads(data)
            if "error" in frame:
                raise BackendError(f"POST {path}: {frame['error']}")
            yield frame
