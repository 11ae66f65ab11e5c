"""Turns next-token logits into tokens, one row per request, for any mix of sampling settings.

Order of operations per row: logit bias → repetition / frequency / presence penalties → the mask that
keeps stop tokens out before ``min_new_tokens`` → the grammar mask → greedy argmax, or temperature,
top-k, top-p and min-p filtering and a draw.

Draws are reproducible per request: each row's uniform number comes from a generator seeded with the
request's seed and its output position, so the same seed gives the same text whatever else is in the
batch, and a retracted request resumes exactly where it was. The draw is inverse-CDF over the filtered
distribution (a cumulative sum and one binary search), which costs far less on CPU than drawing a full
vocabulary of exponential noise.

Logprobs are those of the model (log-softmax of the raw logits), as OpenAI and SGLang report them.

:class:`RowwiseSampler` (``--enable-deterministic-inference``) runs the same code one row at a time: a
softmax, cumulative sum or log-softmax over ``[1, vocab]`` then has one shape whatever the batch, so its
float result (which may depend on how ATen splits a ``[B, vocab]`` reduction) is the row's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.core.sampling_params import SamplingParams

TOPP_CANDIDATES = 256  # top-p is searched among the best 256 first; a full sort only if they fall short


class SamplingRow(Protocol):
    """What the sampler needs to know of a request."""

    sampling: SamplingParams
    seed: int
    output_ids: list[int]
    input_ids: list[int]
    eos_ids: frozenset[int]
    return_logprob: bool
    top_logprobs_num: int
    grammar: object


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's logprob, for rows that asked
    top_logprobs: list[list[tuple[float, int]] | None]


class GrammarMasker(Protocol):
    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None: ...


class Sampler:
    def __init__(self, vocab_size: int, grammar_masker: GrammarMasker | None = None):
        self.vocab_size = vocab_size
        self.grammar_masker = grammar_masker

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        logits = logits[:, : self.vocab_size].float()
        n = len(rows)
        want_lp = [i for i, r in enumerate(rows) if r.return_logprob]
        raw_logp = self.log_softmax(logits[want_lp]) if want_lp else None

        logits = logits.clone()
        for i, r in enumerate(rows):
            self._adjust_row(logits[i], r)
        if self.grammar_masker is not None and any(r.grammar is not None for r in rows):
            self.grammar_masker.apply(logits, rows)

        tokens = [0] * n
        greedy = [i for i, r in enumerate(rows) if r.sampling.is_greedy]
        if greedy:
            ids = torch.argmax(logits[greedy], dim=-1).tolist()
            for i, t in zip(greedy, ids):
                tokens[i] = t
        drawn = [i for i, r in enumerate(rows) if not r.sampling.is_greedy]
        if drawn:
            for i, t in zip(drawn, self._draw(logits[drawn], [rows[i] for i in drawn])):
                tokens[i] = t

        logprobs: list[float | None] = [None] * n
        tops: list[list[tuple[float, int]] | None] = [None] * n
        if raw_logp is not None:
            chosen = torch.tensor([tokens[i] for i in want_lp])
            vals = raw_logp.gather(1, chosen[:, None]).squeeze(1).tolist()
            for j, i in enumerate(want_lp):
                logprobs[i] = vals[j]
                k = rows[i].top_logprobs_num
                if k > 0:
                    tv, ti = torch.topk(raw_logp[j], min(k, self.vocab_size))
                    tops[i] = list(zip(tv.tolist(), ti.tolist()))
        return SampleResult(tokens, logprobs, tops)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``[N, vocab]`` of fp32 logits rows (the model's logprobs)."""
        return torch.log_softmax(logits, dim=-1)

    # ------------------------------------------------------------------ per-row logit processing
    def _adjust_row(self, row: torch.Tensor, r: SamplingRow) -> None:
        sp = r.sampling
        if sp.logit_bias:
            idx = torch.tensor(list(sp.logit_bias.keys()))
            row.index_add_(0, idx, torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype))
        if sp.has_penalties:
            apply_penalties(row, r.input_ids, r.output_ids, sp)
        if len(r.output_ids) < sp.min_new_tokens:
            banned = set(sp.stop_token_ids)
            if not sp.ignore_eos:
                banned |= r.eos_ids
            if banned:
                row[torch.tensor(sorted(banned))] = float("-inf")

    # ------------------------------------------------------------------ random draws
    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        temps = torch.tensor([r.sampling.temperature for r in rows], dtype=logits.dtype)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        for i, r in enumerate(rows):
            sp = r.sampling
            if sp.top_k > 0 or sp.top_p < 1.0:
                restrict_top_k_top_p(probs[i], sp.top_k, sp.top_p)
            if sp.min_p > 0:
                p = probs[i]
                p[p < sp.min_p * p.max()] = 0.0
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.empty(len(rows), dtype=cdf.dtype)
        gen = torch.Generator()
        for i, r in enumerate(rows):
            gen.manual_seed(draw_seed(r.seed, len(r.output_ids)))
            u[i] = torch.rand((), generator=gen, dtype=torch.float64)
        target = (u * cdf[:, -1])[:, None]
        picks = torch.searchsorted(cdf, target, right=True).squeeze(1)
        picks = torch.minimum(picks, torch.full_like(picks, self.vocab_size - 1))
        out = picks.tolist()
        for i, t in enumerate(out):
            # searchsorted lands on a token whose cumulative mass rises, i.e. an allowed one; only a
            # target rounded up to the very end can miss, and then the likeliest token stands in.
            if probs[i, t] <= 0:
                out[i] = int(torch.argmax(probs[i]))
        return out


