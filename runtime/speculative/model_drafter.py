"""Drafts from a smaller model (``--speculative-algorithm draft``): the draft model decodes ahead greedily.

For the requests that draft this step, the slots of their ``k`` draft tokens are reserved first (the draft
model writes its KV there while it drafts), then the draft model runs ``k`` batched decode steps: step ``j``
feeds each request its token at position ``n - 1 + j`` (``n`` tokens so far: the last real token for ``j = 0``,
then the draft token it just proposed) and takes the argmax as the next draft token. Requests drafting fewer
tokens (adaptive length, the budget) leave the batch after their last one.

A greedy draft is a point mass, so the verification's acceptance rule (``verify``: accept ``d`` iff the token
sampled at its position equals it) is the rejection-sampling rule unchanged, and outputs are those without
speculation. The draft model's KV of positions before ``n - 1`` is there because it ran every batch the served
model ran (``runtime.executor.draft_model``); of the last draft token, the verifying forward writes it.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from runtime.executor.draft_model import DraftModel
from runtime.speculative.drafter import Drafter, DraftJob, DraftSlots


class ModelDrafter(Drafter):
    def __init__(self, model: DraftModel):
        self.model = model

    def draft(self, jobs: Sequence[DraftJob], slots: DraftSlots) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in jobs]
        lengths: dict[int, int] = {}  # job -> draft tokens reserved
        for i, job in enumerate(jobs):
            k = min(job.k, slots.budget)
            if k > 0 and slots.reserve(i, k):
                lengths[i] = k
        for j in range(max(lengths.values(), default=0)):
            active = [i for i, k in lengths.items() if k > j]
            last = [int(jobs[i].tokens[-1]) if j == 0 else out[i][-1] for i in active]
            positions = [len(jobs[i].tokens) - 1 + j for i in active]
            proposed = self.model.greedy(last, positions, [jobs[i].row for i in active])
            for i, token in zip(active, proposed):
                out[i].append(token)
        return out

    def finished(self, tokens: array, cached_tokens: int, namespace: Hashable | None) -> None:
        """Nothing to learn: the draft model's KV of a finished request stays in the slots the cache keeps."""

    def clear(self) -> None:
        """Nothing to forget: a flushed cache's slots are free, and every slot is recomputed before it is read."""
