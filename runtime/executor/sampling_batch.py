"""SamplingBatch: the sampling inputs of a batch's sampled rows as tensors, built once per batch on the
scheduler side (``Sampler.prepare``) when the batch is built.

It is a snapshot: the sampler reads only it, never a request. In the overlap loop the scheduler keeps
changing the requests (new tokens, finishes) while the batch waits on the worker thread, so everything a
row's sampling depends on is copied here: the settings, the row's draw (its uniform number, from the
request's seed and output position), the logit edits (bias, penalties, the ``min_new_tokens`` ban) as
sparse ``(row, token, value)`` triples, and which logprobs to report. Grammar matchers are the one thing
held by reference: a constrained request never has a token in flight when its batch is built (the overlap
loop runs it in lockstep), so its matcher is in the state the row needs.

Tensors are on the host; the sampler moves what it uses to the logits' device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.core.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What ``Sampler.prepare`` reads of a request (the scheduler's ``Req`` is one)."""

    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def seed(self) -> int: ...
    @property
    def output_ids(self) -> Sequence[int]: ...
    @property
    def input_ids(self) -> Sequence[int]: ...
    @property
    def eos_ids(self) -> frozenset[int]: ...
    @property
    def return_logprob(self) -> bool: ...
    @property
    def top_logprobs_num(self) -> int: ...
    @property
    def grammar(self) -> Any: ...


def draw_seed(seed: int, position: int) -> int:
    """Seed of the generator for one draw: a mix of the request's seed and the output position."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True)
class TokenPairs:
    """A sparse ``[rows, vocab]`` matrix: one value at each ``(row, token)`` (no pair twice)."""

    rows: torch.Tensor  # [N] int64, rows of the batch
    tokens: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0

    def of_row(self, i: int) -> TokenPairs:
        """Row ``i``'s pairs, as row 0 of a batch of one."""
        keep = self.rows == i
        tokens = self.tokens[keep]
        return TokenPairs(torch.zeros_like(tokens), tokens, self.values[keep])

    def add_to(self, logits: torch.Tensor) -> None:
        if not self.empty:
            dev = logits.device
            logits.index_put_((self.rows.to(dev), self.tokens.to(dev)), self.values.to(dev, logits.dtype),
                              accumulate=True)

    def put_into(self, logits: torch.Tensor) -> None:
        if not self.empty:
            dev = logits.device
            logits.index_put_((self.rows.to(dev), self.tokens.to(dev)), self.values.to(dev, logits.dtype))


class _PairsBuilder:
    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def add(self, row: int, tokens: torch.Tensor, values: torch.Tensor) -> None:
        self.rows.append(torch.full_like(tokens, row))
        self.tokens.append(tokens)
        self.values.append(values.to(torch.float32))

    def build(self) -> TokenPairs:
        if not self.rows:
            none = torch.zeros(0, dtype=torch.int64)
            return TokenPairs(none, none, torch.zeros(0))
        return TokenPairs(torch.cat(self.rows), torch.cat(self.tokens), torch.cat(self.values))


def _ids(ids: Sequence[int] | set[int], vocab_size: int) -> torch.Tensor:
    t = torch.tensor(list(ids), dtype=torch.int64)
    return t[t < vocab_size]


