"""The scheduler process: loads the model, builds the Scheduler and runs the shared ``SchedulerLoop`` over ZMQ.

The loop (``runtime/server/scheduler_loop.py``, the one the in-process Engine runs too) drains every queued
message before each step, sends each step's outputs as one batch to the detokenizer, answers control
queries and pushes a status message to the tokenizer manager about twice a second. This module only starts
it: the model, the KV-event publisher (``--kv-events-port``), readiness, and exit on failure.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from runtime.config import ServerArgs
from runtime.logging_setup import configure_logging
from runtime.server.ipc import Endpoints, ProcessReady, die_with_parent, encode, push

if TYPE_CHECKING:  # the launcher imports this module to name the process's target; torch stays out of it
    from runtime.server.scheduler_loop import SchedulerLoop
    from runtime.server.transports import ZmqTransport

logger = logging.getLogger(__name__)


def run_scheduler_process(args: ServerArgs, endpoints: Endpoints, parent_pid: int) -> None:
    die_with_parent()
    configure_logging(args.log_level, "scheduler")
    ctx = zmq.Context()
    to_tm = push(ctx, endpoints.tokenizer)
    ready = push(ctx, endpoints.ready)
    try:
        from runtime.server.transports import ZmqTransport

        args = args.resolve()  # the launcher passes them as given; it adopts this resolution (ProcessReady.args)
        loop, info = build_loop(args, ZmqTransport(ctx, endpoints, to_tm, parent_pid), ctx)
    except Exception as exc:
        logger.exception("the scheduler could not start")
        ready.send(encode(ProcessReady("scheduler", {}, error=f"{type(exc).__name__}: {exc}")))
        time.sleep(0.2)
        sys.exit(1)
    ready.send(encode(ProcessReady("scheduler", info, args=args)))
    try:
        loop.run()
    except Exception:
        logger.error("the scheduler failed:\n%s", traceback.format_exc())
        sys.exit(1)
    logger.info("the server process is gone; the scheduler stops")


def build_loop(args: ServerArgs, transport: ZmqTransport, ctx: zmq.Context) -> tuple[SchedulerLoop, dict[str, Any]]:
    """The loop over a freshly loaded model, and what the launcher is told about the model."""
    from radix.radix_cache import RadixCache
    from runtime.executor.model_runner import ModelRunner
    from runtime.models.folders import load_tokenizer, tokenizer_class_name
    from runtime.models.tokenizer import eos_token_ids
    from runtime.scheduler.scheduler import Scheduler
    from runtime.server.kv_events import EventPublisher
    from runtime.server.scheduler_loop import SchedulerLoop

    runner = ModelRunner(args)
    tokenizer = load_tokenizer(args.tokenizer or runner.model_path)
    eos = eos_token_ids(tokenizer, runner.hf_config, runner.model_path)
    # the publisher's sink goes into the cache the Scheduler builds, so its snapshot reads the scheduler built after it
    box: dict[str, Scheduler] = {}

    def snapshot() -> list[Any]:  # a new subscriber's view of the whole cache
        cache = box["scheduler"].cache
        return cache.snapshot_events() if isinstance(cache, RadixCache) else []

    events = EventPublisher(ctx, args.host, args.kv_events_port, snapshot) if args.kv_events_port else None
    box["scheduler"] = Scheduler(args, runner, tokenizer, eos, cache_event_sink=events.sink if events else None)
    info = runner.info()
    ready = {
        "model_path": info.path,
        "architecture": info.architecture,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "dtype": info.dtype,
        "device": info.device,
        "max_total_tokens": runner.allocator.capacity,
        "page_size": runner.allocator.page_size,
        # the HTTP server and the detokenizer load this class directly instead of asking AutoTokenizer again
        "tokenizer_class": tokenizer_class_name(tokenizer),
    }
    return SchedulerLoop(box["scheduler"], transport, events), ready
