"""The scheduler process: receives tokenized requests, runs the Scheduler, sends token outputs.

It drains every queued message before each step (requests, aborts and control queries are applied
between steps, never during one), sends each step's outputs as one batch to the detokenizer, and pushes
a status message to the tokenizer manager about twice a second.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any

import zmq

from radix.radix_cache import RadixCache
from runtime.config import ServerArgs
from runtime.core.messages import (
    AbortRequest,
    BatchTokenOut,
    CacheTreeQuery,
    ControlQuery,
    ControlReply,
    DashboardStatsQuery,
    FlushCacheQuery,
    SchedulerStatus,
    ServerInfoQuery,
    TokenizedRequest,
)
from runtime.logging_setup import configure_logging
from runtime.server.dashboard_queries import cache_tree, live_stats
from runtime.server.ipc import Endpoints, ProcessReady, decode, die_with_parent, encode, parent_alive, pull, push
from runtime.server.kv_events import EventPublisher

logger = logging.getLogger(__name__)
STATUS_INTERVAL = 0.5
IDLE_POLL_MS = 500
GRAMMAR_POLL_MS = 5


def run_scheduler_process(args: ServerArgs, endpoints: Endpoints, parent_pid: int) -> None:
    die_with_parent()
    configure_logging(args.log_level, "scheduler")
    ctx = zmq.Context()
    to_tm = push(ctx, endpoints.tokenizer)
    ready = push(ctx, endpoints.ready)
    try:
        loop = SchedulerLoop(args, endpoints, ctx, to_tm)
    except Exception as exc:
        logger.exception("the scheduler could not start")
        ready.send(encode(ProcessReady("scheduler", {}, error=f"{type(exc).__name__}: {exc}")))
        time.sleep(0.2)
        sys.exit(1)
    ready.send(encode(ProcessReady("scheduler", loop.ready_info())))
    try:
        loop.run(parent_pid)
    except Exception:
        logger.error("the scheduler failed:\n%s", traceback.format_exc())
        sys.exit(1)


class SchedulerLoop:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, ctx: zmq.Context, to_tm: zmq.Socket):
        from runtime.executor.model_runner import ModelRunner
        from runtime.models.loader import load_tokenizer
        from runtime.models.tokenizer import eos_token_ids
        from runtime.scheduler.scheduler import Scheduler

        self.runner = ModelRunner(args)
        tokenizer = load_tokenizer(args.tokenizer or self.runner.model_path)
        eos = eos_token_ids(tokenizer, self.runner.hf_config, self.runner.model_path)
        self.events: EventPublisher | None = None
        if args.kv_events_port:
            self.events = EventPublisher(ctx, args.host, args.kv_events_port, lambda: self._snapshot())
        sink = self.events.sink if self.events else None
        self.scheduler = Scheduler(args, self.runner, tokenizer, eos, cache_event_sink=sink)
        self.inbox = pull(ctx, endpoints.scheduler)
        self.to_detok = push(ctx, endpoints.detokenizer)
        self.to_tm = to_tm
        self._last_status = 0.0

    def _snapshot(self) -> list[Any]:
        cache = self.scheduler.cache
        return cache.snapshot_events() if isinstance(cache, RadixCache) else []

    def ready_info(self) -> dict[str, Any]:
        info = self.runner.info()
        return {
            "model_path": info.path,
            "architecture": info.architecture,
            "context_length": info.context_length,
            "vocab_size": info.vocab_size,
            "dtype": info.dtype,
            "device": info.device,
            "max_total_tokens": self.runner.allocator.capacity,
            "page_size": self.runner.allocator.page_size,
        }

    def run(self, parent_pid: int) -> None:
        sched = self.scheduler
        while True:
            timeout = 0 if sched.busy else (GRAMMAR_POLL_MS if sched.compiling else IDLE_POLL_MS)
            if self.inbox.poll(timeout):
                self._drain()
            outputs = sched.step()
            if outputs:
                self.to_detok.send(encode(BatchTokenOut(outputs)))
            if self.events is not None:
                self.events.flush()
            self._maybe_status()
            if sched.idle and not parent_alive(parent_pid):
                logger.info("the server process is gone; the scheduler stops")
                return

    def _drain(self) -> None:
        while True:
            try:
                msg = decode(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(msg, TokenizedRequest):
                self.scheduler.submit(msg)
            elif isinstance(msg, AbortRequest):
                self.scheduler.abort(msg.rid, msg.message, msg.cause)
            elif isinstance(msg, ControlQuery):
                self.to_tm.send(encode(self._control(msg)))

    def _control(self, msg: ControlQuery) -> ControlReply:
        try:
            return ControlReply(msg.req_id, *self._answer(msg))
        except Exception as exc:
            logger.exception("control query %s failed", type(msg).__name__)
            return ControlReply(msg.req_id, False, {"message": str(exc)})

    def _answer(self, msg: ControlQuery) -> tuple[bool, dict[str, Any]]:
        """(ok, data) of one query; the dashboard's are read-only views (runtime/server/dashboard_queries.py)."""
        if isinstance(msg, ServerInfoQuery):
            # the pid lets an operator (or a test) find the scheduler among the server's processes
            return True, {**self.scheduler.server_info(), "scheduler_pid": os.getpid()}
        if isinstance(msg, FlushCacheQuery):
            ok = self.scheduler.flush_cache()
            return ok, {} if ok else {"message": "the cache cannot be flushed while requests are queued or running"}
        if isinstance(msg, CacheTreeQuery):
            return True, cache_tree(self.scheduler, msg.max_nodes, msg.min_tokens)
        if isinstance(msg, DashboardStatsQuery):
            return True, live_stats(self.scheduler)
        return False, {"message": f"unknown control query {type(msg).__name__}"}

    def _maybe_status(self) -> None:
        now = time.perf_counter()
        if now - self._last_status < STATUS_INTERVAL:
            return
        self._last_status = now
        s = self.scheduler
        cap = s.cache.allocator.capacity
        cs = s.cache.stats()
        self.to_tm.send(encode(SchedulerStatus(
            num_running=len(s.running) + (1 if s.chunked else 0),
            num_waiting=len(s.waiting),
            token_usage=round(1 - s.cache.available_size / cap, 4),
            cache_hit_rate=round(cs.hit_rate, 4),
            decode_throughput=round(s.stats.decode_throughput(), 2),
            cached_tokens=cs.cached_tokens,
            capacity=cap,
            forward_steps=s.stats.steps,
        )))
