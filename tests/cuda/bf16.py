"""The float-aware oracle (tests/oracle.py) with bfloat16 tolerances, for CUDA runs that differ only in float
order (eager vs graph, flashinfer vs torch_native, overlap on vs off: batch shapes and KV splits differ).

bf16 rounds at ~4e-3 relative, so two such runs move logprobs by up to ~0.3 (measured on the tiny model, see
tests/oracle.py) where fp32 moves them by 1e-4. Exact token equality would flip on near-ties; the oracle
allows either of the reference's top-2 at a step whose gap is below ``TIE_EPS`` and compares nothing after
it, and still fails on a wrong token where the reference's choice was clear."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tests.oracle import WITH_TOP2, Greedy, assert_greedy_agrees

LOGPROB_TOL = 0.3
TIE_EPS = 2 * LOGPROB_TOL  # a gap above it cannot flip when each logprob moves by at most LOGPROB_TOL
REFERENCE = WITH_TOP2  # Engine.generate keyword arguments that make a reference


def assert_bf16_agree(references: Sequence[dict[str, Any]], candidates: Sequence[dict[str, Any]],
                      what: str = "") -> None:
    assert len(references) == len(candidates), what
    for i, (ref, cand) in enumerate(zip(references, candidates)):
        assert_greedy_agrees(Greedy.from_native(ref), Greedy.from_native(cand), f"{what} [{i}]",
                             tie_eps=TIE_EPS, logprob_tol=LOGPROB_TOL)