class RowwiseSampler(Sampler):
    """The same sampling, one row per call, so that no row's numbers depend on the other rows."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        out = SampleResult([], [], [])
        for i, row in enumerate(rows):
            one = super().sample(logits[i : i + 1], [row])
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
            out.top_logprobs += one.top_logprobs
        return out

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] <= 1:
            return torch.log_softmax(logits, dim=-1)
        return torch.cat([torch.log_softmax(logits[i : i + 1], dim=-1) for i in range(logits.shape[0])])


def make_sampler(vocab_size: int, deterministic: bool, grammar_masker: GrammarMasker | None = None) -> Sampler:
    cls = RowwiseSampler if deterministic else Sampler
    return cls(vocab_size, grammar_masker)


def draw_seed(seed: int, position: int) -> int:
    """Seed of the generator for one draw: a mix of the request's seed and the output position."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def restrict_top_k_top_p(p: torch.Tensor, top_k: int, top_p: float) -> None:
    """Zero every probability outside the top-k and outside the smallest set with mass >= top_p.

    Exact: the candidates are the best ``TOPP_CANDIDATES`` (or ``top_k``) tokens, and only when their
    mass is below ``top_p`` (a very flat distribution) is the whole row sorted.
    """
    k = top_k if top_k > 0 else min(TOPP_CANDIDATES, p.numel())
    vals, idx = torch.topk(p, min(k, p.numel()))
    if top_p < 1.0 and top_k <= 0 and float(vals.sum()) < top_p:
        vals, idx = torch.sort(p, descending=True)
    keep = vals.numel()
    if top_p < 1.0:
        total = float(p.sum())
        cum = torch.cumsum(vals, 0)
        # keep the tokens needed to reach top_p of the mass (at least one)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor(top_p * total, dtype=cum.dtype))) + 1)
    kept_idx = idx[:keep]
    kept = p[kept_idx].clone()
    p.zero_()
    p[kept_idx] = kept


def apply_penalties(row: torch.Tensor, prompt: Sequence[int], output: Sequence[int], sp: SamplingParams) -> None:
    """Repetition penalty over prompt and output tokens (divide positive logits, multiply negative);
    frequency and presence penalties over output tokens (OpenAI semantics)."""
    vocab = row.numel()
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt, *output) if t < vocab}), dtype=torch.int64)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if output and (sp.frequency_penalty or sp.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab)[:vocab].to(row.dtype)
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)
