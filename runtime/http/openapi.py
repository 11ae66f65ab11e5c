"""The server's ``/openapi.json``: every route's real request body, answers and errors.

The generation routes read their bodies themselves (for OpenAI-shaped errors and streaming), so FastAPI
cannot see their models; this module publishes them: the same pydantic models the routes validate with,
the 200 body (JSON, or an SSE stream where the route streams), and the error statuses each route really
answers with, all in OpenAI's error shape. A route that takes no body declares none. With ``--api-key``
every operation but ``/health`` carries the bearer scheme and its 401.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from runtime.http.native_protocol import GenerateRequest, GenerateResult, generate_response_schema
from runtime.http.protocol import ChatCompletionRequest, CompletionRequest
from runtime.http.responses import ResponsesRequest

REF = "#/components/schemas/{model}"
GENERATION = (400, 408, 429, 503)
OPENAI_GENERATION = (400, 404, 408, 429, 503)
ERROR_DESCRIPTIONS = {
    400: "Invalid request (the error names the field in `param`)",
    401: "Missing or invalid API key",
    404: "Unknown model or resource",
    408: "The request ran past its timeout and was aborted",
    429: "The waiting queue is full; retry after `Retry-After` seconds",
    503: "The server lost or hung a process and is shutting down",
}


# ---------------------------------------------------------------------- bodies the routes answer with
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AbortBody(BaseModel):
    rid: str = Field(min_length=1, description="id of the request to abort")


class Message(BaseModel):
    message: str


class HealthStatus(BaseModel):
    status: str


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class CompletionResponse(BaseModel):
    """A text or chat completion (``object``: text_completion or chat.completion)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseObject(BaseModel):
    id: str
    object: str
    created_at: float
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class DeletedResponse(BaseModel):
    id: str
    object: str
    deleted: bool


class ModelInfo(BaseModel):
    model_path: str
    context_length: int
    vocab_size: int


class ServerInfo(BaseModel):
    num_running_reqs: int
    num_waiting_reqs: int
    kv: dict[str, Any]


MODELS: list[type[BaseModel]] = [GenerateRequest, GenerateResult, CompletionRequest, ChatCompletionRequest,
                                 ResponsesRequest, ErrorResponse, AbortBody, Message, HealthStatus, ModelList,
                                 CompletionResponse, ResponseObject, DeletedResponse, ModelInfo, ServerInfo]


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


# With "stream": true: server-sent events whose data is one JSON chunk each (the native and chat/completion
# streams end with "data: [DONE]"; the Responses stream names each event).
SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "data": {"type": "string", "description": "a JSON object, or [DONE]"},
    "id": {"type": "string"}}}}}

