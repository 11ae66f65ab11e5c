"""Pydantic models of the OpenAI-compatible requests (``/v1/completions``, ``/v1/chat/completions``).

Validation is strict (JSON types are not coerced: ``"1"`` is not a number, ``true`` is not an integer), so
a wrong type is a 400 through the app's RequestValidationError handler. Unknown fields are accepted and
ignored, as OpenAI clients send many optional ones; SGLang's sampling extensions (``top_k``, ``min_p``,
``regex``, ``cache_salt``, ``rid``, ...) are honoured. The schema states OpenAI's ranges. A range the runtime
checks anyway (``SamplingParams.validate``, the intake) is published only (``schema_range``), so each rule is
checked once, where every API and the Engine meet it; the models check only the ranges that are this API's
own (``temperature`` at most 2, ``max_tokens`` at least 1 on chat, ``logprobs`` at most 5). The remaining
checks (token ids in the vocabulary, the context length, ``n`` against the server's limits) happen at the
intake.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import WithJsonSchema
from pydantic_core import PydanticCustomError

from runtime.request.intake import MAX_TOP_LOGPROBS


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _invalid(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, message)


def schema_range(number: type[int] | type[float], **bounds: float) -> WithJsonSchema:
    """The schema of a number whose range the runtime checks: ``minimum``, ``maximum``, ``exclusiveMinimum``
    are published in /openapi.json and not checked by the model (which checks the type), so the 400 comes
    from the one check of the rule, naming the field as the API does."""
    return WithJsonSchema({"type": "integer" if number is int else "number", **bounds})


# OpenAI's temperature is at most 2 (the model checks that bound: the runtime allows up to 100); at least 0 is
# the runtime's rule.
OpenAITemperature = Annotated[float, Field(le=2), schema_range(float, minimum=0, maximum=2)]
# OpenAI's top_p may be 0 (read as greedy, see ``sampling_dict``); the runtime refuses the rest of what is
# outside [0, 1].
OpenAITopP = Annotated[float, schema_range(float, minimum=0, maximum=1)]
Penalty = Annotated[float, schema_range(float, minimum=-2, maximum=2)]
Count = Annotated[int, schema_range(int, minimum=0)]
Positive = Annotated[int, schema_range(int, minimum=1)]


def nullable_properties(schema: dict[str, Any], *_: Any) -> None:
    """JSON-schema hook: every optional property also accepts null, which these endpoints read as "the
    default" (a required one sent as null is missing)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        variants = prop.get("anyOf")
        if variants is not None:
            if {"type": "null"} not in variants:
                variants.append({"type": "null"})
            continue
        if not any(k in prop for k in ("type", "$ref", "allOf", "enum", "const")):
            continue  # already any value (an untyped field)
        inner = {k: prop.pop(k) for k in list(prop) if k not in ("title", "description", "default")}
        prop["anyOf"] = [inner, {"type": "null"}]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True,
                              json_schema_extra=nullable_properties)

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        """``"field": null`` means the default, as OpenAI treats it (``"n": null`` is n = 1)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields both endpoints share: OpenAI's sampling parameters and SGLang's extensions."""

    model: str | None = None  # None: the served model
    n: Positive = 1
    stop: Any = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array",
                                                                       "items": {"type": "string"}}]})
    seed: int | None = None
    temperature: OpenAITemperature | None = None
    top_p: OpenAITopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    cache_salt: str | None = None
    rid: str | list[str] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise _invalid("stop_type", "must be a string or a list of strings")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_dict(self) -> dict[str, Any]:
        """The shared fields in SamplingParams' names (None: the SamplingParams default)."""
        top_p, top_k = self.top_p, self.top_k
        if top_p == 0:  # the limit of top-p sampling: keep only the most likely token
            top_p, top_k = 1.0, 1
        fields = {
            "stop": self.stop, "seed": self.seed, "temperature": self.temperature, "top_p": top_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias, "top_k": top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
            "regex": self.regex, "json_schema": self.json_schema, "ebnf": self.ebnf,
        }
        return {k: v for k, v in fields.items() if v is not None}


class CompletionRequest(SamplingFields):
    prompt: Any = Field(json_schema_extra={"anyOf": [  # checked below
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1}, "minItems": 1}]})
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if all(_is_int(t) for t in v):
                return v
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in v):
                return v
        if isinstance(v, list) and not v:
            raise _invalid("prompt_empty", "must not be empty")
        raise _invalid("prompt_type", "must be a string, a list of strings, a list of token ids "
                       "or a list of lists of token ids")


class ChatMessage(BaseModel):
    """One message; fields other than these (``name``, ``reasoning_content``...) go to the template as-is."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | list of {"type": "text", "text": ...} parts | None (checked below)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise _invalid("content_type", "must be a string or a list of content parts")
        for i, part in enumerate(v):
            if not isinstance(part, dict):
                raise _invalid("content_type", f"part {i} must be an object")
            if part.get("type") != "text":
                raise _invalid("content_part", f"part {i}: only 'text' content parts are supported, "
                               f"got type {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise _invalid("content_part", f"part {i}: 'text' must be a string")
        return v

    def content_text(self) -> str | None:
        """The content as one string (text parts joined with newlines)."""
        if isinstance(self.content, list):
            return "\n".join(p["text"] for p in self.content)
        return self.content

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: ``developer`` becomes ``system``, content a string,
        ``tool_calls`` / ``tool_call_id`` and any extra fields unchanged."""
        out = self.model_dump(exclude_none=True)
        out["role"] = "system" if self.role == "developer" else self.role
        out["content"] = self.content_text() or ""
        return out


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Annotated[int, schema_range(int, minimum=0, maximum=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # checked by runtime.parsers.tool_formats.check_tools (clear 400s)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    # SGLang / transformers chat-template extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (``chat_template_kwargs``, e.g. ``enable_thinking``)."""
        reserved = {"tools", "template", "add_generation_prompt", "continue_final_message", "tokenize",
                    "chat_template", "conversation", "messages"}
        return {k: v for k, v in (self.chat_template_kwargs or {}).items() if k not in reserved}

    @property
    def max_output(self) -> tuple[str, int | None]:
        """(field name, value) of the output limit the client gave (max_completion_tokens wins)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens
