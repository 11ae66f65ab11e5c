"""The vectorised sampler (``Sampler.prepare`` → ``SamplingBatch`` → ``Sampler.sample``) against the per-row
algorithm it replaced, kept here as the reference: same tokens, same logprobs, for mixed batches; seeded
draws independent of the batch; filters that keep exactly the allowed tokens, at the right frequencies."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from runtime.core.sampling_params import SamplingParams
from runtime.executor.sampler import (
    FIRST_CANDIDATES,
    TOPP_CANDIDATES,
    RowwiseSampler,
    Sampler,
    SampleResult,
    argmax,
    edit_logits,
    restrict_top_k_top_p,
)
from runtime.executor.sampling_batch import draw_seed
from runtime.kernels.build import optional_kernels


@dataclass
class Row:
    """A request as ``Sampler.prepare`` reads it."""

    sampling: SamplingParams
    seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    eos_ids: frozenset[int] = frozenset({0})
    return_logprob: bool = False
    top_logprobs_num: int = 0
    grammar: Any = None


# ---------------------------------------------------------------------- the reference: the per-row sampler
def ref_sample(logits: torch.Tensor, rows: Sequence[Row], vocab: int) -> SampleResult:
    logits = logits[:, :vocab].float()
    n = len(rows)
    want_lp = [i for i, r in enumerate(rows) if r.return_logprob]
    raw_logp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
    logits = logits.clone()
    for i, r in enumerate(rows):
        ref_adjust_row(logits[i], r)
    tokens = [0] * n
    greedy = [i for i, r in enumerate(rows) if r.sampling.is_greedy]
    if greedy:
        for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            tokens[i] = t
    drawn = [i for i, r in enumerate(rows) if not r.sampling.is_greedy]
    if drawn:
        for i, t in zip(drawn, ref_draw(logits[drawn], [rows[i] for i in drawn], vocab)):
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
                tv, ti = torch.topk(raw_logp[j], min(k, vocab))
                tops[i] = list(zip(tv.tolist(), ti.tolist()))
    return SampleResult(tokens, logprobs, tops)


def ref_adjust_row(row: torch.Tensor, r: Row) -> None:
    sp = r.sampling
    if sp.logit_bias:
        idx = torch.tensor(list(sp.logit_bias.keys()))
        row.index_add_(0, idx, torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype))
    if sp.has_penalties:
        ref_apply_penalties(row, r.input_ids, r.output_ids, sp)
    if len(r.output_ids) < sp.min_new_tokens:
        banned = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            banned |= r.eos_ids
        if banned:
            row[torch.tensor(sorted(banned))] = float("-inf")


def ref_draw(logits: torch.Tensor, rows: Sequence[Row], vocab: int) -> list[int]:
    temps = torch.tensor([r.sampling.temperature for r in rows], dtype=logits.dtype)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    for i, r in enumerate(rows):
        sp = r.sampling
        if sp.top_k > 0 or sp.top_p < 1.0:
            ref_restrict_top_k_top_p(probs[i], sp.top_k, sp.top_p)
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
    picks = torch.minimum(picks, torch.full_like(picks, vocab - 1))
    out = picks.tolist()
    for i, t in enumerate(out):
        if probs[i, t] <= 0:
            out[i] = int(torch.argmax(probs[i]))
    return out


def ref_restrict_top_k_top_p(p: torch.Tensor, top_k: int, top_p: float) -> None:
    k = top_k if top_k > 0 else min(256, p.numel())
    vals, idx = torch.topk(p, min(k, p.numel()))
    if top_p < 1.0 and top_k <= 0 and float(vals.sum()) < top_p:
        vals, idx = torch.sort(p, descending=True)
    keep = vals.numel()
    if top_p < 1.0:
        total = float(p.sum())
        cum = torch.cumsum(vals, 0)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor(top_p * total, dtype=cum.dtype))) + 1)
    kept_idx = idx[:keep]
    kept = p[kept_idx].clone()
    p.zero_()
    p[kept_idx] = kept


def ref_apply_penalties(row: torch.Tensor, prompt: Sequence[int], output: Sequence[int], sp: SamplingParams) -> None:
    vocab = row.numel()
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt, *output) if t < vocab}), dtype=torch.int64)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if output and (sp.frequency_penalty or sp.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab)[:vocab].to(row.dtype)
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)


# ---------------------------------------------------------------------- helpers
def random_row(rng: random.Random, vocab: int) -> Row:
    kind = rng.choice(["greedy", "temp", "top_k", "top_p", "min_p", "all", "top_k_1"])
    sp: dict[str, Any] = {"temperature": round(rng.uniform(0.3, 1.5), 3)}
    if kind == "greedy":
        sp["temperature"] = 0.0
    if kind in ("top_k", "all"):
        sp["top_k"] = rng.choice([2, 5, 40, 300])
    if kind == "top_k_1":
        sp["top_k"] = 1
    if kind in ("top_p", "all"):
        sp["top_p"] = rng.choice([0.5, 0.9, 0.95, 0.999])
    if kind in ("min_p", "all"):
        sp["min_p"] = rng.choice([0.01, 0.05, 0.2])
    if rng.random() < 0.3:
        sp["repetition_penalty"] = rng.choice([0.8, 1.3])
    if rng.random() < 0.3:
        sp["frequency_penalty"] = rng.choice([-0.5, 0.7])
    if rng.random() < 0.3:
        sp["presence_penalty"] = rng.choice([0.4, -1.0])
    if rng.random() < 0.3:
        sp["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randint(1, 4))}
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
    if rng.random() < 0.3:
        sp["min_new_tokens"] = len(output) + rng.randint(0, 2)
        sp["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        sp["ignore_eos"] = rng.random() < 0.5
    sp["max_new_tokens"] = 100
    want = rng.random() < 0.4
    return Row(SamplingParams(**sp), seed=rng.getrandbits(62), output_ids=output,
               input_ids=[rng.randrange(vocab + 20) for _ in range(rng.randint(1, 30))],  # some >= vocab
               eos_ids=frozenset({rng.randrange(vocab)}), return_logprob=want,
               top_logprobs_num=rng.choice([0, 1, 5]) if want else 0)


def model_like_logits(n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Rows from peaked (a few strong tokens) to flat (a nucleus of thousands of tokens)."""
    x = torch.randn(n, vocab, generator=g)
    for i in range(n):
        boost = float(torch.rand((), generator=g)) * 14
        top = torch.randperm(vocab, generator=g)[:20]
        x[i, top] += torch.linspace(boost, 0, 20)
    return x


