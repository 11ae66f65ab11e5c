"""What every route handler starts with: the tokenizer manager, the parsed body, the model asked for."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from runtime.http.errors import APIError, validation_failure
from runtime.http.openai_format import TokenText
from runtime.server.tokenizer_manager import TokenizerManager

M = TypeVar("M", bound=BaseModel)


def tm_of(request: Request) -> TokenizerManager:
    return request.app.state.tm


async def read_request(request: Request, model: type[M]) -> M:
    """Parse and validate the body; invalid JSON and wrong types are 400s (RequestValidationError)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else None
        if first is not None and first["type"] == "model_type" and not first["loc"]:
            raise APIError(400, "the request body must be a JSON object") from None
        raise validation_failure(exc) from None


def served_model(request: Request, name: str | None) -> str:
    """The served model's name, for ``name`` being it, its alias "default", or absent; else a 404."""
    served: str = request.app.state.served_model_name
    if name is None or name in (served, "default"):
        return served
    raise APIError(404, f"The model '{name}' does not exist; this server serves '{served}' "
                   "(alias 'default').", "model", "model_not_found")


def token_text(request: Request) -> TokenText:
    """The app's cache of token texts (for logprobs), made on first use."""
    tt = getattr(request.app.state, "openai_token_text", None)
    if tt is None:
        tt = request.app.state.openai_token_text = TokenText(tm_of(request).tokenizer)
    return tt
