"""The router's own errors, in the OpenAI error shape the workers use (``runtime.http.errors``)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
               502: "bad_gateway", 503: "service_unavailable"}


class RouterError(Exception):
    """Raised anywhere in the router; the app turns it into a JSON error response."""

    def __init__(self, status: int, message: str, code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code or str(status)}}


def error_response(status: int, message: str, code: str | None = None,
                   retry_after: float | None = None) -> Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return Response(orjson.dumps(error_body(status, message, code)), status_code=status,
                    media_type="application/json", headers=headers)


def sse_error(status: int, message: str, code: str | None = None) -> bytes:
    """An error event for a stream that already started (its status line is gone)."""
    return b"data: " + orjson.dumps(error_body(status, message, code)) + b"\n\ndata: [DONE]\n\n"
