"""Turns next-token logits into tokens for a batch with any mix of sampling settings, in whole-batch
tensor operations.

``Sampler.prepare(rows)`` snapshots the rows' settings as a :class:`SamplingBatch` when the batch is built
(scheduler side); ``Sampler.sample(logits, batch)`` runs on the logits' device. Order of operations per row:
logit bias → repetition / frequency / presence penalties → the mask that keeps stop tokens out before
``min_new_tokens`` → the grammar mask → greedy argmax, or temperature, top-k, top-p and min-p filtering and
a draw. Each step is one operation over the batch (index ops for the sparse edits, one top-k for the
candidates of every filtered row); no Python loop runs per row except the grammar mask's and the packing
of logprobs into lists.

Draws are reproducible per request: each row's uniform number comes from a generator seeded with the
request's seed and its output position (drawn in ``prepare``), so the same seed gives the same text
whatever else is in the batch, and a retracted request resumes exactly where it was. The draw is
inverse-CDF over the filtered distribution (a cumulative sum and one binary search), which costs far less
on CPU than drawing a full vocabulary of exponential noise.

Logprobs are those of the model (log-softmax of the raw logits), as OpenAI and SGLang report them.

:class:`RowwiseSampler` (``--enable-deterministic-inference``) runs the same code one row at a time: a
softmax, cumulative sum or log-softmax over ``[1, vocab]`` then has one shape whatever the batch, so its
float result (which may depend on how ATen splits a ``[B, vocab]`` reduction) is the row's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.executor.sampling_batch import SamplingBatch, SamplingRow, TokenPairs

FIRST_CANDIDATES = 32  # top-p is searched among each row's best 32 tokens first (a peaked head) ...
TOPP_CANDIDATES = 256  # ... then among the best 256, and only then in a full sort


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's logprob, for rows that asked
    top_logprobs: list[list[tuple[float, int]] | None]


class GrammarMasker(Protocol):
    def apply(self, logits: torch.Tensor, grammars: Sequence[Any]) -> None: ...


class Sampler:
    def __init__(self, vocab_size: int, grammar_masker: GrammarMasker | None = None):
        self.vocab_size = vocab_size
        self.grammar_masker = grammar_masker

    def prepare(self, rows: Sequence[SamplingRow], pending: Sequence[bool] = ()) -> SamplingBatch:
        """The rows' sampling inputs as tensors (see :meth:`SamplingBatch.build` for ``pending``)."""
        return SamplingBatch.build(rows, self.vocab_size, pending)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        assert logits.shape[0] == batch.size, "one logits row per sampled row"
        logits = logits[:, : self.vocab_size].float()
        want = batch.return_logprob.nonzero().squeeze(1)
        raw_logp = self.log_softmax(logits[want.to(logits.device)]) if want.numel() else None
        owned = batch.edits_logits
        if owned:
            logits = logits.clone()
            edit_logits(logits, batch)
            if self.grammar_masker is not None and batch.has_grammar:
                self.grammar_masker.apply(logits, batch.grammars)
        tokens = self._choose(logits, batch, owned)
        ids = tokens.tolist()
        logprobs: list[float | None] = [None] * len(ids)
        tops: list[list[tuple[float, int]] | None] = [None] * len(ids)
        if raw_logp is not None:
            pack_logprobs(raw_logp, want, tokens, batch.top_logprobs, logprobs, tops)
        return SampleResult(ids, logprobs, tops)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``[N, vocab]`` of fp32 logits rows (the model's logprobs)."""
        return torch.log_softmax(logits, dim=-1)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch, owned: bool) -> torch.Tensor:
        """The tokens; ``owned``: ``logits`` is the sampler's own copy (it may be overwritten)."""
        drawn = (~batch.greedy).nonzero().squeeze(1)
        if drawn.numel() == 0:
            return argmax(logits)
        if drawn.numel() == batch.size:
            return draw(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.uniform,
                        inplace=owned)
        # every row's argmax (one read of the batch, no copy of the greedy rows), then the draws over it
        tokens = argmax(logits)
        d = drawn.to(logits.device)
        tokens[d] = draw(logits.index_select(0, d), batch.temperature[drawn], batch.top_k[drawn],
                         batch.top_p[drawn], batch.min_p[drawn], batch.uniform[drawn], inplace=True)
        return tokens


