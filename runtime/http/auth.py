"""API keys: with ``--api-key`` every endpoint but /health answers 401 unless the request carries
``Authorization: Bearer KEY`` (the server and the router share this gate, each with its own error shape).

A plain ASGI middleware rather than an HTTP one, so streaming responses and the disconnect detection of
long requests pass through it untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

OPEN_PATHS = frozenset({"/health"})
UNAUTHORIZED = "missing or invalid API key: send 'Authorization: Bearer <key>'"


def bearer(api_key: str) -> dict[str, str]:
    """The header a client (or the router, calling its workers) sends."""
    return {"Authorization": f"Bearer {api_key}"}


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str, reject: Callable[[], Response]):
        self.app = app
        self.expected = bearer(api_key)["Authorization"].encode()
        self.reject = reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = self.reject()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                # constant time, so the key cannot be guessed byte by byte from response times
                return hmac.compare_digest(value, self.expected)
        return False
