"""The ``/generate`` request (SGLang's GenerateReqInput) normalised into single requests.

A request may carry one prompt or a batch (``text`` or ``input_ids``), per-prompt or shared
``sampling_params`` / ``rid`` / logprob options, and ``n`` samples per prompt. ``expand`` returns one
``SingleRequest`` per sequence to generate, in output order (prompt-major, then sample), so the Engine
and the HTTP layer share the same rules and error messages.

``reject_unsupported`` covers the rest of SGLang's GenerateReqInput: fields of features this server does
not have are accepted at their defaults (what SGLang's clients send) and refused by name otherwise.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from runtime.core.sampling_params import SamplingParams


@dataclass
class SingleRequest:
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str | None = None
    priority: int = 0  # higher runs first when the server schedules by priority
    timeout: float | None = None  # seconds from arrival; past it the request is aborted and its KV freed


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
    """Raises ValueError naming the first field that asks for a feature this server does not have."""
    for name, why in UNSUPPORTED_FIELDS.items():
        if name in body and not _is_default(name, body[name]):
            raise ValueError(f"{name}: {why}")


def _pick(value: Any, i: int, n: int, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: a batch of {n} prompts needs {n} values, got {len(value)}")
        return value[i]
    return value


def expand(
    text: str | list[str] | None = None,
    input_ids: list[int] | list[list[int]] | None = None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
    rid: str | list[str] | None = None,
    return_logprob: bool | list[bool] | None = None,
    logprob_start_len: int | list[int] | None = None,
    top_logprobs_num: int | list[int] | None = None,
    cache_salt: str | list[str] | None = None,
    priority: int | None = None,
    timeout: float | None = None,
    max_n: int = 256,
    extra_key: str | list[str] | None = None,
) -> tuple[bool, list[SingleRequest]]:
    """Returns (is_batch, requests)."""
    if (text is None) == (input_ids is None):
        raise ValueError("text: give exactly one of text and input_ids")
    prompts: list[Any]
    if text is not None:
        if isinstance(text, str):
            batch, prompts = False, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            batch, prompts = True, list(text)
        else:
            raise ValueError("text: must be a string or a non-empty list of strings")
    else:
        if isinstance(input_ids, list) and input_ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in input_ids):
            batch, prompts = False, [input_ids]
        elif (isinstance(input_ids, list) and input_ids
              and all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in input_ids)):
            batch, prompts = True, list(input_ids)
        else:
            raise ValueError("input_ids: must be a non-empty list of token ids or a list of such lists")
    if isinstance(rid, list) and not batch:
        raise ValueError("rid: a single prompt takes a single rid")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise ValueError("priority: must be an integer")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError("timeout: must be a number of seconds > 0")
    n_prompts = len(prompts)
    out: list[SingleRequest] = []
    for i, prompt in enumerate(prompts):
        sp_dict = _pick(sampling_params, i, n_prompts, "sampling_params") or {}
        if not isinstance(sp_dict, dict):
            raise ValueError("sampling_params: must be an object")
        sp = SamplingParams.from_dict(sp_dict)
        if sp.n > max_n:
            raise ValueError(f"n: at most {max_n} samples per prompt, got {sp.n}")
        base_rid = _pick(rid, i, n_prompts, "rid") or uuid.uuid4().hex
        lp = bool(_pick(return_logprob, i, n_prompts, "return_logprob") or False)
        start = _pick(logprob_start_len, i, n_prompts, "logprob_start_len")
        top = _pick(top_logprobs_num, i, n_prompts, "top_logprobs_num") or 0
        if start is None:
            start = -1
        if not isinstance(start, int) or start < -1:
            raise ValueError("logprob_start_len: must be an integer >= -1")
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise ValueError("top_logprobs_num: must be an integer in [0, 20]")
        salt = _pick(cache_salt, i, n_prompts, "cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt: must be a string")
        key = _pick(extra_key, i, n_prompts, "extra_key")
        if key is not None:
            if not isinstance(key, str):
                raise ValueError("extra_key: must be a string")
            # SGLang's extra_key isolates cache entries like cache_salt does; both apply when both are given
            salt = f"{salt or ''}\x00extra_key:{key}"
        for j in range(sp.n):
            child = replace(sp, n=1, seed=sp.seed + j if sp.seed is not None else None)
            child_rid = base_rid if sp.n == 1 else f"{base_rid}-{j}"
            out.append(SingleRequest(
                rid=child_rid,
                text=prompt if text is not None else None,
                input_ids=prompt if text is None else None,
                sampling=child,
                return_logprob=lp,
                logprob_start_len=start,
                top_logprobs_num=top,
                cache_salt=salt,
                priority=priority or 0,
                timeout=float(timeout) if timeout is not None else None,
            ))
    return batch or len(out) > 1, out


def check_single(single: SingleRequest, vocab_size: int, context_length: int) -> None:
    """Checks of a tokenized request that need the model: ids in the vocabulary, the length within the
    context, a valid grammar. Raises ValueError naming the field (HTTP 400)."""
    ids = single.input_ids
    if not ids:
        raise ValueError("text: the prompt is empty")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise ValueError(f"input_ids: token ids must be in [0, {vocab_size})")
    sp = single.sampling
    sp.validate(vocab_size)
    need = len(ids) + sp.max_new_tokens
    if need > context_length:
        raise ValueError(
            f"max_new_tokens: the prompt has {len(ids)} tokens and {sp.max_new_tokens} more were requested, "
            f"{need} in all, over the context length of {context_length}")
    if sp.grammar is not None:
        from runtime.constrained.grammar import validate_grammar

        validate_grammar(*sp.grammar)