class RowwiseSampler(Sampler):
    """The same sampling, one row per call, so that no row's numbers depend on the other rows."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        out = SampleResult([], [], [])
        for i in range(batch.size):
            one = super().sample(logits[i : i + 1], batch.row(i))
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
            out.top_logprobs += one.top_logprobs
        return out

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] <= 1:
            return torch.log_softmax(logits, dim=-1)
        return torch.cat([torch.log_softmax(logits[i : i + 1], dim=-1) for i in range(logits.shape[0])])


def make_sampler(vocab_size: int, deterministic: bool, grammar_masker: GrammarMasker | None = None,
                 device: torch.device | None = None) -> Sampler:
    """The sampler for logits on ``device``: on CPU the kernels ``argmax`` uses are loaded now, at start-up,
    rather than inside the first step that samples."""
    if device is not None and device.type == "cpu":
        from runtime.kernels.build import optional_kernels

        optional_kernels("fastcpu")
    cls = RowwiseSampler if deterministic else Sampler
    return cls(vocab_size, grammar_masker)


# ---------------------------------------------------------------------- the steps, each over the whole batch
def edit_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Logit bias, then penalties, then the ``min_new_tokens`` ban, in place."""
    batch.logit_bias.add_to(logits)
    apply_repetition_penalty(logits, batch.repetition)
    batch.output_penalty.add_to(logits)  # frequency and presence (values are negative amounts)
    batch.banned.put_into(logits)


