"""Pydantic models of the SGLang-native ``/generate`` body: the types of every field, checked before the
request is expanded (``runtime.request.intake.expand``) and published in ``/openapi.json``.

The models check JSON types only. The ranges are published in the schema (``schema_range``) and checked once,
by the runtime: ``SamplingParams.validate`` and the intake, which the Engine shares. What needs the model or
the server's settings (token ids in the vocabulary, the context length, ``n`` against the running-request
limit, that a regex compiles) stays with the intake, so the document never promises more than the server
checks. Like
SGLang, ``null`` means the default everywhere, unknown top-level fields are ignored, and an unknown
``sampling_params`` field is an error.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonSchemaValue

from runtime.http.protocol import Count, Penalty, Positive, nullable_properties, schema_range

StrOrList = str | list[str]


class NativeModel(BaseModel):
    model_config = ConfigDict(strict=True, json_schema_extra=nullable_properties)


class SamplingParamsBody(NativeModel):
    """SGLang's ``sampling_params`` (runtime/core/sampling_params.py holds the meaning and the remaining checks)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: Count | None = None
    max_tokens: Count | None = Field(None, description="alias of max_new_tokens")
    min_new_tokens: Count | None = None
    temperature: Annotated[float, schema_range(float, minimum=0, maximum=100)] | None = None
    top_p: Annotated[float, schema_range(float, exclusiveMinimum=0, maximum=1)] | None = None
    top_k: Annotated[int, schema_range(int, minimum=-1)] | None = Field(
        None, description="-1 (or 2**30 and above): no top-k cut")
    min_p: Annotated[float, schema_range(float, minimum=0, maximum=1)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, schema_range(float, exclusiveMinimum=0, maximum=2)] | None = None
    stop: StrOrList | None = None
    stop_regex: StrOrList | None = None
    stop_token_ids: int | list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Positive | None = None
    seed: int | None = None
    sampling_seed: int | None = Field(None, description="alias of seed")
    logit_bias: dict[str, float] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    stream_interval: Positive | None = None
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
    timeout: Annotated[float, schema_range(float, exclusiveMinimum=0)] | None = Field(
        None, description="seconds; past it the request is aborted (408)")


class GenerateResult(BaseModel):
    """One generated sequence (a batch answers a list of these; a stream sends them as SSE frames)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any] = Field(description="id, finish_reason, prompt/completion/cached tokens, "
                                      "e2e_latency and, when asked for, logprobs")


def generate_response_schema(ref: str) -> JsonSchemaValue:
    return {"anyOf": [{"$ref": ref}, {"type": "array", "items": {"$ref": ref}}]}