def assert_same(new: SampleResult, ref: SampleResult) -> None:
    assert new.token_ids == ref.token_ids
    for a, b in zip(new.logprobs, ref.logprobs):
        assert (a is None) == (b is None) and (a is None or math.isclose(a, b, rel_tol=0, abs_tol=1e-6))
    for ta, tb in zip(new.top_logprobs, ref.top_logprobs):
        assert (ta is None) == (tb is None)
        if ta is not None and tb is not None:
            assert [t for _, t in ta] == [t for _, t in tb]
            assert all(math.isclose(x, y, abs_tol=1e-6) for (x, _), (y, _) in zip(ta, tb))


# ---------------------------------------------------------------------- the tests
@pytest.mark.parametrize("vocab", [1000, 49152])
def test_mixed_batches_equal_the_per_row_reference(vocab):
    rng = random.Random(vocab)
    g = torch.Generator().manual_seed(vocab)
    sampler = Sampler(vocab)
    for _ in range(12 if vocab < 10_000 else 3):
        rows = [random_row(rng, vocab) for _ in range(rng.randint(1, 24))]
        logits = model_like_logits(len(rows), vocab + 3, g)  # padded vocabulary columns are cut
        assert_same(sampler.sample(logits, sampler.prepare(rows)), ref_sample(logits, rows, vocab))


def test_seeded_draws_do_not_depend_on_the_batch():
    vocab = 5000
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    sampler = Sampler(vocab)
    rows = [random_row(rng, vocab) for _ in range(32)]
    logits = model_like_logits(len(rows), vocab, g)
    batch = sampler.sample(logits, sampler.prepare(rows))
    drawn = 0
    for i, row in enumerate(rows):
        alone = sampler.sample(logits[i : i + 1], sampler.prepare([row]))
        assert alone.token_ids == batch.token_ids[i : i + 1], f"row {i}: {row.sampling}"
        drawn += not row.sampling.is_greedy
    assert drawn >= 10
    # and the draw is the row's own: another seed (or output position) moves some of them
    moved = [Row(r.sampling, r.seed + 1, r.output_ids, r.input_ids, r.eos_ids) for r in rows]
    assert sampler.sample(logits, sampler.prepare(moved)).token_ids != batch.token_ids


