"""The decode stack's thread team (runtime/kernels/fastcpu_team.h): every layer of a decode batch runs in one
parallel region whose idle threads fetch the next weights. The work must be split exactly as outside a team (the
same bits with one thread, two, or the layers' kernels called one by one), and an error raised inside the region
must come back as a Python exception that leaves the stack usable."""

from __future__ import annotations

import pytest
import torch

from runtime.kernels.build import load_kernels
from runtime.models.packed import pack_weight

HEADS, KV_HEADS, DIM, HIDDEN, FFN, LAYERS = 9, 3, 64, 576, 1536, 3
SHAPES = ((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), (HIDDEN, HEADS * DIM), (2 * FFN, HIDDEN), (HIDDEN, FFN)
FORMATS = {"float32": "kmajor", "bfloat16": "bf16pair", "int8": "vnni"}


@pytest.fixture(scope="module")
def k():
    return load_kernels("fastcpu")


def runnable(k, fmt: str) -> bool:
    return fmt == "float32" or (fmt == "bfloat16" and k.bf16_dot()) or (fmt == "int8" and k.int8_dot())


class Stack:
    """A small decode stack over random weights, a pool and a batch of ``rows`` decode rows, with or without a
    cascade group over a shared block (a kept pack per layer)."""

    def __init__(self, k, fmt: str, rows: int, shared: int, own: int = 12):
        g = torch.Generator().manual_seed(rows * 100 + shared)
        self.k, self.fmt = k, fmt
        act = torch.float32 if fmt == "float32" else torch.bfloat16
        self.weights = [[pack_weight(torch.randn(n, kk, generator=g) * 0.05, fmt, FORMATS[fmt]) for n, kk in SHAPES]
                        for _ in range(LAYERS)]
        self.norms = [(torch.rand(HIDDEN, generator=g).to(act) + 0.5, torch.rand(HIDDEN, generator=g).to(act) + 0.5)
                      for _ in range(LAYERS)]
        slots = shared + rows * (own + 1) + 8
        self.k_buf = (torch.randn(LAYERS, slots, KV_HEADS, DIM, generator=g) * 0.5).to(act)
        self.v_buf = torch.randn(LAYERS, slots, KV_HEADS, DIM, generator=g).to(act)
        self.kv_index = torch.stack([shared + r * (own + 1) + torch.arange(own + 1) for r in range(rows)])
        self.lengths = torch.full((rows,), own + 1, dtype=torch.int64)
        self.new_slots = self.kv_index[:, -1].contiguous()
        angle = torch.rand(rows, DIM, generator=g)
        self.cos, self.sin = angle.cos().to(act), angle.sin().to(act)
        self.x = (torch.randn(rows, HIDDEN, generator=g) * 0.1).to(act)
        self.shared = shared
        self.rows = rows

    def build(self):
        stack = self.k.DecodeStack(HEADS, KV_HEADS, DIM, 1e-5, DIM**-0.5)
        for layer, (n1, n2) in zip(self.weights, self.norms):
            stack.add_layer(n1, n2, [self.k.PackedLinear(w.layout, w.data, w.out_features, w.scale, 32)
                                     for w in layer], [None] * 4)
        return stack

    def groups(self, packs: list[list[torch.Tensor]] | None = None):
        if self.shared == 0:
            return []
        slots = torch.arange(self.shared)
        if packs is None:
            packs = [list(self.k.pack_prefix(self.k_buf[i].view(-1, KV_HEADS * DIM),
                                             self.v_buf[i].view(-1, KV_HEADS * DIM), slots, KV_HEADS, DIM))
                     for i in range(LAYERS)]
        return [self.k.SharedGroup(0, self.rows, slots, torch.full((self.rows,), self.shared, dtype=torch.int64),
                                   packs)]

    def run(self, stack, groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        residual, k_buf, v_buf = self.x.clone(), self.k_buf.clone(), self.v_buf.clone()
        stack.run(residual, self.cos, self.sin, self.new_slots, self.kv_index, self.lengths, k_buf, v_buf, groups)
        return residual, k_buf, v_buf


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("rows", "shared"), [(1, 0), (1, 300), (8, 300), (60, 0)])
def test_a_team_of_any_size_gives_the_same_bits(k, fmt, rows, shared, threads):
    """60 rows: past the int8 kernel's whole-panel split, where the idle threads fetch nothing ahead."""
    if not runnable(k, fmt):
        pytest.skip(f"the {fmt} kernels are not built on this CPU")
    if shared and fmt == "float32":
        pytest.skip("kept packs are bf16, for the GEMM kernel; an fp32 model's groups attend in place")
    if shared and not k.bf16_dot():
        pytest.skip("kept packs are made for the bf16 GEMM kernel, built only for CPUs with AVX512_BF16")
    case = Stack(k, fmt, rows, shared)
    stack = case.build()
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(case.run(stack, case.groups()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_an_error_inside_the_team_is_raised_and_the_stack_still_runs(k, threads):
    """A kernel's check failing on the leading thread (a kept pack of the wrong size, found by the shared part's
    attention of the first layer, after the team's threads have served its first jobs) ends the region and comes
    back as RuntimeError; the next call runs and gives the same bits as before."""
    if not k.bf16_dot():
        pytest.skip("kept packs need the bf16 GEMM kernel")
    threads(2)
    case = Stack(k, "bfloat16", 4, 300)
    stack = case.build()
    good = case.run(stack, case.groups())
    short = [[p[:, :32].contiguous() for p in pair] for pair in
             (k.pack_prefix(case.k_buf[i].view(-1, KV_HEADS * DIM), case.v_buf[i].view(-1, KV_HEADS * DIM),
                            torch.arange(case.shared), KV_HEADS, DIM) for i in range(LAYERS))]
    with pytest.raises(RuntimeError, match="pack_prefix"):
        case.run(stack, case.groups(short))
    again = case.run(stack, case.groups())
    for a, b in zip(good, again):
        assert torch.equal(a, b)
