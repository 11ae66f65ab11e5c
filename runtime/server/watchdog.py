"""Hang detection: a scheduler that stops making progress while requests are pending.

The scheduler process pushes a status about twice a second from its loop, with the number of forward steps
run so far. A stuck kernel or a blocked loop stops the status altogether; a loop that spins without running
anything keeps sending it with the same step count while the status itself shows queued or running work.
Either, for longer than ``--watchdog-timeout`` while the tokenizer manager waits on requests, makes the
server unusable, so it is treated like a dead child process: pending requests get 503 and the server exits.
"""

from __future__ import annotations

from runtime.core.messages import SchedulerStatus


class ProgressWatch:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self._steps = -1
        self._stalled_since: float | None = None

    def check(self, pending: int, status: SchedulerStatus | None, status_time: float, now: float) -> str | None:
        """Why the scheduler counts as hung (or None), given ``pending`` requests awaiting output, the latest
        status and when it arrived (monotonic seconds)."""
        if pending == 0:
            self._stalled_since = None
            return None
        silent = now - status_time
        if silent > self.timeout:
            return (f"the scheduler sent no status for {silent:.1f} s while {pending} requests were pending "
                    f"(--watchdog-timeout {self.timeout:g})")
        if status is None or status.num_running + status.num_waiting == 0 or status.forward_steps != self._steps:
            self._steps = status.forward_steps if status is not None else -1
            self._stalled_since = None
            return None
        if self._stalled_since is None:
            self._stalled_since = now
        elif now - self._stalled_since > self.timeout:
            return (f"the scheduler ran no step for {now - self._stalled_since:.1f} s with {status.num_running} "
                    f"running and {status.num_waiting} waiting requests (--watchdog-timeout {self.timeout:g})")
        return None
