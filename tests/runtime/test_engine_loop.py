"""The one SchedulerLoop: the Engine's control calls as typed queries over the in-process transport, the same
loop over the server's ZMQ transport, and what callers see when the Engine's scheduler thread dies."""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any

import pytest
import zmq

from radix.errors import IntegrityError
from runtime.config import ServerArgs
from runtime.core.messages import (
    BatchTokenOut,
    ControlReply,
    FlushCacheQuery,
    IntegrityCheckQuery,
    SchedulerStatus,
    ServerInfoQuery,
    TokenizedRequest,
)
from runtime.core.sampling_params import SamplingParams
from runtime.engine import Engine
from runtime.request.intake import from_native, prepare
from runtime.server.ipc import Endpoints, decode, encode, pull, push
from runtime.server.scheduler_loop import SchedulerLoop
from runtime.server.scheduler_process import build_loop
from runtime.server.transports import QueueTransport, ZmqTransport
from tests.conftest import checked_engine

PROMPT = list(range(100, 140))
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def assert_books_balance(kv: dict[str, int]) -> None:
    assert kv["free"] + kv["evictable"] + kv["protected"] + kv["private"] == kv["capacity"], kv


def test_control_queries_through_the_engine(tiny_engine):
    engine = tiny_engine()
    assert isinstance(engine._loop, SchedulerLoop) and isinstance(engine._loop.transport, QueueTransport)
    engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    info = engine.server_info()
    assert info["scheduler_pid"] == os.getpid()  # the scheduler runs in this process, on a thread
    assert info["cache"]["cached_tokens"] >= len(PROMPT)
    assert_books_balance(info["kv"])
    # /get_server_info's figures start from Scheduler.status(): the same numbers, read between two steps
    status = engine.inspect(lambda s: s.status())
    assert (status.num_running, status.num_waiting) == (0, 0)
    assert status.cached_tokens == info["cache"]["cached_tokens"]
    assert status.tiers == info["cache"]["tiers"] and status.tiers["device"]["cached_tokens"] == status.cached_tokens
    assert status.kv_private == 0 and status.kv_free + status.kv_evictable + status.kv_protected == status.capacity

    report = engine.check_integrity()
    assert set(report) == {"free", "evictable", "protected", "private", "capacity"}
    assert_books_balance(report)

    # refused while a request runs (the query is answered between two of its steps), accepted once idle
    stream = engine.generate(input_ids=PROMPT[::-1], sampling_params={**GREEDY, "max_new_tokens": 64}, stream=True)
    next(stream)
    assert engine.flush_cache() is False
    stream.close()  # aborts it
    deadline = time.time() + 30
    while engine.server_info()["num_running_reqs"] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.flush_cache() is True
    assert engine.server_info()["cache"]["cached_tokens"] == 0
    assert_books_balance(engine.check_integrity())


def test_status_counts_the_requests_of_the_batch_in_flight(tiny_engine):
    """The overlap loop admits a prompt into the batch it launches and files it as running only when that batch
    is processed; between the two steps the request is in neither queue, and status() (the /metrics and router
    figures) must still count it as running."""
    engine = tiny_engine(enable_overlap_schedule=True)
    limits = engine.inspect(lambda s: s.limits)
    (single,) = from_native({"input_ids": PROMPT, "rid": "in-flight", "sampling_params": GREEDY}, limits.max_n).requests
    prepare(single, lambda text: [], limits)

    def admit_and_count(s: Any) -> int:
        s.submit(single.message())
        assert s.step() == []  # the first step launches the prompt's batch and processes nothing
        assert not s.running and not s.waiting and [r.rid for r in s.inflight_requests()] == ["in-flight"]
        return s.status().num_running

    assert engine.inspect(admit_and_count) == 1
    # the loop runs the request to its end (its outputs reach no caller: it was not sent through the Engine)
    deadline = time.monotonic() + 60
    while not engine.inspect(lambda s: s.idle):
        assert time.monotonic() < deadline, "the request did not finish"
        time.sleep(0.01)
    assert engine.inspect(lambda s: s.status().num_running) == 0


def test_a_failed_query_raises_its_own_exception_and_the_engine_goes_on(tiny_engine):
    engine = tiny_engine()
    freed: list[Any] = []

    def leak(s: Any) -> None:  # slots taken from the pool that nobody owns: the books no longer balance
        freed.append(s.cache.allocator.alloc(s.cache.page_size))

    engine.inspect(leak)
    with pytest.raises(IntegrityError):
        engine.check_integrity()
    engine.inspect(lambda s: s.cache.allocator.free(freed.pop()))
    assert_books_balance(engine.check_integrity())
    with pytest.raises(ZeroDivisionError):
        engine.inspect(lambda s: 1 / 0)
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 6


