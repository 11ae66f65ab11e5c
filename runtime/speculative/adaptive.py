"""Adaptive draft length, per request: speculation must not make a workload slower by more than noise.

A verified draft token costs one more row of the forward pass. On a CPU at small batch the weights are read
once per step whatever the rows, so a row is cheap, but it is not free, and at larger batches it costs
nearly what a decode row costs. A request whose drafts keep being rejected therefore backs off, like TCP's
window: a fully accepted draft doubles the length (up to K), a partly accepted one continues with one more
than was accepted, and a fully rejected one halves it; after repeated full rejections the request stops
drafting for a number of steps that doubles each time (up to ``MAX_PAUSE``), then probes with one token.
Steps without a draft (nothing matched) change nothing: they cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 32  # most decode steps a request goes without drafting after repeated rejections


@dataclass
class DraftLength:
    max_k: int
    k: int = 0  # the next draft's length (0 before the first: set to max_k)
    pause: int = 0  # steps left without drafting
    misses: int = 0  # fully rejected drafts in a row
    drafted: int = 0  # draft tokens verified for this request
    accepted: int = 0  # of those, accepted

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    def want(self) -> int:
        """The length to draft this step (0: not this step). Counts one paused step down."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens was verified and its first ``accepted`` were right."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted >= drafted:
            self.misses = 0
            self.k = min(self.max_k, 2 * self.k)
        elif accepted > 0:
            self.misses = 0
            self.k = min(self.max_k, accepted + 1)
        else:
            self.misses += 1
            self.k = max(1, self.k // 2)
            if self.misses >= 2:
                self.pause = min(MAX_PAUSE, 2 ** (self.misses - 1))
