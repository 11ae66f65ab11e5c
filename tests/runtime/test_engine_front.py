"""The Engine takes requests through the server's front (``runtime.request.front``): the waiting-queue bound, the
per-request timeout and the Engine-wide one, priority, ``stream_interval``, and refusals that name the field as
``Engine.generate`` names it. Every Engine ends with its KV books checked (the ``tiny_engine`` fixture)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from runtime.core.errors import IntakeError
from runtime.request.front import QueueFull, RequestTimeout

PROMPT = list(range(100, 140))
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}
SHORT = {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0}


def wait_until(cond: Any, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_request_past_its_timeout_raises_and_frees_its_kv(tiny_engine):
    engine = tiny_engine()
    started = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"within 0\.3 s"):
        engine.generate(input_ids=PROMPT, sampling_params=LONG, timeout=0.3)
    assert time.monotonic() - started < 30
    stream = engine.generate(input_ids=PROMPT, sampling_params=LONG, timeout=0.3, stream=True)
    frames = 0
    with pytest.raises(RequestTimeout):
        for _ in stream:
            frames += 1
    assert 0 < frames < LONG["max_new_tokens"]
    # the Engine serves on, and a request within its time is untouched by the timer
    out = engine.generate(input_ids=PROMPT, sampling_params=SHORT, timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    wait_until(lambda: engine.inspect(lambda s: s.idle), "the scheduler to go idle")


def test_the_engine_wide_request_timeout(tiny_engine):
    engine = tiny_engine(request_timeout=0.3)
    with pytest.raises(RequestTimeout):
        engine.generate(input_ids=[PROMPT, PROMPT[::-1]], sampling_params=LONG)
    wait_until(lambda: engine.inspect(lambda s: s.idle), "the scheduler to go idle")


def test_a_full_waiting_queue_refuses_the_whole_call(tiny_engine):
    engine = tiny_engine(max_queued_requests=1, max_running_requests=1)
    blocker = engine.generate(input_ids=PROMPT, sampling_params=LONG, stream=True)
    next(blocker)  # sent and running
    with pytest.raises(QueueFull, match="limit 1"):
        engine.generate(input_ids=[PROMPT[:20], PROMPT[20:]], sampling_params=SHORT)
    assert engine.inspect(lambda s: len(s.waiting)) == 0, "nothing of a refused call is queued"
    blocker.close()  # aborts it
    wait_until(lambda: len(engine.front.handles) == 0, "the blocker's abort")
    out = engine.generate(input_ids=[PROMPT[:20]], sampling_params=SHORT)
    assert out[0]["meta_info"]["completion_tokens"] == 4


def test_priority_orders_the_waiting_queue(tiny_engine):
    """One running slot: while a request holds it, two low-priority requests and then a high-priority one
    queue up; the high-priority one runs (and finishes) first."""
    engine = tiny_engine(enable_priority_scheduling=True, max_running_requests=1, schedule_policy="fcfs")
    blocker = engine.generate(input_ids=PROMPT, sampling_params=LONG, stream=True)
    next(blocker)
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, priority: int, ids: list[int]) -> None:
        engine.generate(input_ids=ids, sampling_params=SHORT, priority=priority)
        with lock:
            finished.append(name)

    threads = []
    for n, (name, priority) in enumerate((("low1", 0), ("low2", 0), ("high", 10))):
        threads.append(threading.Thread(target=run, args=(name, priority, PROMPT[n:] + [7])))
        threads[-1].start()
        wait_until(lambda k=n + 1: engine.inspect(lambda s: len(s.waiting)) == k, f"{name} to queue")
    blocker.close()
    for t in threads:
        t.join(timeout=120)
    assert finished[0] == "high", finished
    assert sorted(finished) == ["high", "low1", "low2"]


def test_stream_interval_thins_the_engine_stream(tiny_engine):
    engine = tiny_engine()
    params = {**SHORT, "max_new_tokens": 13, "stream_interval": 4}
    counts = [f["meta_info"]["completion_tokens"] for f in engine.generate(input_ids=PROMPT, sampling_params=params,
                                                                            stream=True)]
    assert counts == [1, 5, 9, 13], counts  # the first at once, one per 4 tokens, the last always
    every = engine.generate(input_ids=PROMPT, sampling_params={**params, "stream_interval": None}, stream=True)
    assert len(list(every)) == 13


REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"prompt": "a", "input_ids": [1]}, "prompt"),  # /generate calls it text
    ({"prompt": "word " * 80}, "prompt"),  # over the context
    ({"input_ids": list(range(100, 180))}, "input_ids"),
    ({"prompt": "a", "sampling_params": {"max_new_tokens": 64}}, "max_new_tokens"),
    ({"prompt": "a", "timeout": 0}, "timeout"),
    ({"prompt": "a", "priority": "high"}, "priority"),
    ({"prompt": "a", "sampling_params": {"temperature": -1}}, "temperature"),
]


def test_refusals_name_the_generate_parameter(tiny_engine):
    engine = tiny_engine(context_length=64)
    for kwargs, field in REFUSALS:
        with pytest.raises(IntakeError) as err:
            engine.generate(**kwargs)
        assert err.value.field == field, (kwargs, err.value)
        assert str(err.value).startswith(f"{field}: ")
    assert engine.inspect(lambda s: s.idle), "nothing refused was queued"
