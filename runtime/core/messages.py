"""Typed messages between the processes (and between the Engine's caller and its scheduler thread).

Every message is a dataclass; the ZMQ layer sends them with one codec (``runtime.server.ipc``). Token ids cross
process boundaries as lists inside these messages; outputs are batched per scheduler step.

A request's options (``RequestOptions``) are declared here once and travel as one object: the intake's
``SingleRequest``, the wire's ``TokenizedRequest`` and the scheduler's ``Req`` all hold the same instance
(tests/runtime/test_request_fields.py checks that no other dataclass re-declares them). Nothing here knows
HTTP: an abort says why it happened (``AbortCause``) and only runtime/http turns causes into statuses.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from runtime.core.sampling_params import SamplingParams


class AbortCause(Enum):
    """Why a request was aborted."""

    CLIENT = "client"  # its caller asked (abort_request, a disconnect, a sibling request of the call refused)
    TIMEOUT = "timeout"  # it ran past its deadline
    INVALID = "invalid"  # it cannot run as given: the intake refuses such requests, so only a grammar the
    #                      compiler refuses after the intake's check passed gets here
    ERROR = "error"  # the runtime stopped it while it ran (e.g. a token the grammar refuses)


@dataclass
class FinishReason:
    """Why a request ended, in SGLang's JSON shape."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    cause: AbortCause | None = None  # aborts only

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


@dataclass(frozen=True)
class RequestOptions:
    """Everything about one request besides its prompt and sampling parameters: what to report and how to
    treat it. Declared once; every layer passes this object along instead of copying its fields."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is reported (-1: none)
    top_logprobs_num: int = 0
    # The cache namespace (from cache_salt / extra_key): requests share cached prefixes only within one.
    cache_namespace: str | None = None
    priority: int = 0  # higher runs first when the server schedules by priority
    timeout: float | None = None  # seconds from arrival; past it the request is aborted and its KV freed
    stream: bool = False  # the scheduler sends its output every step (otherwise once, when it finishes)


# ---------------------------------------------------------------------- to the scheduler
@dataclass
class TokenizedRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)


@dataclass
class AbortRequest:
    rid: str
    message: str = "aborted by request"
    cause: AbortCause = AbortCause.CLIENT


def _query_id() -> str:
    return uuid.uuid4().hex


@dataclass(kw_only=True)
class ControlQuery:
    """A query the scheduler answers, between two steps, with a ControlReply carrying the same ``req_id``.
    One subclass per query; the scheduler process dispatches on the type."""

    req_id: str = field(default_factory=_query_id)


@dataclass
class ServerInfoQuery(ControlQuery):
    """Queues, KV accounting (integrity-checked), cache and scheduler statistics."""


@dataclass
class FlushCacheQuery(ControlQuery):
    """Drop every cached prefix (refused while requests are queued or running)."""


@dataclass
class IntegrityCheckQuery(ControlQuery):
    """Check the KV accounting (free + evictable + protected + private == capacity, one owner per page);
    the reply's data is the four terms and the capacity."""


@dataclass
class CacheTreeQuery(ControlQuery):
    """The radix tree for the dashboard, aggregated to at most ``max_nodes`` nodes."""

    max_nodes: int = 500
    min_tokens: int = 1  # subtrees with fewer tokens are folded into their parent's aggregate


@dataclass
class DashboardStatsQuery(ControlQuery):
    """The dashboard's cheap live figures (no integrity check, no drain of an in-flight batch)."""


@dataclass
class ControlReply:
    req_id: str
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)  # on failure: {"message": ...}
    # The exception a failed query raised, for the in-process transport, whose caller re-raises it as it is;
    # the ZMQ transport sends None (not every exception pickles), and its callers read ``data["message"]``.
    error: BaseException | None = None


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
    # speculative decoding (None when it is off): draft tokens verified for the request so far, and accepted
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None


@dataclass
class BatchTokenOut:
    outputs: list[ReqOutput]


@dataclass
class SchedulerStatus:
    """Load and cache figures the scheduler pushes about twice a second (for /metrics and routers), computed
    by ``Scheduler.status()`` alone (the dashboard's live figures and /get_server_info start from it too)."""

    num_running: int
    num_waiting: int
    token_usage: float  # share of KV capacity held by requests and locked prefixes
    cache_hit_rate: float
    decode_throughput: float
    cached_tokens: int
    capacity: int
    # Steps that ran a forward pass since start: the watchdog's evidence of progress while work is pending.
    forward_steps: int = 0
    # The KV pool's books: what running requests hold privately is capacity minus these three.
    kv_free: int = 0
    kv_evictable: int = 0
    kv_protected: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    cache_nodes: int = 0
    evicted_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_seconds: float = 0.0
    finished_requests: int = 0
    # Hits and traffic per memory tier ("device", and "host" / "disk" when those tiers are on), as
    # ``runtime.scheduler.results.tier_report`` gives them: numbers, except a disk tier's ``directory`` (str)
    # and ``writable`` (bool).
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # speculative decoding, cumulative: requests' decode steps that verified a draft, draft tokens verified,
    # and of those accepted (accepted / draft = acceptance rate; 1 + accepted / verifications = tokens per
    # verifying step)
    spec_verifications: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def kv_private(self) -> int:
        return self.capacity - self.kv_free - self.kv_evictable - self.kv_protected


@dataclass
class ReqTextOutput:
    """A ReqOutput after detokenization: the cumulative text so far."""

    out: ReqOutput
    text: str


@dataclass
class BatchStrOut:
    outputs: list[ReqTextOutput]
