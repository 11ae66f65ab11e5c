"""The batch-invariant kernels (runtime/kernels/invariant.cpp): a row's result has the same bits whatever
else shares the call (number of rows, the row's place among them), and equals plain torch within float
tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.attention.invariant import plan_rows
from runtime.kernels.build import load_kernels


@pytest.fixture(scope="module")
def k():
    return load_kernels("invariant")


# (K, N): the tiny test model, SmolLM2-135M's projections, a K with a tail, an N below one register tile
SHAPES = [(64, 128), (576, 960), (1536, 576), (70, 13), (576, 3)]


@pytest.mark.parametrize(("kdim", "n"), SHAPES)
def test_linear_rows_are_batch_invariant_and_close_to_torch(k, kdim, n):
    g = torch.Generator().manual_seed(kdim * 1000 + n)
    w, b = torch.randn(n, kdim, generator=g), torch.randn(n, generator=g)
    x = torch.randn(40, kdim, generator=g)
    alone = torch.cat([k.linear(x[i : i + 1], w, b, None) for i in range(len(x))])
    for m in (2, 3, 5, 17, 40):
        assert torch.equal(k.linear(x[:m], w, b, None), alone[:m]), m
    perm = torch.randperm(len(x), generator=g)  # every row at another place in the call
    assert torch.equal(k.linear(x[perm], w, b, None), alone[perm])
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_linear_adds_into_the_residual_in_place(k):
    g = torch.Generator().manual_seed(1)
    w, x, res = torch.randn(24, 32, generator=g), torch.randn(5, 32, generator=g), torch.randn(5, 24, generator=g)
    expected = res + F.linear(x, w)
    out = k.linear(x, w, None, res)
    assert out.data_ptr() == res.data_ptr()
    torch.testing.assert_close(res, expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_silu_and_rotary_are_rowwise_and_close_to_torch(k):
    from runtime.models.layers import apply_rotary, rms_norm

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 576, generator=g), torch.randn(576, generator=g)
    out = k.rms_norm(x, w, 1e-5)
    assert torch.equal(out[3:4], k.rms_norm(x[3:4], w, 1e-5))
    torch.testing.assert_close(out, rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    gu = torch.randn(6, 256, generator=g)
    torch.testing.assert_close(k.silu_mul(gu), F.silu(gu[:, :128]) * gu[:, 128:], rtol=1e-5, atol=1e-6)
    q = torch.randn(6, 5, 64, generator=g)
    cos, sin = torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)
    torch.testing.assert_close(k.rotary(q, cos, sin), apply_rotary(q, cos[:, None], sin[:, None]))


def reference_attention(q, k_pool, v_pool, slots, scale):
    """SDPA over the given slots for one token (all heads), GQA by repeating KV heads."""
    group = q.shape[0] // k_pool.shape[1]
    keys = k_pool[slots].repeat_interleave(group, dim=1).transpose(0, 1)
    vals = v_pool[slots].repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q[:, None], keys, vals, scale=scale)[:, 0]


def test_attention_equals_sdpa_and_a_token_is_independent_of_the_others(k):
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, pool = 9, 3, 64, 300
    k_pool, v_pool = torch.randn(pool, kv_heads, dim, generator=g), torch.randn(pool, kv_heads, dim, generator=g)
    # two requests: one adds 5 tokens after 40 cached, the other decodes one token at position 99
    seq, prefix, ext = [45, 100], [40, 99], [5, 1]
    slots = [torch.randperm(pool, generator=g)[:s] for s in seq]
    kv_index = torch.cat(slots)
    starts, lens = plan_rows(seq, prefix, ext)
    assert starts == [0] * 5 + [45] and lens == [41, 42, 43, 44, 45, 100]
    q = torch.randn(6, heads, dim, generator=g)
    scale = dim**-0.5
    out = k.attention(q, k_pool, v_pool, kv_index, torch.tensor(starts), torch.tensor(lens), scale)
    for t in range(6):
        req = 0 if t < 5 else 1
        ref = reference_attention(q[t], k_pool, v_pool, slots[req][: lens[t]], scale)
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-5)
    # the last prefill token, computed alone as if it were a decode step: the same bits
    one = k.attention(q[4:5].contiguous(), k_pool, v_pool, slots[0], torch.tensor([0]), torch.tensor([45]), scale)
    assert torch.equal(one[0], out[4])


@pytest.mark.parametrize(("slots", "starts", "lens", "error"), [
    ([0, 1, 300], [0], [3], "slot out of range"),  # the pool has 300 rows
    ([0, -1, 2], [0], [3], "slot out of range"),
    ([0, 1, 2], [1], [3], "row out of kv_index"),  # the row runs past the table
    ([0, 1, 2], [0, 0], [3, 3], "one entry per token"),
])
def test_attention_refuses_a_table_outside_the_pool(k, slots, starts, lens, error):
    """The kernel indexes the pool with the table's slots: a bad table is an error, not a read past the pool."""
    k_pool = torch.randn(300, 3, 64)
    q = torch.randn(1, 9, 64)
    with pytest.raises(RuntimeError, match=error):
        k.attention(q, k_pool, k_pool, torch.tensor(slots), torch.tensor(starts), torch.tensor(lens), 0.125)