@dataclass(frozen=True)
class SamplingBatch:
    """Per row (``[B]`` tensors, lists of length B) unless said otherwise."""

    greedy: torch.Tensor  # bool: the argmax (temperature ~0 or top_k 1)
    temperature: torch.Tensor  # float32 (1 for greedy rows, never read)
    top_k: torch.Tensor  # int64, 0: no top-k cut
    top_p: torch.Tensor  # float64 (the mass threshold is computed in double)
    min_p: torch.Tensor  # float32
    uniform: torch.Tensor  # float64 in [0, 1): the row's draw (0 for greedy rows)
    logit_bias: TokenPairs  # added to the logits
    repetition: TokenPairs  # the penalty, at every distinct prompt and output token of the row
    output_penalty: TokenPairs  # -(frequency * count + presence), added at every distinct output token
    banned: TokenPairs  # -inf: stop tokens (and EOS) while fewer than min_new_tokens were output
    return_logprob: torch.Tensor  # bool
    top_logprobs: torch.Tensor  # int64, how many top logprobs (rows that return logprobs)
    grammars: list[Any]  # the row's grammar matcher, or None

    @property
    def size(self) -> int:
        return self.greedy.numel()

    @property
    def edits_logits(self) -> bool:
        """Something changes the logits before the choice (bias, penalties, a ban, a grammar)."""
        return not (self.logit_bias.empty and self.repetition.empty and self.output_penalty.empty
                    and self.banned.empty) or self.has_grammar

    @property
    def has_grammar(self) -> bool:
        return any(g is not None for g in self.grammars)

    def row(self, i: int) -> SamplingBatch:
        """Row ``i`` alone, as a batch of one."""
        picked: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            picked[f.name] = v.of_row(i) if isinstance(v, TokenPairs) else v[i : i + 1]
        return SamplingBatch(**picked)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, pending: Sequence[bool] = ()) -> SamplingBatch:
        """``pending[i]``: row i's previous token is still being sampled by the batch in flight (overlap
        loop). It counts as output (draw position, ``min_new_tokens``); its value is never needed, since
        rows whose sampling reads output values are never built ahead."""
        greedy, temperature, top_k, top_p, min_p, uniform = [], [], [], [], [], []
        bias, repetition, output_penalty, banned = _PairsBuilder(), _PairsBuilder(), _PairsBuilder(), _PairsBuilder()
        gen = torch.Generator()
        for i, r in enumerate(rows):
            sp = r.sampling
            ahead = bool(pending[i]) if pending else False
            position = len(r.output_ids) + ahead  # tokens output before the one sampled here
            is_greedy = sp.is_greedy
            greedy.append(is_greedy)
            temperature.append(1.0 if is_greedy else sp.temperature)
            top_k.append(max(sp.top_k, 0))
            top_p.append(sp.top_p)
            min_p.append(sp.min_p)
            if is_greedy:
                uniform.append(0.0)
            else:  # one scalar per row from the row's own generator: the same draw whatever the batch
                gen.manual_seed(draw_seed(r.seed, position))
                uniform.append(torch.rand((), generator=gen, dtype=torch.float64).item())
            if sp.logit_bias:
                bias.add(i, torch.tensor(list(sp.logit_bias), dtype=torch.int64),
                         torch.tensor(list(sp.logit_bias.values())))
            if sp.has_penalties:
                assert not ahead, "a penalised row reads its previous tokens: it is never built ahead"
                _add_penalties(i, r, vocab_size, repetition, output_penalty)
            if position < sp.min_new_tokens:
                ban = set(sp.stop_token_ids) | (set() if sp.ignore_eos else r.eos_ids)
                if ban:
                    ids = _ids(ban, vocab_size)
                    banned.add(i, ids, torch.full(ids.shape, float("-inf")))
            assert not (ahead and r.grammar is not None), "a constrained row is never built ahead"
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool),
            temperature=torch.tensor(temperature, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.int64),
            top_p=torch.tensor(top_p, dtype=torch.float64),
            min_p=torch.tensor(min_p, dtype=torch.float32),
            uniform=torch.tensor(uniform, dtype=torch.float64),
            logit_bias=bias.build(),
            repetition=repetition.build(),
            output_penalty=output_penalty.build(),
            banned=banned.build(),
            return_logprob=torch.tensor([r.return_logprob for r in rows], dtype=torch.bool),
            top_logprobs=torch.tensor([r.top_logprobs_num if r.return_logprob else 0 for r in rows],
                                      dtype=torch.int64),
            grammars=[r.grammar for r in rows],
        )


def _add_penalties(i: int, r: SamplingRow, vocab_size: int, repetition: _PairsBuilder,
                   output_penalty: _PairsBuilder) -> None:
    """Repetition penalty over prompt and output tokens; frequency and presence penalties over output tokens
    (OpenAI semantics), as the amount each distinct output token's logit loses."""
    sp = r.sampling
    if sp.repetition_penalty != 1.0:
        seen = torch.unique(_ids([*r.input_ids, *r.output_ids], vocab_size))
        repetition.add(i, seen, torch.full(seen.shape, sp.repetition_penalty))
    if r.output_ids and (sp.frequency_penalty or sp.presence_penalty):
        tokens, counts = torch.unique(_ids(r.output_ids, vocab_size), return_counts=True)
        # float32 throughout, as a dense ``frequency * counts + presence * (counts > 0)`` would compute it
        amount = (torch.tensor(sp.frequency_penalty, dtype=torch.float32) * counts.to(torch.float32)
                  + torch.tensor(sp.presence_penalty, dtype=torch.float32))
        output_penalty.add(i, tokens, -amount)  # added: x + (-a) is x - a exactly
