"""``POST /v1/completions``: parse → intake → wait or stream → format.

Each prompt and sample becomes one request through the intake's expansion (prompt-major: choice
``index = prompt_index * n + j``; sample j of a seeded request uses seed + j; SGLang's ``rid`` names the
call, answered as ``cmpl-<rid>``). The intake's refusals name fields as this API does
(``COMPLETION_NAMES``). A stream sends each choice's new text, and the logprobs not sent before, as it
grows; ``echo`` puts the prompt before the first piece.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from runtime.core.messages import RequestOptions
from runtime.core.sampling_params import SamplingParams
from runtime.http.common import read_request, served_model, tm_of, token_text
from runtime.http.delivery import (
    Updates,
    client_closed,
    json_response,
    open_stream,
    sse,
    stream_response,
    submit_all,
    wait,
)
from runtime.http.errors import APIError, fields_named, raise_if_rejected
from runtime.http.openai_format import (
    Envelope,
    TokenText,
    completion_logprobs,
    finish_reason,
    new_id,
    pad,
    usage,
    visible_output_len,
)
from runtime.http.protocol import CompletionRequest
from runtime.request.intake import expand, sampling_params
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import TokenizerManager

router = APIRouter()

# The runtime's field names -> this API's
COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt",
                    "text": "prompt", "top_logprobs_num": "logprobs"}
DEFAULT_MAX_TOKENS = 16


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    tm = tm_of(request)
    # parse
    req = await read_request(request, CompletionRequest)
    model = served_model(request, req.model)
    check_supported(req)
    texts, prompts = completion_prompts(tm, req.prompt, req.echo)
    # intake
    k = req.logprobs
    options = RequestOptions(return_logprob=k is not None, logprob_start_len=0 if req.echo and k is not None else -1,
                             top_logprobs_num=k or 0, cache_namespace=req.cache_salt, stream=req.stream)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    with fields_named(COMPLETION_NAMES):
        sp = sampling_params({**req.sampling_dict(), "max_new_tokens": max_tokens, "n": req.n})
        call = expand(prompts, [sp] * len(prompts), [options] * len(prompts), req.rid, tm.limits.max_n)
        handles = await submit_all(tm, call.requests)
    shape = Shape(Envelope(new_id("cmpl", call.call_id), model, req.include_usage), texts, req.n, req.echo, k,
                  token_text(request), sp)
    # stream
    if req.stream:
        updates = await open_stream(request, tm, handles)
        if updates is None:
            return client_closed()
        return stream_response(tm, handles, updates, chunks(shape, updates, len(handles)))
    # wait, format
    states = await wait(request, tm, handles)
    if states is None:
        return client_closed()
    return json_response(completion(shape, states))


# ---------------------------------------------------------------------- parse
def check_supported(req: CompletionRequest) -> None:
    if req.suffix:
        raise APIError(400, "suffix: inserting text before a suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of: only best_of equal to n is supported (server-side ranking is not), "
                       f"got best_of={req.best_of} and n={req.n}", "best_of")


def completion_prompts(tm: TokenizerManager, prompt: Any, echo: bool) -> tuple[list[str], list[list[int]]]:
    """(prompt texts for echo, token ids) of each prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        return list(prompt), [tm.tokenize(p) for p in prompt]
    return [tm.tokenizer.decode(ids) if echo else "" for ids in prompt], [list(ids) for ids in prompt]


# ---------------------------------------------------------------------- format
@dataclass
class Shape:
    """How this call's answer looks: what formatting needs besides the requests' states."""

    env: Envelope
    texts: list[str]  # each prompt's text (for echo)
    n: int
    echo: bool
    k: int | None  # ``logprobs``: None for none, else this many alternatives per token
    tt: TokenText
    sampling: SamplingParams


@dataclass
class Sent:
    """What one choice of a stream has sent so far."""

    text: int = 0  # characters of the cumulative text
    logprobs: int = 0  # output logprob entries
    prompt_logprobs: int = 0  # prompt logprob entries (echo)
    offset: int = 0  # legacy text_offset of the next token
    started: bool = False
    done: bool = False


def logprobs(shape: Shape, st: RequestState, sent: Sent | None) -> dict[str, Any] | None:
    """All of a choice's logprobs (``sent`` None), or those a stream has not sent yet (``sent`` moves on)."""
    k = shape.k
    if k is None:
        return None
    n_out = visible_output_len(st, shape.sampling) if st.finished else len(st.output_logprobs)
    n_in = len(st.input_logprobs) if shape.echo else 0
    in_from, out_from = (sent.prompt_logprobs, sent.logprobs) if sent else (0, 0)
    entries = st.input_logprobs[in_from:n_in] + st.output_logprobs[out_from:n_out]
    tops = pad(st.input_top, n_in)[in_from:] + pad(st.output_top, n_out)[out_from:]
    if sent is None:
        return completion_logprobs(entries, tops, k, shape.tt)
    sent.prompt_logprobs, sent.logprobs = n_in, max(out_from, n_out)
    if not entries:
        return None
    lp = completion_logprobs(entries, tops, k, shape.tt, sent.offset)
    sent.offset += sum(len(t) for t in lp["tokens"])
    return lp


def completion(shape: Shape, states: list[RequestState]) -> dict[str, Any]:
    """The whole ``text_completion`` object."""
    choices = [{"index": i, "text": (shape.texts[i // shape.n] if shape.echo else "") + st.text,
                "logprobs": logprobs(shape, st, None), "finish_reason": finish_reason(st)}
               for i, st in enumerate(states)]
    return shape.env.wrap("text_completion", choices, usage=usage(states, shape.n))


def chunk_choice(shape: Shape, i: int, st: RequestState, sent: Sent) -> dict[str, Any] | None:
    """The choice of the next stream chunk for choice ``i`` (None: nothing new to send)."""
    if sent.done:
        return None
    text = st.text[sent.text:]
    sent.text = max(sent.text, len(st.text))
    if shape.echo and not sent.started:
        text = shape.texts[i // shape.n] + text
    sent.started = True
    lp = logprobs(shape, st, sent)
    if st.finished is not None:
        raise_if_rejected(st)
        sent.done = True
    elif not text and lp is None:
        return None
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason(st)}


async def chunks(shape: Shape, updates: Updates, count: int) -> AsyncIterator[bytes]:
    """The stream's frames: one chunk per update that has something new, then usage when asked for."""
    sent = [Sent() for _ in range(count)]
    last: list[RequestState] = [updates.first[1]] * count
    async for i, st in updates:
        last[i] = st
        choice = chunk_choice(shape, i, st, sent[i])
        if choice is not None:
            yield sse(shape.env.chunk("text_completion", [choice]))
    if shape.env.include_usage:
        yield sse(shape.env.usage_chunk("text_completion", usage(last, shape.n)))