def test_callers_fail_at_once_when_the_scheduler_thread_dies(tiny_model_dir):
    engine = Engine(model=str(tiny_model_dir), max_total_tokens=2048, dtype="float32", log_level="critical")
    try:
        def break_after_first_step(s: Any) -> None:
            real = s.step

            def step() -> Any:
                if s.running:
                    raise MemoryError("injected: the scheduler fails while a request runs")
                return real()

            s.step = step

        engine.inspect(break_after_first_step)
        box: dict[str, BaseException] = {}

        def call() -> None:
            try:
                engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 32})
            except BaseException as exc:
                box["error"] = exc

        caller = threading.Thread(target=call)
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), "the waiting caller was not woken"
        assert isinstance(box.get("error"), RuntimeError)
        assert isinstance(box["error"].__cause__, MemoryError)
        t0 = time.monotonic()
        for fail in (lambda: engine.generate(input_ids=PROMPT, sampling_params=GREEDY), engine.server_info,
                     engine.flush_cache, engine.check_integrity):
            with pytest.raises(RuntimeError, match="scheduler thread"):
                fail()
        assert time.monotonic() - t0 < 5  # refused at once, not after a timeout
    finally:
        engine.shutdown()


def test_the_same_loop_runs_over_zmq(tiny_model_dir):
    """The server's side: the loop built by the scheduler process, fed through its sockets."""
    args = ServerArgs(model=str(tiny_model_dir), max_total_tokens=2048, dtype="float32", log_level="warning").resolve()
    endpoints, folder = Endpoints.create()
    ctx = zmq.Context()
    try:
        from_sched = pull(ctx, endpoints.tokenizer)  # what the tokenizer manager receives
        detok = pull(ctx, endpoints.detokenizer)
        # a parent pid that is not ours: the loop ends as soon as it is idle (as after the server died)
        transport = ZmqTransport(ctx, endpoints, push(ctx, endpoints.tokenizer), parent_pid=-1)
        loop, info = build_loop(args, transport, ctx)
        assert info["max_total_tokens"] == loop.scheduler.cache.allocator.capacity
        to_sched = push(ctx, endpoints.scheduler)
        greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        to_sched.send(encode(TokenizedRequest("r1", PROMPT, greedy)))
        queries = [ServerInfoQuery(), IntegrityCheckQuery(), FlushCacheQuery()]
        for q in queries:
            to_sched.send(encode(q))
        assert transport.inbox.poll(5000)  # queued (poll does not consume)
        loop.run()

        outputs = []
        while detok.poll(100):
            batch = decode(detok.recv())
            assert isinstance(batch, BatchTokenOut)
            outputs += batch.outputs
        assert sum(len(o.new_token_ids) for o in outputs) == 6 and outputs[-1].finished is not None
        replies: dict[str, ControlReply] = {}
        statuses = []
        while from_sched.poll(100):
            msg = decode(from_sched.recv())
            if isinstance(msg, ControlReply):
                replies[msg.req_id] = msg
            else:
                statuses.append(msg)
        server_info, integrity, flush = (replies[q.req_id] for q in queries)
        assert server_info.ok and server_info.data["scheduler_pid"] == os.getpid()
        assert integrity.ok and integrity.error is None
        assert_books_balance(integrity.data)
        # the flush arrived while the request was queued or running
        assert not flush.ok and "cannot be flushed" in flush.data["message"]
        assert statuses and all(isinstance(s, SchedulerStatus) for s in statuses)
        assert "device" in statuses[0].tiers
        loop.scheduler.close()
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_stopped_engine_gives_its_pool_and_weights_back(tiny_model_dir):
    """While the caller still holds the Engine (``with Engine(...) as e`` keeps ``e``), the next Engine in the
    process sizes its pool from the memory left: the stopped one must hold none of it."""
    with checked_engine(tiny_model_dir, max_total_tokens=2048, dtype="float32") as engine:
        assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 6
        runner = engine.runner
        assert runner.kv.nbytes > 0
    assert runner.kv.nbytes == 0 and runner.kv.total_slots == 0
    assert {p.device.type for p in runner.model.parameters()} == {"meta"}
    assert runner.graph_runner is None
    engine.shutdown()  # a second shutdown is a no-op
