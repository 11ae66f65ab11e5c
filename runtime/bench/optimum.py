"""The best cache hit rate a workload allows: what a perfect, unbounded prefix cache would have reused.

A measured hit rate means little alone (0.6 is excellent for one workload and poor for another), so every
run is compared with its optimum, computed from what was actually sent:

- every prompt is tokenized as the server sees it (completions: the prompt text; chat: the chat template
  with the generation prompt), with the model's own tokenizer;
- an unbounded radix cache is replayed in the order the client sent the requests: each prompt is matched
  (the longest cached prefix, at most ``len - 1`` tokens, because the last prompt token is always computed
  to produce the first output's logits) and then inserted; once a request has finished, its prompt plus
  each answer (as the next turn of a session would render it) is inserted too;
- optimum = sum of reusable tokens / sum of prompt tokens.

Accounting follows the OpenAI usage block: a request with ``n > 1`` counts its prompt once (the samples
after the first share its prefill), so the optimum is comparable with ``sum(cached_tokens) / sum(prompt_tokens)``.
Rendering the answer with the template is generous (it includes the end-of-turn marker and the newline the
template adds), so a real cache should stay at or below the optimum.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class PrefixTrie:
    """Token trie (one dict per node). Unbounded and never evicts: it models a cache with infinite memory.

    Sizes here are at most a few hundred thousand tokens per run, so a plain per-token trie is fast enough
    and obviously correct, which matters more for a reference figure than compactness."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}
        self.size = 0  # nodes == distinct cached prefixes' tokens

    def match(self, tokens: Sequence[int]) -> int:
        node = self.root
        n = 0
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n

    def insert(self, tokens: Sequence[int]) -> None:
        node = self.root
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                self.size += 1
            node = nxt


@dataclass
class SimRequest:
    """One HTTP request as the simulation needs it. Times are on any common clock (seconds)."""

    sent_at: float
    prompt: Sequence[int]
    done_at: float | None = None  # None: it failed, nothing is inserted after it
    after: list[Sequence[int]] = field(default_factory=list)  # prompt + answer, one per choice
    counted: bool = True  # False: inserted but left out of the rate (a failed request has no usage)


@dataclass
class OptimumResult:
    prompt_tokens: int
    reusable_tokens: int
    per_request: list[int]  # reusable tokens of each request, in the order given

    @property
    def rate(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate(requests: Sequence[SimRequest]) -> OptimumResult:
    """Replay the requests through an unbounded prefix cache (see the module docstring)."""
    # At equal times a finish is applied before a send: a session's next step is sent after the answer.
    events: list[tuple[float, int, int]] = []
    for i, r in enumerate(requests):
        events.append((r.sent_at, 1, i))
        if r.done_at is not None and r.after:
            events.append((r.done_at, 0, i))
    events.sort()
    trie = PrefixTrie()
    reused = [0] * len(requests)
    for _, kind, i in events:
        r = requests[i]
        if kind == 1:
            reused[i] = min(trie.match(r.prompt), max(len(r.prompt) - 1, 0))
            trie.insert(r.prompt)
        else:
            for seq in r.after:
                trie.insert(seq)
    total = sum(len(r.prompt) for r in requests if r.counted)
    return OptimumResult(total, sum(x for x, r in zip(reused, requests) if r.counted), reused)


class PromptTokenizer:
    """Turns request bodies into the token ids the server computes, with the server's own helpers."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer

    @classmethod
    def load(cls, path: str | Path | None = None) -> PromptTokenizer:
        """The tokenizer of a local model folder; default: the converted default model's."""
        from runtime.models.folders import load_tokenizer, resolve_model_path

        return cls(load_tokenizer(path if path is not None else resolve_model_path("default")))

    def prompt_ids(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        from runtime.models.tokenizer import apply_chat_template

        if endpoint == "completions":
            return list(self.tok(body["prompt"]).input_ids)  # as TokenizerManager.tokenize
        return apply_chat_template(self.tok, body["messages"])

    def answered_ids(self, endpoint: str, body: dict[str, Any], answer: str) -> list[int]:
        """The prompt followed by one answer, as a later request that continues it would tokenize it."""
        from runtime.models.tokenizer import apply_chat_template

        if endpoint == "completions":
            return list(self.tok(body["prompt"] + answer).input_ids)
        messages = [*body["messages"], {"role": "assistant", "content": answer}]
        return apply_chat_template(self.tok, messages, add_generation_prompt=False)


class RecordView(Protocol):
    """The fields of a client record the optimum needs (structural, so tests can build records by hand)."""

    endpoint: str
    body: dict[str, Any]
    sent_at: float
    done_at: float | None
    texts: dict[int, str]
    prompt_tokens: int | None

    @property
    def ok(self) -> bool: ...


def optimum_for(records: Iterable[RecordView], tokenizer: PromptTokenizer) -> tuple[OptimumResult, int]:
    """The optimum of a run, and how many requests' prompt sizes differ from the server's usage figure
    (non-zero means the server tokenizes differently from us, and the optimum is approximate)."""
    sims: list[SimRequest] = []
    mismatches = 0
    for r in records:
        prompt = tokenizer.prompt_ids(r.endpoint, r.body)
        if r.prompt_tokens is not None and r.prompt_tokens != len(prompt):
            mismatches += 1
        after: list[Sequence[int]] = (
            [tokenizer.answered_ids(r.endpoint, r.body, t) for t in r.texts.values()] if r.ok else [])
        # a failed request may still have been prefilled (so it is inserted) but has no usage to compare
        sims.append(SimRequest(r.sent_at, prompt, r.done_at if r.ok else None, after, counted=r.ok))
    return simulate(sims), mismatches