def apply_repetition_penalty(logits: torch.Tensor, pairs: TokenPairs) -> None:
    """At each pair's token: divide a positive logit by the penalty, multiply a negative one."""
    if pairs.empty:
        return
    dev = logits.device
    at = (pairs.rows.to(dev), pairs.tokens.to(dev))
    vals, pen = logits[at], pairs.values.to(dev, logits.dtype)
    logits[at] = torch.where(vals > 0, vals / pen, vals * pen)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row, NaN counting as the largest: ``max`` with indices (the same answer as
    ``argmax``, faster on CPU), or for fp32 logits on CPU the fastcpu kernel that gives the same answer (torch's
    compares one element at a time: 0.1-0.25 ms of a batch-8 decode step over SmolLM2's 49,152 logits)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
        from runtime.kernels.build import optional_kernels

        kernels = optional_kernels("fastcpu")
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return torch.max(logits, dim=-1).indices


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         min_p: torch.Tensor, uniform: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """One token per row: softmax at the row's temperature, top-k / top-p / min-p filtering, then the
    inverse CDF at the row's uniform number. Settings are host tensors, one entry per row; ``inplace``:
    ``logits`` may be overwritten.

    Two ``[rows, vocab]`` buffers serve every step (scaled logits → filtered probabilities, probabilities
    → CDF): on a CPU host a fresh buffer of that size costs page faults worth a pass over the data."""
    dev = logits.device
    vocab = logits.shape[1]
    t = temperature.to(dev)[:, None]
    scaled = logits.div_(t) if inplace else logits / t
    probs = torch.softmax(scaled, dim=-1)
    cut = ((top_k > 0) | (top_p < 1.0)).nonzero().squeeze(1)
    if cut.numel() == probs.shape[0]:
        filtered = restrict_top_k_top_p(probs, top_k, top_p, out=scaled)
    elif cut.numel():
        c = cut.to(dev)
        filtered = scaled.copy_(probs)
        filtered.index_copy_(0, c, restrict_top_k_top_p(probs.index_select(0, c), top_k[cut], top_p[cut]))
    else:
        filtered = probs
    if bool((min_p > 0).any()):  # a row with min_p 0 has threshold 0: nothing is below it
        floor = min_p.to(dev)[:, None] * filtered.amax(dim=-1, keepdim=True)
        filtered.masked_fill_(filtered < floor, 0.0)
    cdf = torch.cumsum(filtered, dim=-1, out=probs if filtered is scaled else scaled)
    target = (uniform.to(dev, cdf.dtype) * cdf[:, -1])[:, None]
    picks = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
    # searchsorted lands on a token whose cumulative mass rises, i.e. an allowed one; only a target rounded
    # up to the very end can miss, and then the likeliest token stands in.
    missed = filtered.gather(1, picks[:, None]).squeeze(1) <= 0
    if bool(missed.any()):
        picks = torch.where(missed, argmax(filtered), picks)
    return picks


def restrict_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``probs`` with every token outside the row's top-k and outside its smallest set with mass >= top_p
    (at least one token) set to 0, written to ``out`` (a new tensor if None). ``top_k``: 0 for no cut;
    ``top_p``: 1 for no cut (host tensors).

    Exact, in widening stages: one top-k of the batch gives every row its best ``max(top_k,
    FIRST_CANDIDATES)`` tokens; rows without a top-k whose nucleus is not among them (flatter
    distributions) go on to ``TOPP_CANDIDATES``, and those still short are sorted in full."""
    vocab = probs.shape[1]
    dev = probs.device
    out = torch.zeros_like(probs) if out is None else out.zero_()
    total = probs.sum(dim=-1)
    rows = torch.arange(probs.shape[0])  # host: the rows still to be cut
    width = int(torch.where(top_k > 0, top_k, FIRST_CANDIDATES).max())
    while rows.numel():
        width = min(width, vocab)
        r = rows.to(dev)
        sub = probs.index_select(0, r) if rows.numel() < probs.shape[0] else probs
        vals, idx = torch.topk(sub, width, dim=-1) if width < vocab else torch.sort(sub, dim=-1, descending=True)
        keep, short = _keep_counts(vals, total.index_select(0, r), top_k[rows], top_p[rows])
        if width == vocab:  # all candidates seen: a rounding shortfall keeps the whole row
            short = torch.zeros_like(short)
        kept = torch.where(torch.arange(width, device=dev)[None, :] < keep[:, None], vals, 0.0)
        done = (~short).nonzero().squeeze(1)
        out.index_put_((r.index_select(0, done)[:, None], idx.index_select(0, done)), kept.index_select(0, done))
        rows = rows[short.cpu()]
        width = TOPP_CANDIDATES if width < TOPP_CANDIDATES else vocab
    return out


def _keep_counts(vals: torch.Tensor, total: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of each row's candidates ``vals`` (sorted, descending) to keep, and which rows' candidates
    fall short of top_p (rows without a top-k: they need more candidates)."""
    dev = vals.device
    width = vals.shape[1]
    k, p = top_k.to(dev), top_p.to(dev)
    keep = torch.where(k > 0, k.clamp(max=width), width)
    # tokens needed to reach top_p of the row's mass (width + 1: not reached among the candidates)
    threshold = (p * total.double()).to(vals.dtype)[:, None]
    needed = torch.searchsorted(torch.cumsum(vals, dim=-1), threshold).squeeze(1) + 1
    nucleus = p < 1.0
    keep = torch.where(nucleus, torch.minimum(keep, needed), keep)
    short = nucleus & (k <= 0) & (needed > width)
    return keep, short


def pack_logprobs(raw_logp: torch.Tensor, want: torch.Tensor, tokens: torch.Tensor, top_n: torch.Tensor,
                  logprobs: list[float | None], tops: list[list[tuple[float, int]] | None]) -> None:
    """Fill the result lists at rows ``want`` (host) from their log-probabilities ``raw_logp``: the chosen
    token's, and the ``top_n[row]`` best (one top-k for all of them)."""
    chosen = tokens.index_select(0, want.to(tokens.device))
    vals = raw_logp.gather(1, chosen[:, None]).squeeze(1).tolist()
    n = top_n[want]
    most = int(n.max())
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if most > 0:
        tv, ti = torch.topk(raw_logp, min(most, raw_logp.shape[1]), dim=-1)
        top_vals, top_ids = tv.tolist(), ti.tolist()
    for j, (i, k) in enumerate(zip(want.tolist(), n.tolist())):
        logprobs[i] = vals[j]
        if k > 0:
            tops[i] = list(zip(top_vals[j][:k], top_ids[j][:k]))
