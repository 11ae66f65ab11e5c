"""Pydantic models of the SGLang-native ``/generate`` body: the types of every field, checked before the
request is expanded (``runtime.request.intake.expand``) and published in ``/openapi.json``.

The models only check JSON types and the ranges a schema can state; what needs the model or the server's
settings (token ids in the vocabulary, the context length, ``n`` against the running-request limit, that a
regex compiles) stays with the intake, so the document never promises more than the server checks. Like
SGLang, ``null`` means the default everywhere, unknown top-level fields are ignored, and an unknown
``sampling_params`` field is an error.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonSchemaValue

from runtime.http.protocol import nullable_properties

StrOrList = str | list[str]


class NativeModel(BaseModel):
    model_config = ConfigDict(strict=True, json_schema_extra=nullable_properties)


class SamplingParamsBody(NativeModel):
    """SGLang's ``sampling_params`` (runtime/core/sampling_params.py holds the meaning and the remaining checks)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=0, description="alias of max_new_tokens")
    min_new_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 (or 2**30 and above): no top-k cut")
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    stop: StrOrList | None = None
    stop_regex: StrOrList | None = None
    stop_token_ids: int | list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = Field(None, ge=1)
    seed: int | None = None
    sampling_seed: int | None = Field(None, description="alias of seed")
    logit_bias: dict[str, float] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    stream_interval: int | None = Field(None, ge=1)
    custom_params: dict[str, Any] | None = Field(None, description="accepted and ignored")
    beam_width: int | None = Field(None, description="only 1 (no beam search)")
    watermark: Any = Field(None, description="only off")
    choice: list[Any] | None = Field(None, description="only empty")


class GenerateRequest(NativeModel):
    """One prompt (``text`` or ``input_ids``) or a batch; per-prompt lists or one shared value for the rest."""

    model_config = ConfigDict(extra="allow")
    text: StrOrList | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    rid: StrOrList | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool | None = None
    return_prompt_token_ids: bool | None = None
    stream: bool | None = None
    cache_salt: StrOrList | None = None
    extra_key: StrOrList | None = None
    priority: int | None = Field(None, description="higher runs first with --enable-priority-scheduling")
    timeout: float | None = Field(None, gt=0, description="seconds; past it the request is aborted (408)")


class GenerateResult(BaseModel):
    """One generated sequence (a batch answers a list of these; a stream sends them as SSE frames)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any] = Field(description="id, finish_reason, prompt/completion/cached tokens, "
                                      "e2e_latency and, when asked for, logprobs")


def generate_response_schema(ref: str) -> JsonSchemaValue:
    return {"anyOf": [{"$ref": ref}, {"type": "array", "items": {"$ref": ref}}]}
