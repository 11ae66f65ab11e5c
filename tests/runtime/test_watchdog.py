"""The hang watchdog's judgement (runtime/server/watchdog.py); the end-to-end case: tests/server/test_protection.py."""

from __future__ import annotations

from runtime.core.messages import SchedulerStatus
from runtime.server.watchdog import ProgressWatch


def status(running: int, waiting: int, steps: int) -> SchedulerStatus:
    return SchedulerStatus(num_running=running, num_waiting=waiting, token_usage=0.0, cache_hit_rate=0.0,
                           decode_throughput=0.0, cached_tokens=0, capacity=100, forward_steps=steps)


def test_silence_counts_only_while_requests_are_pending() -> None:
    watch = ProgressWatch(10)
    assert watch.check(0, status(0, 0, 5), status_time=0, now=100) is None  # idle and quiet: fine
    reason = watch.check(2, status(1, 1, 5), status_time=0, now=10.5)
    assert reason is not None and "no status for 10.5 s" in reason and "2 requests" in reason
    assert watch.check(2, status(1, 1, 5), status_time=1, now=10.5) is None


def test_a_status_without_new_steps_while_work_is_queued_is_a_hang() -> None:
    watch = ProgressWatch(10)
    assert watch.check(3, status(2, 1, 7), status_time=0, now=0) is None
    assert watch.check(3, status(2, 1, 7), status_time=5, now=5) is None  # stalled since t=5
    assert watch.check(3, status(2, 1, 7), status_time=14, now=14) is None
    reason = watch.check(3, status(2, 1, 7), status_time=15.5, now=15.5)
    assert reason is not None and "ran no step for 10.5 s" in reason


def test_progress_or_an_empty_scheduler_resets_the_stall_clock() -> None:
    watch = ProgressWatch(10)
    watch.check(1, status(1, 0, 7), 0, 0)
    watch.check(1, status(1, 0, 7), 5, 5)
    assert watch.check(1, status(1, 0, 8), 14, 14) is None  # a step ran
    assert watch.check(1, status(1, 0, 8), 20, 20) is None  # stalled since 20 only
    assert watch.check(1, status(0, 0, 8), 40, 40) is None  # the request is still on its way to the scheduler
    assert watch.check(1, status(1, 0, 8), 41, 41) is None
    assert watch.check(1, status(1, 0, 8), 50, 50) is None
    assert watch.check(1, status(1, 0, 8), 52, 52) is not None
