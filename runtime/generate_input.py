"""The ``/generate`` request (SGLang's GenerateReqInput) normalised into single requests.

A request may carry one prompt or a batch (``text`` or ``input_ids``), per-prompt or shared
``sampling_params`` / ``rid`` / logprob options, and ``n`` samples per prompt. ``expand`` returns one
``SingleRequest`` per sequence to generate, in output order (prompt-major, then sample), so the Engine
and the HTTP layer share the same rules and error messages.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from runtime.sampling_params import SamplingParams


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
    max_n: int = 256,
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
