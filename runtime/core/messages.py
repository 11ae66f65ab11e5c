"""Typed messages between the processes (and between the Engine's caller and its scheduler thread).

Every message is a dataclass; the ZMQ layer sends them with one codec (``runtime.server.ipc``). Token ids cross
process boundaries as lists inside these messages; outputs are batched per scheduler step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.core.sampling_params import SamplingParams


@dataclass
class FinishReason:
    """Why a request ended, in SGLang's JSON shape."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None  # for aborts caused by a client error

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        out: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


# ---------------------------------------------------------------------- to the scheduler
@dataclass
class TokenizedRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    cache_salt: str | None = None
    priority: int = 0


@dataclass
class AbortRequest:
    rid: str
    message: str = "aborted by request"
    status_code: int | None = None  # set when the abort answers the client with an error (e.g. 408 timeout)


@dataclass
class ControlRequest:
    """A query the scheduler answers with a ControlReply (server info, integrity check...)."""

    req_id: str
    kind: str  # "server_info" | "flush_cache" | "cache_tree" | "dashboard_stats"
    params: dict[str, Any] = field(default_factory=dict)  # the kind's arguments (cache_tree: max_nodes, ...)


@dataclass
class ControlReply:
    req_id: str
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- from the scheduler
@dataclass
class ReqOutput:
    """What one request produced in one scheduler step."""

    rid: str
    new_token_ids: list[int]
    finished: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # [logprob, token_id] pairs for the new output tokens / prompt tokens; top-k alternatives per token
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # sent with a request's first output only: how the detokenizer must render its text
    sampling: SamplingParams | None = None


@dataclass
class BatchTokenOut:
    outputs: list[ReqOutput]


@dataclass
class SchedulerStatus:
    """Load and cache figures the scheduler pushes about twice a second (for /metrics and routers)."""

    num_running: int
    num_waiting: int
    token_usage: float  # share of KV capacity held by requests and locked prefixes
    cache_hit_rate: float
    decode_throughput: float
    cached_tokens: int
    capacity: int
    # Steps that ran a forward pass since start: the watchdog's evidence of progress while work is pending.
    forward_steps: int = 0


@dataclass
class ReqTextOutput:
    """A ReqOutput after detokenization: the cumulative text so far."""

    out: ReqOutput
    text: str


@dataclass
class BatchStrOut:
    outputs: list[ReqTextOutput]
