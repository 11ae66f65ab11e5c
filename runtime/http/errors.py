"""Errors in OpenAI's JSON shape, for every endpoint (native ones too).

``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for anything the client can fix;
401 without the API key, 408 past a request's timeout, 429 when the waiting queue is full (with Retry-After), 503 when
the server lost or hung a process. The runtime's refusals are ``IntakeError``s naming a field in the runtime's
spelling; ``api_error`` renames it through the calling API's table (``names``) and it becomes ``param``. The
runtime knows no HTTP: an aborted request says why (``AbortCause``) and ``ABORT_STATUS`` is the one place that
turns a cause into a status.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from runtime.core.errors import IntakeError
from runtime.core.messages import AbortCause, FinishReason
from runtime.request.front import QueueFull
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import ServerUnavailable

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


# Aborts that answer the client with an error; the others (the client's own abort, a request the runtime stopped
# while it ran) end the request normally, with an "abort" finish reason.
ABORT_STATUS: dict[AbortCause, int] = {AbortCause.TIMEOUT: 408, AbortCause.INVALID: 400}


def abort_status(fin: FinishReason | None) -> int | None:
    """The HTTP status of a request that ended this way, when it is an error."""
    if fin is None or fin.type != "abort" or fin.cause is None:
        return None
    return ABORT_STATUS.get(fin.cause)


def api_error(exc: IntakeError, names: Mapping[str, str] | None = None) -> APIError:
    """The 400 of a refused request, its field named as the calling API names it (``names``: runtime field
    -> the API's field; fields not in it keep the runtime's name)."""
    named = exc.named(names or {})
    return APIError(400, str(named), named.field)


def raise_if_rejected(state: RequestState) -> None:
    """Raise the APIError of a request that ended in an error abort (a timeout, say): the intake has
    refused every request it can name a field of, so these name none."""
    status = abort_status(state.finished)
    if status is not None:
        raise APIError(status, (state.finished and state.finished.message) or "the request was rejected")


@contextlib.contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """Inside: a refusal of the intake (an IntakeError naming a field in the runtime's spelling) becomes
    the 400 naming the field as the calling API does (``names``)."""
    try:
        yield
    except IntakeError as exc:
        raise api_error(exc, names) from None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code or str(status)}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    return Response(orjson.dumps(error_body(status, message, param, code)), status_code=status,
                    media_type="application/json")


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")
# Parts of a pydantic error location that name a member of a union type rather than a field
# ("SamplingParamsBody", "list[str]"): left out, so the error names the field the client wrote.
_UNION_TAG = re.compile(r"^(str|int|float|bool|[A-Z]\w*|.*\[.*\])$")


def from_value_error(exc: ValueError) -> APIError:
    message = str(exc)
    m = _FIELD.match(message)
    return APIError(400, message, param=m.group(1) if m else None)


async def parse_json(request: Request) -> Any:
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def validation_failure(exc: ValidationError) -> RequestValidationError:
    """A pydantic error as the 400 that names the field the client wrote (union member tags left out)."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    for e in errors:
        e["loc"] = tuple(p for p in e["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p)))
    return RequestValidationError(errors)


M = TypeVar("M", bound=BaseModel)


def check_types(model: type[M], body: Any) -> M:
    """Validate ``body`` against ``model``; a mismatch is a 400 naming the field (RequestValidationError)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_failure(exc) from None


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (the framework's own 405 may name none). The app lists
    its routes in ``app.state.routes``: included routers are not flattened into ``app.routes``."""
    methods: set[str] = set()
    for route in getattr(request.app.state, "routes", request.app.routes):
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match is not Match.NONE and isinstance(route, BaseRoute):
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(IntakeError)
    async def _intake(_: Request, exc: IntakeError) -> Response:
        err = api_error(exc)
        return error_response(err.status, err.message, err.param)

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> Response:
        err = from_value_error(exc)
        return error_response(err.status, err.message, err.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        field = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {msg}")
        return error_response(400, f"{field}: {msg}" if field else msg, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(allowed_methods(request))
        return response

    @app.exception_handler(ServerUnavailable)
    async def _dead(_: Request, exc: ServerUnavailable) -> Response:
        return error_response(503, f"the server is unavailable: {exc}")

    @app.exception_handler(QueueFull)
    async def _full(_: Request, exc: QueueFull) -> Response:
        response = error_response(429, str(exc), code="queue_full")
        response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
