"""The detokenizer process: token outputs in, cumulative text out, one batch per scheduler step."""

from __future__ import annotations

import logging
import sys

import zmq

from runtime.config import ServerArgs
from runtime.core.messages import BatchStrOut, BatchTokenOut, ReqTextOutput
from runtime.core.sampling_params import SamplingParams
from runtime.logging_setup import configure_logging
from runtime.request.decode_stream import DecodeStream
from runtime.server.ipc import (
    Endpoints,
    ProcessReady,
    TokenizerChoice,
    decode,
    die_with_parent,
    encode,
    parent_alive,
    pull,
    push,
)

logger = logging.getLogger(__name__)


def run_detokenizer_process(args: ServerArgs, endpoints: Endpoints, parent_pid: int) -> None:
    """Turn the scheduler's token ids into text until the server process is gone.

    It starts with the scheduler and imports its libraries while the model loads, then loads the tokenizer
    with the class the launcher names (:class:`TokenizerChoice`, the scheduler's pick). ``args`` are the
    launcher's as given, not resolved: nothing here reads an 'auto' value."""
    die_with_parent()
    configure_logging(args.log_level, "detokenizer")
    ctx = zmq.Context()
    to_tm = push(ctx, endpoints.tokenizer)
    ready = push(ctx, endpoints.ready)
    try:
        import transformers  # noqa: F401  (the tokenizer's library: imported while the model loads)

        from runtime.models.folders import load_tokenizer

        inbox = pull(ctx, endpoints.detokenizer)
        choice = first_message(inbox, parent_pid)
        if choice is None:
            return
        tokenizer = load_tokenizer(args.tokenizer or args.model, choice.tokenizer_class)
    except Exception as exc:
        logger.exception("the detokenizer could not start")
        ready.send(encode(ProcessReady("detokenizer", {}, error=f"{type(exc).__name__}: {exc}")))
        sys.exit(1)
    ready.send(encode(ProcessReady("detokenizer", {})))
    streams: dict[str, DecodeStream] = {}
    default = SamplingParams()
    while True:
        if not inbox.poll(1000):
            if not parent_alive(parent_pid):
                return
            continue
        batch: BatchTokenOut = decode(inbox.recv())
        texts = []
        for out in batch.outputs:
            stream = streams.get(out.rid)
            if stream is None:
                stream = DecodeStream(tokenizer, out.sampling or default)
                streams[out.rid] = stream
            text = stream.add(out.new_token_ids, out.finished)
            if out.finished is not None:
                del streams[out.rid]
            texts.append(ReqTextOutput(out, text))
        to_tm.send(encode(BatchStrOut(texts)))


def first_message(inbox: zmq.Socket, parent_pid: int) -> TokenizerChoice | None:
    """The launcher's :class:`TokenizerChoice`; None if the launcher is gone before sending it."""
    while not inbox.poll(1000):
        if not parent_alive(parent_pid):
            return None
    choice = decode(inbox.recv())
    if not isinstance(choice, TokenizerChoice):
        raise RuntimeError(f"the detokenizer expected the tokenizer's class first, got {type(choice).__name__}")
    return choice