# (method, path) -> (request model or None, 200 content, error statuses)
ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, dict[str, Any], tuple[int, ...]]] = {
    ("post", "/generate"): (GenerateRequest, {**json_content(generate_response_schema(REF.format(
        model="GenerateResult"))), **SSE}, GENERATION),
    ("post", "/v1/completions"): (CompletionRequest, {**json_content(ref(CompletionResponse)), **SSE},
                                  OPENAI_GENERATION),
    ("post", "/v1/chat/completions"): (ChatCompletionRequest, {**json_content(ref(CompletionResponse)), **SSE},
                                       OPENAI_GENERATION),
    ("post", "/v1/responses"): (ResponsesRequest, {**json_content(ref(ResponseObject)), **SSE}, OPENAI_GENERATION),
    ("get", "/v1/responses/{response_id}"): (None, json_content(ref(ResponseObject)), (404,)),
    ("delete", "/v1/responses/{response_id}"): (None, json_content(ref(DeletedResponse)), (404,)),
    ("get", "/v1/models"): (None, json_content(ref(ModelList)), ()),
    ("get", "/v1/models/{model_id}"): (None, json_content(ref(ModelCard)), (404,)),
    ("get", "/get_model_info"): (None, json_content(ref(ModelInfo)), ()),
    ("get", "/model_info"): (None, json_content(ref(ModelInfo)), ()),
    ("get", "/get_server_info"): (None, json_content(ref(ServerInfo)), (503,)),
    ("get", "/server_info"): (None, json_content(ref(ServerInfo)), (503,)),
    ("get", "/health"): (None, json_content(ref(HealthStatus)), (503,)),
    ("get", "/health_generate"): (None, json_content(ref(HealthStatus)), (503,)),
    ("get", "/flush_cache"): (None, json_content(ref(Message)), (400, 503)),
    ("post", "/flush_cache"): (None, json_content(ref(Message)), (400, 503)),
    ("post", "/abort_request"): (AbortBody, json_content(ref(Message)), (400,)),
    ("get", "/metrics"): (None, {"text/plain": {"schema": {"type": "string"}}}, ()),
}
OPEN_PATHS = {"/health"}
# Integer fields whose upper bound is a server setting: (schema, property, which limit).
LIMITED = [("SamplingParamsBody", "max_new_tokens", "context"), ("SamplingParamsBody", "max_tokens", "context"),
           ("SamplingParamsBody", "min_new_tokens", "context"), ("SamplingParamsBody", "n", "running"),
           ("CompletionRequest", "max_tokens", "context"), ("CompletionRequest", "n", "running"),
           ("ChatCompletionRequest", "max_tokens", "context"), ("ChatCompletionRequest", "n", "running"),
           ("ChatCompletionRequest", "max_completion_tokens", "context"),
           ("ResponsesRequest", "max_output_tokens", "context")]


def _set_maximum(schemas: dict[str, Any], limits: dict[str, int]) -> None:
    for name, prop, which in LIMITED:
        node = schemas[name]["properties"][prop]
        for variant in node.get("anyOf", [node]):
            if variant.get("type") == "integer":
                variant["maximum"] = limits[which]


def build(app: FastAPI, api_key: bool, limits: dict[str, int]) -> dict[str, Any]:
    """``limits``: "context" (the context length in tokens) and "running" (most requests decoding at once)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="radixserve: SGLang-native and OpenAI-compatible generation over a radix-tree "
                      "KV cache. Errors use OpenAI's shape.")
    _, defs = models_json_schema([(m, "validation") for m in MODELS], ref_template=REF)
    doc.setdefault("components", {})["schemas"] = defs["$defs"]
    _set_maximum(doc["components"]["schemas"], limits)
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            body, ok, errors = ROUTES.get((method, path), (None, None, ()))
            responses: dict[str, Any] = {"200": {"description": "Success", "content": ok}} if ok else \
                {k: v for k, v in op["responses"].items() if k.startswith("2")}
            if body is not None:
                op["requestBody"] = {"required": True, "content": json_content(ref(body))}
            statuses = set(errors)
            if body is not None or "parameters" in op:
                statuses.add(400)  # malformed JSON, wrong types, bad path parameters
            if api_key and path not in OPEN_PATHS:
                statuses.add(401)
                op["security"] = [{"bearer": []}]
            for status in sorted(statuses):
                responses[str(status)] = {"description": ERROR_DESCRIPTIONS[status],
                                          "content": json_content(ref(ErrorResponse))}
            op["responses"] = responses
    # The id a created response answers with is what GET / DELETE /v1/responses/{id} take (for clients and
    # for stateful test generators that follow links).
    by_id = "#/paths/~1v1~1responses~1{response_id}/"
    created = doc["paths"].get("/v1/responses", {}).get("post", {}).get("responses", {}).get("200")
    if created is not None:
        created["links"] = {verb: {"operationRef": by_id + verb.lower(),
                                   "parameters": {"response_id": "$response.body#/id"}}
                            for verb in ("GET", "DELETE")}
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shapes: answered as 400 here
        doc["components"]["schemas"].pop(unused, None)
    return doc


def install_openapi(app: FastAPI, api_key: bool, context_length: int, max_running_requests: int) -> None:
    limits = {"context": context_length, "running": max_running_requests}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, api_key, limits)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
