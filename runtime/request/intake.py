"""The request intake: every API's call becomes single requests here, and is checked here, once.

* ``expand`` turns a call (prompts, their sampling parameters and options, the caller's ``rid``) into one
  ``SingleRequest`` per sequence to generate, in output order (prompt-major, then sample): ``n`` samples,
  request ids, per-sample seeds. ``/generate`` and ``Engine.generate`` reach it through ``from_native``
  (SGLang's GenerateReqInput: one prompt or a batch, per-prompt or shared values), the OpenAI routes and
  the Responses API directly (``runtime/http/completions.py``, ``chat.py``, ``responses.py``).
* ``prepare`` tokenizes a request and runs every check that needs the model (``check``). The HTTP layer and
  the Engine call it before anything is queued, so the scheduler only asserts (``length_refusal`` is the
  one statement of what fits the context and the KV pool: the intake raises it, the scheduler asserts it).

Sampling parameters are validated once, when they are read (``sampling_params``: ``SamplingParams.validate``);
``check`` adds only what needs the vocabulary.

Every refusal is an ``IntakeError`` naming the field in the runtime's spelling; each API maps the names to
its own. ``reject_unsupported`` covers the rest of SGLang's GenerateReqInput: fields of features this
server does not have are accepted at their defaults (what SGLang's clients send) and refused by name
otherwise.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.core.errors import IntakeError
from runtime.core.messages import RequestOptions, TokenizedRequest
from runtime.core.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20


@dataclass
class SingleRequest:
    """One sequence to generate: its prompt (text until ``prepare`` tokenizes it), sampling and options."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)

    def message(self) -> TokenizedRequest:
        """The scheduler's message (after ``prepare``)."""
        assert self.input_ids is not None, "prepare() tokenizes the request first"
        return TokenizedRequest(self.rid, self.input_ids, self.sampling, self.options)


@dataclass
class Expansion:
    """A call as single requests. ``call_id`` is the caller's rid, or a fresh id: every request's rid
    derives from it, and APIs name their response after it (``cmpl-<call_id>``)."""

    call_id: str
    requests: list[SingleRequest]
    is_batch: bool  # answered with a list (a batch of prompts or several samples)


@dataclass(frozen=True)
class Limits:
    """What the served model and the KV pool allow: the intake's checks need nothing else."""

    vocab_size: int
    context_length: int
    kv_capacity: int  # tokens the KV pool holds
    max_n: int  # samples per prompt (the running-request limit: more could never run together)


# ---------------------------------------------------------------------- expansion
def expand(prompts: Sequence[str | list[int]], sampling: Sequence[SamplingParams],
           options: Sequence[RequestOptions], rid: str | Sequence[str] | None, max_n: int,
           batch: bool = False) -> Expansion:
    """One request per prompt and sample. ``rid``: one per prompt, or a base (``<rid>-<prompt>`` when
    there are several prompts); sample ``j`` of ``n > 1`` gets ``<base>-<j>`` and, when seeded, seed + j."""
    assert len(prompts) == len(sampling) == len(options)
    call_id = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
    if isinstance(rid, str) or rid is None:
        bases = [call_id] if len(prompts) == 1 else [f"{call_id}-{p}" for p in range(len(prompts))]
    else:
        if len(rid) != len(prompts):
            raise IntakeError("rid", f"{len(prompts)} prompts need {len(prompts)} rids, got {len(rid)}")
        bases = list(rid)
    out: list[SingleRequest] = []
    seen: set[str] = set()
    for prompt, sp, opts, base in zip(prompts, sampling, options, bases):
        if sp.n > max_n:
            raise IntakeError("n", f"at most {max_n} samples per prompt, got {sp.n}")
        for j in range(sp.n):
            child_rid = base if sp.n == 1 else f"{base}-{j}"
            if child_rid in seen:
                raise IntakeError("rid", f"request id {child_rid!r} is already in use")
            seen.add(child_rid)
            child = replace(sp, n=1, seed=sp.seed + j if sp.seed is not None else None)
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
            out.append(SingleRequest(child_rid, text, ids, child, opts))
    return Expansion(call_id, out, batch or len(out) > 1)


def sampling_params(fields: Mapping[str, Any] | None) -> SamplingParams:
    """SamplingParams from SGLang's ``sampling_params`` object; an IntakeError names a bad field."""
    try:
        return SamplingParams.from_dict(dict(fields or {}))
    except ValueError as exc:
        raise IntakeError.of(exc) from None


