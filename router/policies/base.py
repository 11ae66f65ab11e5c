"""The policy interface, and the load rules every policy shares.

A policy sees each request twice: ``select`` picks a worker among the candidates (healthy workers with a
free slot, minus those that already failed this request) and ``on_finished`` tells it how the request
ended (with the answer's text, so a cache-tracking policy can record what the worker now holds).
``prepare`` runs once per request before the first ``select``, so retries do not redo tokenization.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from router.request_view import RequestView
from router.tokens import RequestTokenizer
from router.workers import Worker


@dataclass
class Choice:
    worker: Worker
    reason: str  # why this worker: "cache", "balance", "load", "round_robin", ...
    match: int = 0  # predicted cached prefix on the chosen worker (in ``Policy.unit``)
    prompt_units: int = 0  # the prompt's length in the same unit (0: unknown)


def imbalanced(loads: Sequence[int], abs_threshold: int, rel_threshold: float) -> bool:
    """The guard's test: the spread is over both the absolute and the relative threshold."""
    if not loads:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


class Policy(ABC):
    name: ClassVar[str]
    unit: str = "tokens"  # what match lengths count
    needs_tokenizer: bool = False
    tokenizer: RequestTokenizer | None = None  # set by the service when ``needs_tokenizer``

    def __init__(self) -> None:
        # Ties between equally good workers go to the one chosen least recently, so equal workers
        # take turns instead of the first one in the list getting everything.
        self._clock = itertools.count(1)
        self._last_pick: dict[str, int] = {}

    def prepare(self, view: RequestView) -> None:  # noqa: B027 - optional hook
        """Compute what ``select`` needs from the request, once."""

    @abstractmethod
    def select(self, view: RequestView, candidates: list[Worker]) -> Choice:
        """Pick one of ``candidates`` (never empty)."""

    def on_finished(self, view: RequestView, choice: Choice, ok: bool,  # noqa: B027 - optional hook
                    completion: str | None) -> None:
        """The request ended (``ok``: the worker answered 200); ``completion`` is the first answer's text."""

    def add_worker(self, worker: Worker) -> None:  # noqa: B027 - optional hook
        pass

    def remove_worker(self, worker: Worker) -> None:
        self._last_pick.pop(worker.url, None)

    def reset(self) -> None:  # noqa: B027 - optional hook
        """The workers' caches were flushed."""

    def describe(self, worker: Worker) -> dict[str, Any]:
        """Policy state of one worker, for GET /workers."""
        return {}

    async def start(self) -> None:  # noqa: B027 - optional hook
        pass

    async def stop(self) -> None:  # noqa: B027 - optional hook
        pass

    async def worker_ready(self, worker: Worker, info: dict[str, Any]) -> None:  # noqa: B027
        """The worker became healthy; ``info`` is its /get_server_info (for exact mode's event port)."""

    # ------------------------------------------------------------------ shared helpers
    def pick(self, workers: Sequence[Worker], reason: str, **kw: Any) -> Choice:
        worker = workers[0]
        self._last_pick[worker.url] = next(self._clock)
        return Choice(worker, reason, **kw)

    def least_loaded(self, workers: Sequence[Worker], size: Any = None) -> list[Worker]:
        """``workers`` ordered best first: fewest in flight, then smallest ``size(w)``, then least recent."""
        return sorted(workers, key=lambda w: (w.load, size(w) if size else 0, self._last_pick.get(w.url, 0)))
