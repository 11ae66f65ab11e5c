"""The step's cap on draft lengths (``runtime/speculative/step_budget.py``): learnt from measured step times and
the acceptance rate, it drafts as far as K where rows are nearly free and not at all where each row costs a
decode row's time and drafts are often rejected; unmeasured lengths are tried first, and a neighbouring length
is revisited now and then. With the learnt budget, greedy outputs stay those without speculation."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.speculative.step_budget import REVISIT, FullBudget, StepBudget, bucket, expected_tokens
from tests.conftest import checked_engine


def settle(budget: StepBudget, step_seconds: Any, decodes: int, drafting: int, rounds: int = 3 * REVISIT) -> list[int]:
    """Run ``rounds`` decisions, each step costing ``step_seconds(rows)``; the caps chosen."""
    caps = []
    for _ in range(rounds):
        k = budget.cap(decodes, drafting)
        caps.append(k)
        budget.observe(decodes + drafting * k, step_seconds(decodes + drafting * k))
    return caps


def test_buckets_and_expected_tokens() -> None:
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert expected_tokens(0, 0.7) == 1 and expected_tokens(3, 1.0) == 4
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


def test_unmeasured_lengths_are_tried_first_largest_then_none() -> None:
    b = StepBudget(4)
    assert b.cap(1, 1) == 4  # rows 5: bucket 3 unmeasured
    b.observe(5, 0.010)
    assert b.cap(1, 1) == 0  # rows 1: bucket 0
    b.observe(1, 0.010)
    assert b.cap(1, 1) == 1  # rows 2: bucket 1
    b.observe(2, 0.010)
    assert b.cap(1, 1) == 2  # rows 3-4: bucket 2 (k = 3 shares it)
    b.observe(3, 0.010)
    assert b.cap(1, 1) == 4  # all measured and flat: the longest drafts pay
    assert b.cap(1, 0) == 0  # nobody to draft for


def test_weight_bound_steps_draft_to_k_and_compute_bound_ones_do_not() -> None:
    flat = StepBudget(4, acceptance=0.6)  # a CPU at batch 1: a step reads the weights whatever its rows
    caps = settle(flat, lambda rows: 0.020 + 0.0001 * rows, decodes=1, drafting=1)
    assert caps[-REVISIT + 1:].count(4) >= REVISIT - 2  # K nearly always, a neighbour once per REVISIT steps
    steep = StepBudget(4, acceptance=0.6)  # rows cost their share: a draft row pays only if always accepted
    caps = settle(steep, lambda rows: 0.004 * rows, decodes=8, drafting=8)
    assert caps[-REVISIT + 1:].count(0) >= REVISIT - 2


def test_high_acceptance_pays_for_a_sublinear_cost() -> None:
    b = StepBudget(4, acceptance=0.95)  # rows cost half a decode row's share each: nearly always accepted drafts pay
    caps = settle(b, lambda rows: 0.016 + 0.001 * rows, decodes=8, drafting=8)
    assert caps[-REVISIT + 1:].count(4) >= REVISIT - 2


def test_acceptance_follows_verifications() -> None:
    b = StepBudget(4)
    for _ in range(40):
        b.verified(4, 1)
    assert b.acceptance == pytest.approx(0.25, abs=0.01)
    b.verified(0, 0)  # a verification without drafts says nothing
    assert b.acceptance == pytest.approx(0.25, abs=0.01)


def test_full_budget_always_allows_k() -> None:
    full = FullBudget(5)
    assert full.cap(32, 32) == 5 and full.cap(3, 0) == 0


def test_learnt_budget_keeps_greedy_outputs(tiny_model_dir: Any) -> None:
    """The default budget (auto) through the Engine: outputs equal the run without speculation in deterministic
    mode, whatever lengths it chose, and it did draft (unmeasured lengths are tried, K first). The prompts are
    sent twice: the second time the first answers are draft material."""
    prompts = [list(range(300, 330)), list(range(900, 920))]
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    opts: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096, "enable_deterministic_inference": True}
    with checked_engine(tiny_model_dir, **opts) as eng:
        ref = eng.generate(input_ids=prompts, sampling_params=params)
    with checked_engine(tiny_model_dir, **opts, speculative_algorithm="ngram") as eng:
        for _ in range(2):
            got = eng.generate(input_ids=prompts, sampling_params=params)
            assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
        stats = eng.server_info()["scheduler"]
    assert stats["spec_accepted_tokens"] > 0, stats
