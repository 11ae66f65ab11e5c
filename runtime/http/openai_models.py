"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.http.common import served_model, tm_of
from runtime.http.delivery import json_response
from runtime.http.openai_format import now

router = APIRouter()
STARTED = now()


def model_card(request: Request) -> dict[str, Any]:
    return {"id": request.app.state.served_model_name, "object": "model", "created": STARTED,
            "owned_by": "radixserve", "max_model_len": tm_of(request).context_length}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": [model_card(request)]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    served_model(request, model_id)
    return json_response(model_card(request))