def test_rowwise_sampler_computes_each_row_alone():
    vocab = 3000
    rng = random.Random(3)
    rows = [random_row(rng, vocab) for _ in range(16)]
    for r in rows:
        r.return_logprob, r.top_logprobs_num = True, 3
    logits = model_like_logits(len(rows), vocab, torch.Generator().manual_seed(3))
    rowwise = RowwiseSampler(vocab)
    out = rowwise.sample(logits, rowwise.prepare(rows))
    plain = Sampler(vocab)
    for i, row in enumerate(rows):
        one = plain.sample(logits[i : i + 1], plain.prepare([row]))
        assert out.token_ids[i] == one.token_ids[0]
        assert out.logprobs[i] == one.logprobs[0]  # bit for bit: the same [1, vocab] computation
        assert out.top_logprobs[i] == one.top_logprobs[0]


def test_a_pending_token_counts_as_output():
    """Overlap loop: a row built while its previous token is in flight draws at the next position and
    counts that token toward min_new_tokens, without its value."""
    vocab = 100
    sampler = Sampler(vocab)
    sp = SamplingParams(temperature=1.0, min_new_tokens=3, stop_token_ids=[7])
    ahead = sampler.prepare([Row(sp, seed=11, output_ids=[4, 5])], pending=[True])
    caught_up = sampler.prepare([Row(sp, seed=11, output_ids=[4, 5, 6])])
    assert ahead.uniform.tolist() == caught_up.uniform.tolist()
    assert ahead.banned.empty and caught_up.banned.empty
    behind = sampler.prepare([Row(sp, seed=11, output_ids=[4, 5])])
    assert behind.uniform.tolist() != ahead.uniform.tolist()
    assert sorted(behind.banned.tokens.tolist()) == [0, 7]  # the stop token and EOS
    with pytest.raises(AssertionError):  # a penalised row reads previous values: never built ahead
        sampler.prepare([Row(SamplingParams(presence_penalty=1.0), output_ids=[1])], pending=[True])


def test_the_batch_is_a_snapshot():
    vocab = 50
    sampler = Sampler(vocab)
    row = Row(SamplingParams(temperature=0.0, logit_bias={9: 100.0}), output_ids=[1])
    batch = sampler.prepare([row])
    row.sampling.logit_bias[9] = -100.0
    row.sampling.temperature = 1.0
    row.output_ids.append(2)
    assert sampler.sample(torch.zeros(1, vocab), batch).token_ids == [9]


def test_penalties_and_bias_edit_only_their_tokens():
    vocab = 6
    sampler = Sampler(vocab)
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0, 0.0]])
    row = Row(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                             logit_bias={5: 1.5}), input_ids=[0, 9], output_ids=[1, 1, 2])
    expected = torch.tensor([[1.0, -4.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.5, 3.0, 1.5]])
    edited = logits.clone()
    ref_adjust_row(edited[0], row)
    assert torch.equal(edited, expected)
    batch = sampler.prepare([row])
    mine = logits.clone()
    edit_logits(mine, batch)
    assert torch.equal(mine, expected)


