"""The request intake without a server: one expansion of a call into requests (rids, samples, seeds), the
checks that need the model, and how each API names the fields of a refusal."""

from __future__ import annotations

import pytest

from runtime.core.errors import IntakeError
from runtime.core.messages import AbortCause, FinishReason, RequestOptions
from runtime.core.sampling_params import SamplingParams
from runtime.http.completions import COMPLETION_NAMES
from runtime.http.errors import abort_status, api_error
from runtime.request.intake import Limits, SingleRequest, check, expand, from_native

LIMITS = Limits(vocab_size=100, context_length=64, kv_capacity=48, max_n=4)


def field_of(fn, *args) -> str | None:  # type: ignore[no-untyped-def]
    with pytest.raises(IntakeError) as err:
        fn(*args)
    assert str(err.value) == f"{err.value.field}: {err.value.detail}"
    return err.value.field


# ---------------------------------------------------------------------- expansion
def test_samples_get_derived_rids_and_seeds() -> None:
    call = expand([[1, 2]], [SamplingParams(n=3, seed=10)], [RequestOptions()], "abc", max_n=4)
    assert call.call_id == "abc" and call.is_batch
    assert [r.rid for r in call.requests] == ["abc-0", "abc-1", "abc-2"]
    assert [r.sampling.seed for r in call.requests] == [10, 11, 12]
    assert all(r.sampling.n == 1 for r in call.requests)


def test_prompts_of_one_rid_are_numbered_and_a_list_names_each() -> None:
    sp, opts = [SamplingParams()] * 2, [RequestOptions()] * 2
    assert [r.rid for r in expand(["a", "b"], sp, opts, "x", 4).requests] == ["x-0", "x-1"]
    assert [r.rid for r in expand(["a", "b"], sp, opts, ["p", "q"], 4).requests] == ["p", "q"]
    fresh = expand(["a", "b"], sp, opts, None, 4)
    assert [r.rid for r in fresh.requests] == [f"{fresh.call_id}-0", f"{fresh.call_id}-1"]
    one = expand(["a"], sp[:1], opts[:1], None, 4)
    assert not one.is_batch and one.requests[0].rid == one.call_id and one.requests[0].text == "a"


def test_expansion_refusals_name_their_field() -> None:
    sp, opts = [SamplingParams()] * 2, [RequestOptions()] * 2
    assert field_of(expand, ["a", "b"], sp, opts, ["p"], 4) == "rid"
    assert field_of(expand, ["a", "b"], sp, opts, ["p", "p"], 4) == "rid"
    assert field_of(expand, ["a"], [SamplingParams(n=5)], opts[:1], None, 4) == "n"


def test_native_per_prompt_values_and_options() -> None:
    call = from_native({"text": ["a", "b"], "return_logprob": [True, False], "top_logprobs_num": 2,
                        "cache_salt": "s", "extra_key": "k", "priority": 3, "timeout": 1, "stream": True,
                        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 5}]}, 4)
    first, second = call.requests
    assert first.options.return_logprob and not second.options.return_logprob
    assert first.options.top_logprobs_num == second.options.top_logprobs_num == 2
    assert first.options.cache_namespace == "s\x00extra_key:k" and first.options.priority == 3
    assert first.options.timeout == 1.0 and first.options.stream
    assert [r.sampling.max_new_tokens for r in call.requests] == [2, 5]


@pytest.mark.parametrize(("body", "field"), [
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": "a", "rid": ["x", "y"]}, "rid"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
    ({"text": "a", "top_logprobs_num": "2"}, "top_logprobs_num"),
    ({"text": "a", "timeout": 0}, "timeout"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"n": 9}}, "n"),
])
def test_native_refusals(body: dict, field: str) -> None:
    assert field_of(from_native, body, 4) == field


# ---------------------------------------------------------------------- the checks that need the model
def single(ids: list[int], text: str | None = None, **sampling: object) -> SingleRequest:
    return SingleRequest("r", text, ids, SamplingParams(**sampling))  # type: ignore[arg-type]


def test_a_request_within_the_limits_passes() -> None:
    check(single(list(range(30)), max_new_tokens=34), LIMITS)


@pytest.mark.parametrize(("req", "field"), [
    (single([]), "input_ids"),
    (single([], text=""), "text"),
    (single([100]), "input_ids"),  # outside the vocabulary
    (single([1], logit_bias={200: 1.0}), "logit_bias"),
    (single([1] * 64, max_new_tokens=0), "input_ids"),  # the prompt alone fills the context
    (single([1] * 64, text="long", max_new_tokens=0), "text"),
    (single([1] * 30, max_new_tokens=35), "max_new_tokens"),
    (single([1] * 50, max_new_tokens=1), "input_ids"),  # within the context, over the KV pool
    (single([1], regex="([", max_new_tokens=4), "regex"),
    (SingleRequest("r", None, [1], SamplingParams(max_new_tokens=4), RequestOptions(top_logprobs_num=21)),
     "top_logprobs_num"),  # every API's logprob alternatives, however the API spells the field
])
def test_refusals_name_the_field(req: SingleRequest, field: str) -> None:
    assert field_of(check, req, LIMITS) == field


# ---------------------------------------------------------------------- what only the HTTP layer knows
def test_each_api_names_the_field_its_way() -> None:
    err = api_error(IntakeError("max_new_tokens", "too many"), COMPLETION_NAMES)
    assert (err.status, err.param, err.message) == (400, "max_tokens", "max_tokens: too many")
    same = api_error(IntakeError("regex", "bad"), COMPLETION_NAMES)
    assert (same.param, same.message) == ("regex", "regex: bad")


def test_only_http_turns_abort_causes_into_statuses() -> None:
    assert abort_status(FinishReason("abort", message="late", cause=AbortCause.TIMEOUT)) == 408
    assert abort_status(FinishReason("abort", message="bad", cause=AbortCause.INVALID)) == 400
    assert abort_status(FinishReason("abort", message="bye", cause=AbortCause.CLIENT)) is None
    assert abort_status(FinishReason("length", length=3)) is None
    assert FinishReason("abort", message="late", cause=AbortCause.TIMEOUT).to_json() == {
        "type": "abort", "message": "late"}