# ---------------------------------------------------------------------- SGLang's GenerateReqInput
_MULTIMODAL = "this server serves text-only models"
_DISAGG = "disaggregated prefill and decode is not supported"
_DATA_PARALLEL = "this server has a single data-parallel rank (0)"
# Top-level GenerateReqInput fields that ask for a feature absent here, with the reason given in the 400.
# Fields that only label or route a request (log_metrics, no_logs, custom_labels, routing_key,
# conversation_id, session_id, external_trace_header, received_time) are accepted and ignored, as SGLang
# ignores fields it does not know.
UNSUPPORTED_FIELDS: dict[str, str] = {
    **dict.fromkeys(("image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
                     "use_audio_in_video", "video_config", "modalities", "max_dynamic_patch",
                     "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
                     "mm_processor_kwargs", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls"),
                    _MULTIMODAL),
    "input_embeds": "input embeddings are not supported; send text or input_ids",
    "positional_embed_overrides": "embedding overrides are not supported",
    "lora_path": "LoRA adapters are not supported",
    "lora_id": "LoRA adapters are not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "token_ids_logprob": "logprobs of chosen token ids are not supported; use top_logprobs_num",
    "return_sampling_mask": "sampling masks are not returned by this server",
    "sampling_logprobs_mode": "sampling masks are not returned by this server",
    "return_flat_raw_top_logprobs": "flat top-logprob arrays are not supported",
    "return_flat_raw_output_top_logprobs": "flat top-logprob arrays are not supported",
    "return_flat_raw_top_logprobs_b64": "flat top-logprob arrays are not supported",
    "return_hidden_states": "hidden states are not returned by this server",
    "return_routed_experts": "this server serves dense models",
    "routed_experts_start_len": "this server serves dense models",
    "return_indexer_topk": "indexer top-k is not returned by this server",
    "return_entropy": "entropy is not returned by this server",
    "return_bytes": "this server generates text only",
    "session_params": "sessions are not supported; the radix cache reuses shared prefixes by itself",
    "background": "background requests are not supported",
    "require_reasoning": "reasoning control is not supported",
    "max_thinking_tokens": "thinking budgets are not supported",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "token_indices_to_pool": "pooled scoring is not supported",
    "kv_hints": "KV hints are not supported",
    "watermark": "watermarking is not supported",
    **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                     "decode_tp_size"), _DISAGG),
    **dict.fromkeys(("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"), _DATA_PARALLEL),
}
_ZERO_IS_DEFAULT = {"routed_experts_start_len", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"}


def _is_default(name: str, value: Any) -> bool:
    if value is None or value is False or value == "" or value == {}:
        return True
    if name in _ZERO_IS_DEFAULT and value == 0 and not isinstance(value, bool):
        return True
    # a batch may send one default per prompt, e.g. "lora_path": [null, null]
    return isinstance(value, list) and all(_is_default(name, v) for v in value)


def reject_unsupported(body: dict[str, Any]) -> None:
    """Raises an IntakeError naming the first field that asks for a feature this server does not have."""
    for name, why in UNSUPPORTED_FIELDS.items():
        if name in body and not _is_default(name, body[name]):
            raise IntakeError(name, why)


def _pick(value: Any, i: int, n: int, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != n:
            raise IntakeError(name, f"a batch of {n} prompts needs {n} values, got {len(value)}")
        return value[i]
    return value


def _prompts(text: Any, input_ids: Any) -> tuple[bool, list[str] | list[list[int]]]:
    """(is a batch, the prompts) of ``text`` or ``input_ids``."""
    if (text is None) == (input_ids is None):
        raise IntakeError("text", "give exactly one of a text prompt and input_ids")
    if text is not None:
        if isinstance(text, str):
            return False, [text]
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return True, list(text)
        raise IntakeError("text", "must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in input_ids):
        return False, [input_ids]
    if (isinstance(input_ids, list) and input_ids
            and all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in input_ids)):
        return True, list(input_ids)
    raise IntakeError("input_ids", "must be a non-empty list of token ids or a list of such lists")


def _namespace(salt: Any, key: Any) -> str | None:
    if salt is not None and not isinstance(salt, str):
        raise IntakeError("cache_salt", "must be a string")
    if key is None:
        return salt
    if not isinstance(key, str):
        raise IntakeError("extra_key", "must be a string")
    # SGLang's extra_key isolates cache entries like cache_salt does; both apply when both are given
    return f"{salt or ''}\x00extra_key:{key}"


def from_native(body: Mapping[str, Any], max_n: int) -> Expansion:
    """A ``/generate`` body (or ``Engine.generate``'s arguments, which carry the same names) as requests.
    Per-prompt fields may be a list with one value per prompt or one value for all."""
    batch, prompts = _prompts(body.get("text"), body.get("input_ids"))
    rid = body.get("rid")
    if isinstance(rid, list) and not batch:
        raise IntakeError("rid", "a single prompt takes a single rid")
    priority, timeout = body.get("priority"), body.get("timeout")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise IntakeError("priority", "must be an integer")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise IntakeError("timeout", "must be a number of seconds > 0")
    n = len(prompts)

    def pick(name: str, i: int) -> Any:
        return _pick(body.get(name), i, n, name)

    samplings: list[SamplingParams] = []
    options: list[RequestOptions] = []
    for i in range(n):
        sp_dict = pick("sampling_params", i) or {}
        if not isinstance(sp_dict, dict):
            raise IntakeError("sampling_params", "must be an object")
        samplings.append(sampling_params(sp_dict))
        start = pick("logprob_start_len", i)
        start = -1 if start is None else start
        top = pick("top_logprobs_num", i) or 0
        if not isinstance(start, int) or start < -1:
            raise IntakeError("logprob_start_len", "must be an integer >= -1")
        if not isinstance(top, int):  # its range is every API's: ``check``
            raise IntakeError("top_logprobs_num", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        options.append(RequestOptions(
            return_logprob=bool(pick("return_logprob", i)), logprob_start_len=start, top_logprobs_num=top,
            cache_namespace=_namespace(pick("cache_salt", i), pick("extra_key", i)), priority=priority or 0,
            timeout=float(timeout) if timeout is not None else None, stream=bool(body.get("stream"))))
    return expand(prompts, samplings, options, rid, max_n, batch)


# ---------------------------------------------------------------------- the checks that need the model
def length_refusal(prompt_tokens: int, max_new_tokens: int, limits: Limits,
                   prompt_field: str = "input_ids") -> IntakeError | None:
    """Why a prompt of ``prompt_tokens`` asking for ``max_new_tokens`` more cannot run (None: it can): within
    the context, with room for its first token in the KV pool. The intake raises it; the scheduler asserts
    that nothing it is handed has one."""
    n, ctx = prompt_tokens, limits.context_length
    if n == 0:
        return IntakeError(prompt_field, "the prompt is empty")
    if n >= ctx:
        return IntakeError(prompt_field, f"the prompt has {n} tokens; the model's context length is {ctx}")
    if n + max_new_tokens > ctx:
        return IntakeError("max_new_tokens", f"the prompt has {n} tokens and {max_new_tokens} more were "
                           f"requested, {n + max_new_tokens} in all, over the model's context length of "
                           f"{ctx}; ask for fewer or shorten the prompt")
    if n + 1 > limits.kv_capacity:
        return IntakeError(prompt_field, f"the prompt needs {n + 1} KV tokens but the pool holds "
                           f"{limits.kv_capacity}")
    return None


def check(single: SingleRequest, limits: Limits) -> None:
    """Every check of a tokenized request that needs the model: ids in the vocabulary, the sampling
    parameters' token ids too, the prompt and its output within the context and the KV pool, a grammar
    that compiles; and the logprob alternatives any API may ask for."""
    ids = single.input_ids
    prompt_field = "text" if single.text is not None else "input_ids"
    if not ids:  # before anything else reads the prompt (``length_refusal`` states it too, for the scheduler)
        raise IntakeError(prompt_field, "the prompt is empty")
    vocab = limits.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise IntakeError("input_ids", f"token ids must be in [0, {vocab})")
    sp = single.sampling
    try:
        sp.check_token_ids(vocab)
    except ValueError as exc:
        raise IntakeError.of(exc) from None
    if not 0 <= single.options.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise IntakeError("top_logprobs_num", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    refusal = length_refusal(len(ids), sp.max_new_tokens, limits, prompt_field)
    if refusal is not None:
        raise refusal
    if sp.grammar is not None:
        from runtime.constrained.grammar import validate_grammar

        try:
            validate_grammar(*sp.grammar)
        except ValueError as exc:
            raise IntakeError.of(exc) from None


def prepare(single: SingleRequest, tokenize: Callable[[str], list[int]], limits: Limits) -> None:
    """Tokenize the request (if it came as text) and check it; raises IntakeError."""
    if single.input_ids is None:
        assert single.text is not None
        single.input_ids = tokenize(single.text)
    check(single, limits)