def nucleus(p: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The allowed tokens, from a full sort (ties broken by the lower id, as no test below has ties)."""
    order = torch.argsort(p, descending=True).tolist()
    k = top_k if top_k > 0 else len(order)
    cum, kept = 0.0, []
    for t in order[:k]:
        kept.append(t)
        cum += float(p[t])
        if top_p < 1.0 and cum >= top_p * float(p.sum()):
            break
    return set(kept)


def stage(size: int) -> int:
    """Which candidate stage of ``restrict_top_k_top_p`` finds a nucleus of ``size`` tokens (no top-k)."""
    return 1 if size <= FIRST_CANDIDATES else 2 if size <= TOPP_CANDIDATES else 3


@pytest.mark.parametrize(("scale", "stages"), [(8.0, {1}), (2.0, {2, 3}), (0.5, {3}), (0.05, {3})])
def test_top_k_top_p_keep_exactly_the_nucleus(scale, stages):
    vocab = 4000
    g = torch.Generator().manual_seed(int(scale * 100))
    probs = torch.softmax(torch.randn(6, vocab, generator=g, dtype=torch.float64) * scale, dim=-1).float()
    settings = [(0, 0.9), (0, 0.5), (10, 0.95), (400, 0.99), (3, 1.0), (0, 0.999)]
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings], dtype=torch.float64)
    out = restrict_top_k_top_p(probs, top_k, top_p)
    for i, (k, p) in enumerate(settings):
        kept = set(out[i].nonzero().squeeze(1).tolist())
        assert kept == nucleus(probs[i], k, p), (i, k, p)
        assert torch.equal(out[i][list(kept)], probs[i][list(kept)])  # kept probabilities untouched
    assert {stage(len(nucleus(probs[i], k, p))) for i, (k, p) in enumerate(settings) if k == 0} == stages


def chi_square_bound(dof: int, z: float = 4.26) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile at normal deviate ``z`` (4.26: p ~ 1e-5)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(("settings", "allowed"), [
    ({"top_k": 4}, [0, 1, 2, 3]),
    ({"top_p": 0.7}, [0, 1, 2]),  # masses .30 .25 .20: .55 < .7 <= .75
    ({"min_p": 0.5}, [0, 1, 2]),  # .20 >= .5 * .30 > .10
    ({"top_k": 3, "top_p": 0.5, "min_p": 0.1}, [0, 1]),
])
def test_filtered_draws_follow_the_renormalised_distribution(settings, allowed):
    probs = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.05, 0.04, 0.03, 0.02, 0.01])
    vocab = probs.numel()
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))  # not in vocabulary order
    logits = torch.empty(vocab)
    logits[perm] = torch.log(probs)
    n = 20_000
    sampler = Sampler(vocab)
    rows = [Row(SamplingParams(temperature=1.0, **settings), seed=s) for s in range(n)]
    tokens = torch.tensor(sampler.sample(logits.expand(n, vocab), sampler.prepare(rows)).token_ids)
    counts = torch.bincount(tokens, minlength=vocab)
    allowed_ids = perm[allowed]
    assert int(counts.sum() - counts[allowed_ids].sum()) == 0, "a filtered-out token was drawn"
    expected = probs[allowed] / probs[allowed].sum() * n
    stat = float(((counts[allowed_ids] - expected) ** 2 / expected).sum())
    assert stat < chi_square_bound(len(allowed) - 1), (stat, counts[allowed_ids].tolist(), expected.tolist())


@pytest.mark.parametrize("edited", [False, True])
def test_the_logits_given_are_left_as_they_are(edited):
    """The worker hands the model's logits over without a copy: whatever the rows ask for (greedy or drawn, with or
    without penalties, bias and bans), the sampler edits a copy of its own."""
    vocab, g = 2000, torch.Generator().manual_seed(3)
    sampler = Sampler(vocab)
    extra: dict[str, Any] = {"repetition_penalty": 1.3, "logit_bias": {5: 2.0}} if edited else {}
    settings = [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.2, "top_k": 40},
                {"temperature": 0.9, "min_p": 0.05}]
    for batch in (settings[:1], settings[1:], settings):  # all greedy, all drawn, mixed
        rows = [Row(SamplingParams(**sp, **extra), seed=7, output_ids=[1, 2], input_ids=[3, 4]) for sp in batch]
        logits = model_like_logits(len(rows), vocab, g)
        given = logits.clone()
        sampler.sample(logits, sampler.prepare(rows))
        assert torch.equal(logits, given)


def test_all_greedy_batch_is_the_argmax():
    vocab = 300
    sampler = Sampler(vocab)
    logits = torch.randn(5, vocab + 10, generator=torch.Generator().manual_seed(5))
    logits[:, vocab:] = 1e9  # padded columns never win
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(5)]
    assert sampler.sample(logits, sampler.prepare(rows)).token_ids == logits[:, :vocab].argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 33, 49_152, 49_155])
def test_argmax_answers_as_torch_max(vocab):
    """``argmax`` (the fastcpu kernel for CPU fp32 logits where it is built) gives ``torch.max``'s indices: the
    first of tied maxima, the first NaN where a row has one, index 0 for a row of -inf, rows read with a
    stride (logits narrowed to the vocabulary)."""
    g = torch.Generator().manual_seed(vocab)
    base = torch.randn(4, vocab + 5, generator=g)[:, :vocab]
    cases = [base]
    tied = base.clone()
    tied[:, vocab // 2] = tied[:, -1] = 1e9
    cases.append(tied)
    cases.append(torch.full((3, vocab), float("-inf")))
    nan = base.clone()
    nan[0, vocab // 3] = nan[2, vocab - 1] = float("nan")
    nan[3, ::2] = float("nan")
    cases.append(nan)
    inf = base.clone()
    inf[:, 0] = inf[:, -1] = float("inf")
    cases.append(inf)
    kernels = optional_kernels("fastcpu")
    assert kernels is not None, "the fastcpu kernels build wherever the tests run (bootstrap builds them)"
    for logits in cases:
        expected = torch.max(logits, dim=-1).indices
        assert torch.equal(kernels.argmax_rows(logits), expected), logits
        assert torch.equal(argmax(logits), expected), logits
