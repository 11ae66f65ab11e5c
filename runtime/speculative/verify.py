"""Verification of a draft in one forward pass, and the acceptance rule.

A request with draft ``d_0 .. d_{k-1}`` runs as an extend of ``1 + k`` positions: its last real token and
the drafts. The logits at the position of ``d_{j-1}`` (of the real token for ``j = 0``) are those the model
would produce at output position ``n + j`` (``n`` tokens output so far) *if* ``d_0 .. d_{j-1}`` were its
output, so each of the ``k + 1`` rows is sampled exactly as a normal decode at that position would be:
:func:`verify_rows` gives every row the request's settings, its output extended by the draft prefix
(penalties and the ``min_new_tokens`` ban see that output) and the draw position ``n + j`` (the uniform
number of a seeded request at that position).

Acceptance (:func:`accepted_length`): ``t_j`` being the token sampled at row ``j``, the first ``m`` drafts
with ``d_j == t_j`` are accepted and ``t_0 .. t_m`` are emitted (``t_m``: the model's own token after the
last accepted draft, or after all of them). Greedy rows sample the argmax, so this is "the longest draft
prefix equal to the argmax, plus the model's next token". Sampled rows: an n-gram draft is deterministic (a
point mass ``q``), and the standard rejection-sampling rule (accept ``d`` with probability
``min(1, p(d)/q(d)) = p(d)``; on rejection draw from ``p`` with ``d`` removed, renormalised) is exactly what
comparing ``d_j`` with a draw ``t_j ~ p_j`` does: ``P(t_j = d_j) = p_j(d_j)``, and given ``t_j != d_j``,
``t_j`` is distributed as ``p_j`` without ``d_j``, renormalised. Because ``t_j`` is drawn with the uniform
number the request would use at that position anyway, a seeded request emits the very tokens it emits
without speculation (up to the float effects of a different batch shape), not only the same distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.core.sampling_params import SamplingParams
from runtime.executor.sampling_batch import SamplingRow


@dataclass(frozen=True)
class VerifyRow:
    """A request's sampling row at one draft position (a ``SamplingRow``): the request's own, but for its
    output, which includes the draft tokens before this position."""

    base: SamplingRow
    output_ids: Sequence[int]

    @property
    def sampling(self) -> SamplingParams:
        return self.base.sampling

    @property
    def seed(self) -> int:
        return self.base.seed

    @property
    def input_ids(self) -> Sequence[int]:
        return self.base.input_ids

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.base.eos_ids

    @property
    def return_logprob(self) -> bool:
        return self.base.return_logprob

    @property
    def top_logprobs_num(self) -> int:
        return self.base.top_logprobs_num

    @property
    def grammar(self) -> Any:
        return None  # constrained requests do not draft (see runtime.scheduler.speculation)


def verify_rows(req: SamplingRow, draft: Sequence[int]) -> list[VerifyRow]:
    """The ``len(draft) + 1`` sampling rows of a request verifying ``draft``."""
    assert req.grammar is None, "a grammar-constrained request never drafts"
    out = list(req.output_ids)
    return [VerifyRow(req, out + list(draft[:j])) for j in range(len(draft) + 1)]


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions (``sampled`` has one more)."""
    m = 0
    while m < len(draft) and draft[m] == sampled[m]:
        m += 1
    return m
