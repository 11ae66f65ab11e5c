"""Counters the scheduler keeps for logs, /get_server_info and /metrics."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    steps: int = 0
    finished: int = 0
    retractions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_seconds: float = 0.0
    prefill_chunks: int = 0  # prompt chunks that left the rest of their prompt for a later step
    max_step_prefill_tokens: int = 0  # most prompt tokens computed by one step
    lockstep_steps: int = 0  # overlap loop: steps that processed the batch in flight before scheduling
    discarded_rows: int = 0  # overlap loop: rows computed for requests that had finished one step earlier
    spec_verifications: int = 0  # speculative decoding: request decode steps that verified a draft
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted (emitted as the model's own)
    # (time, decode tokens) of recent steps, for a moving throughput figure
    _recent: deque = field(default_factory=lambda: deque(maxlen=64))
    # (batch size, seconds) of recent decode-only steps: the per-step cost benchmarks report
    decode_steps: deque = field(default_factory=lambda: deque(maxlen=4096))

    def record_step(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        self.steps += 1
        self.decode_tokens += decodes
        self.prefill_tokens += prefill_tokens
        self.forward_seconds += seconds
        self.max_step_prefill_tokens = max(self.max_step_prefill_tokens, prefill_tokens)
        self._recent.append((time.perf_counter(), decodes))
        if prefill_tokens == 0 and decodes:
            self.decode_steps.append((decodes, seconds))

    def decode_throughput(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "finished_requests": self.finished,
            "retractions": self.retractions,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "forward_seconds": round(self.forward_seconds, 3),
            "prefill_chunks": self.prefill_chunks,
            "max_step_prefill_tokens": self.max_step_prefill_tokens,
            "lockstep_steps": self.lockstep_steps,
            "discarded_rows": self.discarded_rows,
            "decode_tokens_per_s": round(self.decode_throughput(), 2),
            "spec_verifications": self.spec_verifications,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_accept_rate": round(self.spec_accept_rate, 4),
            "spec_accept_length": round(self.spec_accept_length, 4),
        }

    def record_verification(self, drafted: int, accepted: int) -> None:
        self.spec_verifications += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted

    @property
    def spec_accept_rate(self) -> float:
        """Accepted / verified draft tokens (0 before any draft)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_accept_length(self) -> float:
        """Tokens emitted per decode step that verified a draft (1 + accepted drafts; 0 before any)."""
        v = self.spec_verifications
        return 1 + self.spec_accepted_tokens / v if v else 0.0
