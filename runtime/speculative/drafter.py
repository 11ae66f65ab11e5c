"""The interface every drafting method implements: n-gram drafts (``ngram``) and a draft model
(``model_drafter``) are two classes behind it, and the scheduler's step (``runtime.scheduler.speculation``)
knows only this.

Once per step the scheduler hands the drafter every decoding request that may draft (:class:`DraftJob`: its
tokens, how many draft tokens it may have) and a :class:`DraftSlots` through which the drafter takes the KV
slots of the tokens it proposes. The slots are the drafter's to ask for because the methods need them at
different times: an n-gram drafter knows its draft (often empty) before it needs any slot, a draft model must
hold the slots before it runs, since it writes its own KV there while drafting. ``DraftSlots`` decides whether
memory and the step's token budget allow them; a draft is never longer than the slots granted to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftJob:
    """A decoding request that may draft this step."""

    tokens: array  # prompt + output so far (int32); the last token's KV is computed by this step
    namespace: Hashable | None  # its cache namespace (n-gram drafts never cross namespaces)
    k: int  # most draft tokens it may have (adaptive length, max_new_tokens and the context allow)
    row: int  # its row of the request-to-token table (where its slots are)


class DraftSlots(Protocol):
    """KV slots for drafts, granted from memory that is available and from the step's draft-token budget."""

    @property
    def budget(self) -> int:
        """Draft tokens the step may still take."""
        ...

    def reserve(self, job: int, n: int) -> bool:
        """Allocate KV slots for ``n`` draft tokens of job ``job`` (the positions after its last token, written
        to its request-table row); False, and nothing allocated, when memory or the budget do not allow it."""
        ...


class Drafter(ABC):
    """Proposes draft tokens for running requests (see the module docstring)."""

    @abstractmethod
    def draft(self, jobs: Sequence[DraftJob], slots: DraftSlots) -> list[list[int]]:
        """One draft per job, in order (empty: none this step); each exactly as long as the slots reserved for
        it."""

    @abstractmethod
    def finished(self, tokens: array, cached_tokens: int, namespace: Hashable | None) -> None:
        """A request finished with ``tokens`` (prompt + output; its first ``cached_tokens`` came from the cache)."""

    @abstractmethod
    def clear(self) -> None:
        """The cache was flushed: forget what was learnt from finished requests."""
