"""How many draft tokens a step may verify, from what steps cost on this machine (``StepBudget``).

A draft token is one more row in the step's forward pass. While a step is bound by reading the weights (a
CPU, or a GPU at small batch) a row costs almost nothing and every accepted draft is a token for free; once
the rows make the step compute-bound, a draft row costs about what a decode row costs and pays only when it
is accepted, and below that rate speculation makes the workload slower. Where that point lies depends on the
machine, the model, the kernels and the batch, so it is measured rather than assumed:

* ``observe(rows, seconds)``: every forward step's time, kept per bucket of row counts (powers of two) as an
  exponentially weighted mean;
* ``verified(drafted, accepted)``: the acceptance rate ``a`` of draft tokens, likewise;
* ``cap(decodes, drafting)``: the per-request draft length ``k`` (0..K) that maximises the expected tokens per
  second of the step, ``(decodes + drafting * (E(k) - 1)) / T(decodes + drafting * k)`` with
  ``E(k) = 1 + a + ... + a^k`` the tokens a drafting request emits (its own token, then each draft while the
  ones before it were accepted). A length whose row bucket has not been measured yet is tried first (largest
  first, then none), and every ``REVISIT`` steps another length is tried once, so that estimates made under
  other contexts and loads do not stay unquestioned.

Each request's own draft length (``adaptive.DraftLength``) still backs off on its rejections; the cap bounds it
for the step as a whole. ``--speculative-draft-budget full`` takes :class:`FullBudget` instead: always up to K.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

WEIGHT = 0.25  # of a new step time in its bucket's running mean
TOKEN_WEIGHT = 0.05  # of each verified draft token in the running acceptance rate (a draft of 4: ~19%)
REVISIT = 32  # steps between tries of a length other than the best one
PRIOR_ACCEPTANCE = 0.5


def bucket(rows: int) -> int:
    """Rows 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...: steps within a power of two cost about the same."""
    return max(0, rows - 1).bit_length()


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a request drafting ``k`` emits in one step: its own token, then each draft while all before it
    were accepted (1 + a + ... + a^k)."""
    return sum(acceptance**i for i in range(k + 1))


class DraftBudget(Protocol):
    """The step's cap on draft lengths, and what it learns from (the two classes below)."""

    max_k: int

    def observe(self, rows: int, seconds: float) -> None: ...

    def verified(self, drafted: int, accepted: int) -> None: ...

    def cap(self, decodes: int, drafting: int) -> int: ...


class FullBudget:
    """Drafts of up to K in every step, whatever they cost (``--speculative-draft-budget full``)."""

    def __init__(self, max_k: int):
        self.max_k = max_k

    def observe(self, rows: int, seconds: float) -> None:
        """Nothing to learn."""

    def verified(self, drafted: int, accepted: int) -> None:
        """Nothing to learn."""

    def cap(self, decodes: int, drafting: int) -> int:
        return self.max_k if drafting > 0 else 0


@dataclass
class StepBudget:
    max_k: int  # K: the most draft tokens a request verifies per step
    acceptance: float = PRIOR_ACCEPTANCE
    step_seconds: dict[int, float] = field(default_factory=dict)  # row bucket -> running mean of a step's time
    decisions: int = 0

    def observe(self, rows: int, seconds: float) -> None:
        """A forward step of ``rows`` rows (decodes, draft tokens and prompt tokens) took ``seconds``."""
        if rows <= 0:
            return
        b = bucket(rows)
        old = self.step_seconds.get(b)
        self.step_seconds[b] = seconds if old is None else (1 - WEIGHT) * old + WEIGHT * seconds

    def verified(self, drafted: int, accepted: int) -> None:
        """A request verified ``drafted`` draft tokens and ``accepted`` of them were right."""
        if drafted > 0:  # one rejected draft must not stop every request drafting: a slow mean over tokens
            w = 1 - (1 - TOKEN_WEIGHT) ** drafted
            self.acceptance = (1 - w) * self.acceptance + w * accepted / drafted

    def cap(self, decodes: int, drafting: int) -> int:
        """The draft length for this step's ``drafting`` requests among ``decodes`` decoding ones (see the module
        docstring)."""
        if drafting <= 0:
            return 0
        self.decisions += 1
        rows = {k: decodes + drafting * k for k in range(self.max_k + 1)}
        unknown = [k for k in rows if bucket(rows[k]) not in self.step_seconds]
        if unknown:  # learn what the step costs: the largest length first (the likely best), then none
            return max(unknown) if self.max_k in unknown else min(unknown)

        def rate(k: int) -> float:
            tokens = decodes + drafting * (expected_tokens(k, self.acceptance) - 1)
            return tokens / self.step_seconds[bucket(rows[k])]

        best = max(rows, key=lambda k: (rate(k), -k))
        if self.decisions % REVISIT == 0:  # one step at a neighbouring length keeps its estimate current
            near = [k for k in (best - 1, best + 1) if 0 <= k <= self.max_k]
            return near[(self.decisions // REVISIT) % len(near)]
        return best


# --speculative-draft-budget -> the budget for K draft tokens
BUDGETS: dict[str, Callable[[int], DraftBudget]] = {"auto": StepBudget, "full": FullBudget}
