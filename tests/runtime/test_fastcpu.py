"""The CPU fast path: decode attention over the paged pool in place, packed linear layers in float32,
bfloat16 and int8, the ops and backend that use them, the weight-format flags, and the quality check."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from radix.kv_int8 import quantize
from runtime.attention.base import AttentionShape
from runtime.attention.torch_native import TorchNativeBackend
from runtime.config import ServerArgs, aten_cpu_capability, cpu_flags, cpu_has_native_bf16
from runtime.kernels.build import load_kernels
from runtime.models.ops import PackedCpuOps, dequantize
from runtime.models.packed import pack_weight, quantize_int8, unpack_weight


@pytest.fixture(scope="module")
def k():
    return load_kernels("fastcpu")


def kv_pools(g: torch.Generator, slots: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V pools of ``slots`` rows of ``width`` values."""
    return (torch.randn(slots, width, generator=g).to(dtype), torch.randn(slots, width, generator=g).to(dtype))


# SmolLM2's heads (9 over 3 KV heads of 64 dims), and 8 over 2 of 128 dims (the AVX2 kernel's two passes per row)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_the_pool_in_place(k, dtype, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(0)
    pool = 3000
    k_pool, v_pool = kv_pools(g, pool, kv_heads * dim, dtype)
    lengths = torch.tensor([1, 15, 16, 17, 300, 1200])
    index = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.int64)  # padding: slot 0, never read
    for b, n in enumerate(lengths.tolist()):
        index[b, :n] = torch.randperm(pool, generator=g)[:n]
    q = torch.randn(len(lengths), heads, dim, generator=g)
    out, lse = k.decode_attention(q, k_pool, v_pool, index, None, lengths, dim**-0.5, kv_heads)
    for b, n in enumerate(lengths.tolist()):
        group = heads // kv_heads
        keys = k_pool[index[b, :n]].float().view(n, kv_heads, dim).repeat_interleave(group, 1).transpose(0, 1)
        vals = v_pool[index[b, :n]].float().view(n, kv_heads, dim).repeat_interleave(group, 1).transpose(0, 1)
        scores = (q[b][:, None] @ keys.transpose(1, 2))[:, 0] * dim**-0.5
        torch.testing.assert_close(out[b], (torch.softmax(scores, -1)[:, None] @ vals)[:, 0], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("index", "lengths", "rows", "error"), [
    ([[0, 1, 2], [3, 4, 100]], [3, 3], None, "slot out of range"),  # past the pool's last row
    ([[0, -1, 2], [3, 4, 5]], [3, 3], None, "slot out of range"),
    ([[0, 1, 2], [3, 4, 5]], [3, 4], None, "lengths must be in 0..L"),  # longer than its row of the table
    ([[0, 1, 2], [3, 4, 5]], [3, 3], [0, 2], "row_index out of range"),
])
def test_decode_attention_refuses_slots_outside_the_pool(k, index, lengths, rows, error):
    """The kernel indexes the pool with the table's slots: a bad table is an error, not a read past the pool.
    Slots past a row's length are padding and never read, so they may hold anything."""
    q = torch.randn(2, 9, 64)
    pool = torch.randn(100, 3 * 64)
    padded = torch.tensor([[0, 1, 2, 10**9], [3, 4, 99, -7]])
    out, _ = k.decode_attention(q, pool, pool, padded, None, torch.tensor([3, 3]), 0.125, 3)
    assert torch.isfinite(out).all()
    row_index = None if rows is None else torch.tensor(rows)
    with pytest.raises(RuntimeError, match=error):
        k.decode_attention(q, pool, pool, torch.tensor(index), row_index, torch.tensor(lengths), 0.125, 3)


# Queries in float32, and in bfloat16 as a bf16 model hands them over: over a bf16 pool those take the bf16
# dot-product path where it is built (fastcpu_attention.cpp).
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_row_is_the_same_alone_or_in_a_batch(k, dtype, q_dtype):
    # Speculative verification and continuous batching put a request's decode row in batches of any shape;
    # its result must not change by a bit (greedy outputs with speculation equal those without).
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, pool = 9, 3, 64, 4000
    k_pool, v_pool = kv_pools(g, pool, kv_heads * dim, dtype)
    lengths = torch.tensor([700, 3, 1500, 256, 257])
    index = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.int64)
    for b, n in enumerate(lengths.tolist()):
        index[b, :n] = torch.randperm(pool, generator=g)[:n]
    q = torch.randn(len(lengths), heads, dim, generator=g).to(q_dtype)
    out, lse = k.decode_attention(q, k_pool, v_pool, index, None, lengths, dim**-0.5, kv_heads)
    # the queries as a view of wider rows, as the decode stack passes its rotary output's query heads (read in
    # place, in their dtype): the same bits
    wide = torch.cat([q, torch.randn(len(lengths), kv_heads, dim, generator=g).to(q_dtype)], 1)
    view_out, view_lse = k.decode_attention(wide[:, :heads], k_pool, v_pool, index, None, lengths, dim**-0.5,
                                            kv_heads)
    assert not wide[:, :heads].is_contiguous()
    assert torch.equal(view_out, out) and torch.equal(view_lse, lse)
    for b, n in enumerate(lengths.tolist()):
        alone, alone_lse = k.decode_attention(
            q[b : b + 1], k_pool, v_pool, index[b : b + 1, :n], None, lengths[b : b + 1], dim**-0.5, kv_heads
        )
        assert torch.equal(alone[0], out[b]) and torch.equal(alone_lse[0], lse[b])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_of_one_request_attended_together_equal_each_alone(k, dtype, q_dtype):
    # A verified draft (or a short prefill chunk) is several tokens reading one KV row; the kernel attends them
    # in one pass over the KV, and each token's result must be the bits it gets alone (speculation exact).
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, pool = 9, 3, 64, 4000
    k_pool, v_pool = kv_pools(g, pool, kv_heads * dim, dtype)
    index = torch.stack([torch.randperm(pool, generator=g)[:900] for _ in range(2)])
    # row 0: seven tokens ending at 254..260 (across a range boundary, more than one pass of 5); a decode row
    # of row 1; three tokens of row 0 again, short
    rows = torch.tensor([0] * 7 + [1] + [0] * 3)
    lengths = torch.tensor([254, 255, 256, 257, 258, 259, 260, 900, 1, 2, 17])
    q = torch.randn(len(rows), heads, dim, generator=g).to(q_dtype)
    out, lse = k.decode_attention(q, k_pool, v_pool, index, rows, lengths, dim**-0.5, kv_heads)
    # bf16 outputs: one rounding of the result, and over a bf16 pool the weights of the values in bf16 too
    tol = 2e-5 if q_dtype == torch.float32 else 1e-2
    for t in range(len(rows)):
        alone, alone_lse = k.decode_attention(q[t : t + 1], k_pool, v_pool, index[rows[t] : rows[t] + 1], None,
                                              lengths[t : t + 1], dim**-0.5, kv_heads)
        assert torch.equal(alone[0], out[t]) and torch.equal(alone_lse[0], lse[t]), t
        keys = k_pool[index[rows[t], : lengths[t]]].float().view(-1, kv_heads, dim).repeat_interleave(3, 1)
        vals = v_pool[index[rows[t], : lengths[t]]].float().view(-1, kv_heads, dim).repeat_interleave(3, 1)
        scores = torch.einsum("hd,nhd->hn", q[t].float(), keys) * dim**-0.5
        torch.testing.assert_close(out[t].float(), torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vals),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_rows_under_a_shared_prefix_equal_each_alone(k, fmt, q_dtype, heads, kv_heads, dim):
    # Requests under one cached prefix hold the same slots for it; the kernel attends their rows together over each
    # range where the slots agree (one call, the range fetched once), and each token's result must be the bits it
    # gets alone. Tables: 9 rows under an 800-position prefix (ranges 0-767 shared, then their own positions), two
    # of them identical (every range shared), one under only 300 of it, and a two-token draft of one of the rows.
    g = torch.Generator().manual_seed(3)
    pool, prefix = 6000, 800
    if fmt == "int8":
        k_pool, v_pool = (quantize(torch.randn(pool, kv_heads, dim, generator=g)).view(pool, -1) for _ in range(2))
    else:
        k_pool, v_pool = kv_pools(g, pool, kv_heads * dim, getattr(torch, fmt))
    slots = torch.randperm(pool, generator=g)
    own = [1, 5, 40, 300, 17, 1, 9, 64]
    lengths = [prefix + n for n in own] + [prefix + own[-1], 320]
    index = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    at = prefix
    for r, n in enumerate(lengths):
        shared = 300 if r == len(lengths) - 1 else prefix
        index[r, :shared] = slots[:shared]
        index[r, shared:n] = slots[at : at + n - shared]
        at += n - shared
    index[len(own)] = index[len(own) - 1]  # the same request's row twice: its last range shared too
    rows = torch.tensor([*range(len(lengths)), 2, 2])
    lens = torch.tensor([*lengths, lengths[2] - 1, lengths[2]])
    q = torch.randn(len(rows), heads, dim, generator=g).to(q_dtype)
    out, lse = k.decode_attention(q, k_pool, v_pool, index, rows, lens, dim**-0.5, kv_heads)
    for t in range(len(rows)):
        alone, alone_lse = k.decode_attention(q[t : t + 1], k_pool, v_pool, index[rows[t] : rows[t] + 1], None,
                                              lens[t : t + 1], dim**-0.5, kv_heads)
        assert torch.equal(alone[0], out[t]) and torch.equal(alone_lse[0], lse[t]), t


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("kdim", "n"), [(576, 960), (70, 13), (64, 130)])
def test_packed_linear_equals_the_weight_it_stands_for(k, fmt, kdim, n):
    g = torch.Generator().manual_seed(kdim + n)
    w, b = torch.randn(n, kdim, generator=g), torch.randn(n, generator=g)
    pw = pack_weight(w, fmt)
    assert pw.data.shape == (-(-n // 64), kdim, 64) and pw.out_features == n
    ref_w = dequantize(pw)
    if fmt == "int8":
        assert (ref_w - w).abs().max() <= w.abs().amax() / 254 + 1e-6  # half a quantisation step
    else:
        torch.testing.assert_close(ref_w, w.to(getattr(torch, fmt)).float())
    for m in (1, 2, 3, 7, 8, 10, 17):  # every register tile shape and AVX2's sweeps of two shapes (7-10 rows)
        x = torch.randn(m, kdim, generator=g)
        torch.testing.assert_close(k.linear_packed(x, pw.data, n, pw.scale, b, None), F.linear(x, ref_w, b),
                                   rtol=1e-4, atol=1e-3)
        res = torch.randn(m, n, generator=g)
        expected = res + F.linear(x, ref_w)
        k.linear_packed(x, pw.data, n, pw.scale, None, res)
        torch.testing.assert_close(res, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_packed_linear_row_bits_do_not_depend_on_the_batch(k, fmt):
    # every tile shape (and AVX2's sweeps of two shapes over 7-10 rows) sums each output over k in the same order
    g = torch.Generator().manual_seed(7)
    pw = pack_weight(torch.randn(130, 576, generator=g), fmt)
    x = torch.randn(17, 576, generator=g)
    alone = torch.cat([k.linear_packed(x[r:r + 1], pw.data, 130, pw.scale, None, None) for r in range(17)])
    for m in range(2, 18):
        assert torch.equal(k.linear_packed(x[:m], pw.data, 130, pw.scale, None, None), alone[:m]), m


def test_packed_linear_without_input_features_gives_its_bias(k):
    # the row tiles keep their sums in a buffer between blocks of k rows; with no k rows at all it must still read 0
    pw, b = pack_weight(torch.randn(5, 0), "float32"), torch.randn(5)
    for m in (1, 2, 8):
        torch.testing.assert_close(k.linear_packed(torch.randn(m, 0), pw.data, 5, pw.scale, b, None),
                                   b.expand(m, 5), rtol=0, atol=0)


def test_int8_quantization_is_per_output_row():
    w = torch.tensor([[1.0, -2.0, 0.5], [100.0, 50.0, -25.0]])
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.tolist() == pytest.approx([2 / 127, 100 / 127])
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [127, 64, -32]


class TinyModel:
    """What PackedCpuOps.prepare reads of a model."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.layer = torch.nn.Parameter(torch.randn(40, 32, generator=g), requires_grad=False)
        self.embed_tokens = torch.nn.Parameter(torch.randn(100, 32, generator=g), requires_grad=False)

    def linear_weights(self) -> list[torch.Tensor]:
        return [self.layer]

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens


def quantised_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What linear_int8 multiplies: each row in blocks of ``block`` (0: the row, padded to 16) rounded to
    ``round(x * 127 / max|x|)`` (fp32, half to even), and each value's block scale ``max|x| / 127``."""
    m, k = x.shape
    width = block or -(-k // 16) * 16
    nb = -(-k // width)
    blocks = torch.cat([x, x.new_zeros(m, nb * width - k)], 1).view(m, nb, width)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = (blocks * inv).round()
    step = (amax / 127.0).expand_as(blocks)
    return q.reshape(m, -1)[:, :k], step.reshape(m, -1)[:, :k]


def split_activations(x: torch.Tensor) -> torch.Tensor:
    """What linear_int8 multiplies where it takes two-part activations (int8_split: AMX hosts), in float64: per row
    the scale max|x| / 127, hi = round(x * 127 / max|x|) and lo = round((x * 127 / max|x| - hi) * 254) (fp32, half
    to even), the value scale * (hi + lo / 254)."""
    amax = x.abs().amax(-1, keepdim=True)
    v = x * torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    hi = v.round()
    lo = ((v - hi) * 254.0).round()
    assert hi.abs().max() <= 127 and lo.abs().max() <= 127
    return (hi.double() + lo.double() / 254.0) * (amax / 127.0).double()


def multiplied_activations(k, x: torch.Tensor, block: int) -> torch.Tensor:
    """The activations linear_int8 multiplies on this host, in float64: two-part ones where int8_split(K) says
    so, else per-block ones."""
    if k.int8_split(x.shape[1]):
        return split_activations(x)
    q, step = quantised_activations(x, block)
    return (q * step).double()


def int8_kernels() -> list[str]:
    """The int8 kernels this host runs: the integer dot-product one only where the kernels were built for it."""
    return ["dot", "float"] if load_kernels("fastcpu").int8_dot() else ["float"]


@pytest.mark.parametrize("int8_kernel", ["dot", "float"])
def test_int8_ops_release_the_float_weights_but_keep_the_tied_embedding(int8_kernel):
    if int8_kernel not in int8_kernels():
        pytest.skip("the kernels were built for a CPU with neither AVX2 nor AVX512-VNNI")
    model = TinyModel()
    dense, embed = model.layer.detach().clone(), model.embed_tokens.detach().clone()
    ops = PackedCpuOps("int8", int8_kernel=int8_kernel)
    ops.prepare(model)
    assert ops.packed[id(model.layer)].layout == ("vnni" if int8_kernel == "dot" else "kmajor")
    assert model.layer.numel() == 0, "the int8 panels replace the float weight"
    assert torch.equal(model.embed_tokens, embed), "the embedding table is still read by lookups"
    # what the int8 weight stands for: within half a quantisation step of the float weight
    int8_w, int8_embed = dequantize(ops.packed[id(model.layer)]), dequantize(ops.packed[id(model.embed_tokens)])
    assert (int8_w - dense).abs().max() <= dense.abs().amax() / 254 + 1e-6
    # the float kernel multiplies the activations as they are; the dot-product one their int8 rounding per block
    def seen(x: torch.Tensor) -> torch.Tensor:
        q, step = quantised_activations(x, ops.act_block)
        return x if int8_kernel == "float" else q * step

    x_small, x_large = torch.randn(2, 32), torch.randn(40, 32)  # the packed kernel; float: a dequantised GEMM
    for x in (x_small, x_large):
        torch.testing.assert_close(ops.linear(x, model.layer, None), F.linear(seen(x), int8_w), rtol=1e-4, atol=1e-4)
    residual = torch.ones(2, 100)
    ops.add_linear_(residual, x_small, model.embed_tokens, None)
    torch.testing.assert_close(residual, 1 + F.linear(seen(x_small), int8_embed), rtol=1e-4, atol=1e-4)


def test_unavailable_int8_kernel_is_refused():
    with pytest.raises(ValueError, match="int8 kernel"):
        PackedCpuOps("int8", int8_kernel="amx")


requires_int8_dot = pytest.mark.skipif(not load_kernels("fastcpu").int8_dot(),
                                       reason="linear_int8 is built only for CPUs with AVX2 or AVX512-VNNI")


@requires_int8_dot
@pytest.mark.parametrize(("kdim", "n"), [(576, 960), (70, 13), (5, 3), (1536, 130)])
@pytest.mark.parametrize("block", [0, 16, 64])
def test_int8_dot_linear_equals_the_quantised_product(k, kdim, n, block):
    """Every row count 1..33 (row tiles of 1..6, several tiles; on AMX hosts the two-part activations' lone-row
    vector pass and tiles of 1..8 rows), odd K (k groups of 4 padded) and N (a partial panel), with and without
    bias and residual: the integer product is exact, so the result equals the float64 product of the quantised
    operands up to fp32 rounding of the sums."""
    g = torch.Generator().manual_seed(kdim * n + block)
    w, b = torch.randn(n, kdim, generator=g), torch.randn(n, generator=g)
    pw = pack_weight(w, "int8", "vnni")
    assert pw.data.shape == (-(-n // 64), -(-kdim // 4), 256) and pw.data.dtype == torch.uint8
    w_int8 = unpack_weight(pw)
    assert torch.equal(w_int8, unpack_weight(pack_weight(w, "int8"))), "the same int8 values as the k-major layout"
    for m in range(1, 34):
        x = torch.randn(m, kdim, generator=g) * torch.linspace(0.05, 4.0, kdim)  # blocks of different ranges
        xq = multiplied_activations(k, x, block)
        ref = xq @ w_int8.double().T
        scale = xq.abs() @ w_int8.double().abs().T  # the size of the terms summed
        got = k.linear_int8(x, pw.data, n, pw.scale, b, None, block)
        assert ((got.double() - b.double() - ref).abs() <= 1e-5 * scale + 1e-5).all(), m
        res = torch.randn(m, n, generator=g)
        expected = res.double() + ref
        k.linear_int8(x, pw.data, n, pw.scale, None, res, block)
        assert ((res.double() - expected).abs() <= 1e-5 * scale + 1e-5).all(), m


@requires_int8_dot
@pytest.mark.parametrize("block", [16, 32, 64])
def test_int8_rows_in_a_batch_are_the_bits_of_each_row_alone(k, block):
    """A row's product does not depend on the rows beside it: its bits alone (one row: the vector kernel) are its
    bits in batches of 2..40 (vector tiles of up to 6 rows, or from 16 rows where the CPU has AMX, tiles of 16 rows
    with a zero-padded last block), with bias and into a bf16 residual: every path sums each block exactly in int32
    and folds the blocks into fp32 in the same order. On AMX hosts a K of 64s takes two-part activations (the lone
    row on the vector units, batches on tiles of up to 8 rows, the last zero-padded): each part's sums are exact
    and both kernels combine them with the same arithmetic. K = 96 keeps the per-block tiles there."""
    g = torch.Generator().manual_seed(block)
    for kdim, n in ((576, 960), (1536, 576), (96, 200)):
        pw = pack_weight(torch.randn(n, kdim, generator=g), "int8", "vnni")
        b = torch.randn(n, generator=g)
        x = (torch.randn(40, kdim, generator=g) * torch.linspace(0.05, 4.0, kdim)).bfloat16()
        alone = torch.cat([k.linear_int8(x[i:i + 1], pw.data, n, pw.scale, b, None, block) for i in range(40)])
        res = torch.randn(40, n, generator=g).bfloat16()
        res_alone = torch.cat([k.linear_int8(x[i:i + 1], pw.data, n, pw.scale, None, res[i:i + 1].clone(), block)
                               for i in range(40)])
        for m in (2, 7, 8, 16, 17, 33, 40):
            assert torch.equal(k.linear_int8(x[:m], pw.data, n, pw.scale, b, None, block), alone[:m]), (kdim, m)
            into = res[:m].clone()
            k.linear_int8(x[:m], pw.data, n, pw.scale, None, into, block)
            assert torch.equal(into, res_alone[:m]), (kdim, m)


requires_bf16_dot = pytest.mark.skipif(not load_kernels("fastcpu").bf16_dot(),
                                       reason="linear_bf16 is built only for CPUs with AVX512_BF16")


@requires_bf16_dot
@pytest.mark.parametrize(("kdim", "n"), [(576, 960), (70, 13), (5, 3), (1537, 130)])
def test_bf16_dot_linear_equals_the_product_of_the_bf16_operands(k, kdim, n):
    """Every row count 1..33 (row blocks of 1..6, several blocks; on AMX, with K a multiple of 32, tiles of up
    to 16 rows and a zero-padded last block), odd K (a padded last pair) and N (a partial panel), with and without
    bias and residual: the kernel multiplies the activations rounded to bf16 by the bf16 weights, summing in fp32,
    so it equals the float64 product of those operands up to fp32 rounding."""
    g = torch.Generator().manual_seed(kdim * n)
    w, b = torch.randn(n, kdim, generator=g), torch.randn(n, generator=g)
    pw = pack_weight(w, "bfloat16", "bf16pair")
    assert pw.data.shape == (-(-n // 64), -(-kdim // 2), 128) and pw.data.dtype == torch.bfloat16
    w_bf16 = unpack_weight(pw)
    assert torch.equal(w_bf16, w.bfloat16().float()), "the same values as the k-major layout holds"
    for m in range(1, 34):
        x = torch.randn(m, kdim, generator=g)
        xb = x.bfloat16().double()  # what the kernel multiplies (round to nearest even)
        ref = xb @ w_bf16.double().T
        size = xb.abs() @ w_bf16.double().abs().T  # the size of the terms summed
        got = k.linear_bf16(x, pw.data, n, b, None)
        assert ((got.double() - b.double() - ref).abs() <= 2e-6 * size + 1e-6).all(), m
        res = torch.randn(m, n, generator=g)
        expected = res.double() + ref
        k.linear_bf16(x, pw.data, n, None, res)
        assert ((res.double() - expected).abs() <= 2e-6 * size + 1e-6).all(), m


def test_the_tile_kernels_run_where_the_cpu_has_amx(k):
    """linear_bf16 and linear_int8 take batches onto the AMX tiles exactly where the CPU has them (the build
    targets the host's CPU, and Linux grants the tiles' state); the equality tests of both kernels then check
    their products from 2 rows on."""
    assert k.amx_tiles() == bool({"amx_tile", "amx_bf16", "amx_int8"} <= cpu_flags())


# torch's bf16 flash attention (the gather path's SDPA) packs its operands for AMX wherever the CPU has AMX, with a
# routine that only its AVX-512 kernels carry: with ATEN_CPU_CAPABILITY lowered below AVX512 on such a CPU it raises.
sdpa_runs_bf16 = pytest.mark.skipif("amx_bf16" in cpu_flags() and aten_cpu_capability() != "AVX512",
                                    reason="torch's bf16 SDPA needs its AVX-512 kernels on a CPU with AMX")


@requires_bf16_dot
@sdpa_runs_bf16
@pytest.mark.parametrize("int8_kv", [False, True])
@pytest.mark.parametrize(("lens", "shared", "extend"), [([850], 0, 150), ([520, 530, 540], 500, 20),
                                                       ([1000, 1010, 1020, 1030], 990, 1)])
def test_long_chunks_over_a_bf16_pool_equal_the_gather_path_inside_the_backend(lens, shared, extend, int8_kv):
    """A 150-token chunk over a cached prefix; three 20-token chunks, and four decode rows, under one shared
    prefix (a cascade group whose shared part the GEMM kernel attends, merged by LSE): the backend's output
    equals the gather path's (SDPA) within bf16's precision. A bf16 model over an int8 pool: the long chunk's rows
    reach the GEMM kernel dequantised to bf16, and so does the group's shared prefix, in the pack kept for it."""
    shape = AttentionShape(9, 3, 64)
    fast, gather = TorchNativeBackend(shape), TorchNativeBackend(shape, in_place_decode=False)
    outs = []
    for backend in (fast, gather):
        batch, q, k_new, v_new = decode_batch(shape, lens, shared, seed=5, extend=extend, dtype=torch.bfloat16,
                                              int8_kv=int8_kv)
        backend.plan(batch)
        assert (batch.attn_metadata.cascade is not None) == (shared > 0)
        outs.append(backend.forward(q, k_new, v_new, 0, batch).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


@requires_bf16_dot
def test_an_int8_groups_prefix_over_the_pack_budget_is_packed_per_call(monkeypatch):
    """With no room to keep a pack, a group's shared prefix over an int8 pool is packed from the pool for each call
    (the kernel converts the rows), and the native decode stack, which does the same, is still offered the batch."""
    from runtime.attention import paged_decode

    monkeypatch.setattr(paged_decode, "PACKED_PREFIX_BYTES", 0)
    shape = AttentionShape(9, 3, 64)
    fast, gather = TorchNativeBackend(shape), TorchNativeBackend(shape, in_place_decode=False)
    outs = []
    for backend in (fast, gather):
        batch, q, k_new, v_new = decode_batch(shape, [1000, 1010, 1020, 1030], 990, seed=5, dtype=torch.bfloat16,
                                              int8_kv=True)
        backend.plan(batch)
        assert batch.attn_metadata.cascade is not None
        if backend is fast:
            reads = backend.decode_in_place(batch)
            assert reads is not None and all(pack is None for read in reads.shared for pack in read.packs)
        outs.append(backend.forward(q, k_new, v_new, 0, batch).float())
    assert fast.paged is not None and all(not fast.paged.kept(key) for key in fast.paged.kept_keys)
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_bf16_ops_pick_the_dot_product_kernel_where_it_was_built():
    """bf16 weights are packed for linear_bf16 where the kernels have it (and then serve batches up to
    BF16_DOT_SMALL_M rows without AMX, BF16_AMX_SMALL_M on its tiles), else k-major for the widening kernel; both
    give the bf16 product."""
    from runtime.models.ops import BF16_AMX_SMALL_M, BF16_DOT_SMALL_M, SMALL_M

    model = TinyModel()
    ops = PackedCpuOps("bfloat16")
    ops.prepare(model)
    kernels = load_kernels("fastcpu")
    dot, tiles = kernels.bf16_dot(), kernels.amx_tiles()
    assert ops.packed[id(model.layer)].layout == ("bf16pair" if dot else "kmajor")
    amx = "amx_bf16" in cpu_flags()
    assert ops.small_m == (BF16_AMX_SMALL_M if tiles else BF16_DOT_SMALL_M if dot and not amx
                           else SMALL_M["bfloat16"])
    x = torch.randn(ops.small_m, 32).bfloat16().float()
    w = model.layer.detach().bfloat16().float()
    torch.testing.assert_close(ops.linear(x, model.layer, None), F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_packed_ops_add_the_bias_in_the_kernel_and_past_its_rows(fmt):
    """A bias reaches whichever product runs (the packed kernel for the weight's layout, or past its row limit
    the library's GEMM), with and without a residual to add into: the product with the bias is the product
    without it plus the bias."""
    model = TinyModel()
    ops = PackedCpuOps(fmt)
    ops.prepare(model)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3))
    for rows in (2, ops.small_m + 8):
        x = torch.randn(rows, 32).bfloat16().float()
        plain = ops.linear(x, model.layer, None)
        torch.testing.assert_close(ops.linear(x, model.layer, bias), plain + bias, rtol=1e-5, atol=1e-5)
        residual = torch.ones(rows, 40)
        ops.add_linear_(residual, x, model.layer, bias)
        torch.testing.assert_close(residual, 1 + plain + bias, rtol=1e-5, atol=1e-5)


@requires_int8_dot
def test_int8_dot_activation_error_stays_within_half_a_step_of_its_block(k):
    """Against the unquantised activations: each value moves at most half its block's step, so an outlier
    in one block of 64 leaves the other blocks' precision alone (a per-row scale would not). K = 1,000 (not a
    multiple of 64) takes per-block activations on every host."""
    g = torch.Generator().manual_seed(11)
    kdim, n = 1000, 70
    w = torch.randn(n, kdim, generator=g)
    pw = pack_weight(w, "int8", "vnni")
    w_int8 = unpack_weight(pw).double()
    x = torch.randn(4, kdim, generator=g)
    x[:, 3] = 200.0  # an outlier in the first block only
    got = k.linear_int8(x, pw.data, n, pw.scale, None, None, 64).double()
    exact = x.double() @ w_int8.T
    _q, step = quantised_activations(x, 64)
    bound = (step.double() / 2) @ w_int8.abs().T
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-4).all()
    assert not k.int8_split(kdim)
    # one scale per row (block 0) rounds all 16 blocks to steps of 200/127 (blocks of 64: one block), so its
    # squared error is ~16x larger
    row = k.linear_int8(x, pw.data, n, pw.scale, None, None, 0).double()
    assert (row - exact).pow(2).mean() > 8 * (got - exact).pow(2).mean()


@requires_int8_dot
def test_int8_split_activations_keep_an_outlier_from_coarsening_the_row(k):
    """Where linear_int8 takes two-part activations (AMX hosts, K a multiple of 64), each value moves at most half of
    1/254 of its row's step (the lo part's rounding), so with the same outlier as above the product's squared error
    is over 1000x smaller than that of blocks of 64."""
    kdim, n = 1024, 70
    if not k.int8_split(kdim):
        pytest.skip("two-part activations run only on CPUs with AMX")
    g = torch.Generator().manual_seed(11)
    pw = pack_weight(torch.randn(n, kdim, generator=g), "int8", "vnni")
    w_int8 = unpack_weight(pw).double()
    x = torch.randn(4, kdim, generator=g)
    x[:, 3] = 200.0
    got = k.linear_int8(x, pw.data, n, pw.scale, None, None, 64).double()
    exact = x.double() @ w_int8.T
    row_step = x.abs().amax(-1, keepdim=True).double() / 127.0
    bound = (row_step / 254.0 / 2).expand(-1, kdim) @ w_int8.abs().T
    assert ((got - exact).abs() <= bound * (1 + 1e-3) + 1e-3).all()
    q, step = quantised_activations(x, 64)
    blocks_error = ((q * step).double() @ w_int8.T - exact).pow(2).mean()
    assert (got - exact).pow(2).mean() * 1000 < blocks_error


def decode_batch(shape: AttentionShape, lens: list[int], shared: int, seed: int, extend: int = 1,
                 dtype: torch.dtype = torch.float32, int8_kv: bool = False):
    """A batch over a random ``dtype`` pool (in the int8 KV format with ``int8_kv``): request i has ``lens[i]``
    tokens, its last ``extend`` new, the first ``shared`` slots the same for all (a cached prefix: cascade groups
    form when it is long enough)."""
    from radix.kv_storage import KVShape, KVStorage
    from runtime.core.forward_batch import build_forward_batch

    g = torch.Generator().manual_seed(seed)
    slots = 8192
    kv = KVStorage(KVShape(1, shape.num_kv_heads, shape.head_dim, dtype, int8=int8_kv), slots)
    for buffer in (kv.k_buffer, kv.v_buffer):
        buffer.copy_(kv.encode(torch.randn(buffer.shape[:-1] + (shape.head_dim,), generator=g)))
    table = torch.zeros(len(lens), max(lens) + 8, dtype=torch.int64)
    perm = (torch.randperm(slots - 1, generator=g) + 1).tolist()
    prefix, rest = perm[:shared], perm[shared:]
    for i, n in enumerate(lens):
        own, rest = rest[: n - shared], rest[n - shared :]
        table[i, :n] = torch.tensor(prefix + own)
    out_loc = torch.cat([table[i, n - extend : n] for i, n in enumerate(lens)])
    batch = build_forward_batch([[1] * extend] * len(lens), [n - extend for n in lens], list(range(len(lens))),
                                out_loc, kv, table)
    rows = len(lens) * extend
    q = torch.randn(rows, shape.num_heads, shape.head_dim, generator=g).to(dtype)
    k_new = torch.randn(rows, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
    v_new = torch.randn(rows, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
    return batch, q, k_new, v_new


@pytest.mark.parametrize("int8_kv", [False, True])
@pytest.mark.parametrize(("lens", "shared", "extend"), [([5, 80, 333, 1000], 0, 1), ([400, 420, 450, 500], 380, 1),
                                                       ([300, 90], 0, 12), ([700], 0, 120)])
def test_in_place_decode_equals_the_gather_path_inside_the_backend(lens, shared, extend, int8_kv):
    """Plain decode rows; with a long shared prefix the own parts of a cascade group merged by LSE; short
    prefill chunks over a cached prefix (each new token attends its own positions); a long chunk (gathered by
    both). Over an int8 pool the kernels read the rows as stored and the gather path dequantises them: the same
    values, summed in another order."""
    shape = AttentionShape(9, 3, 64)
    fast, gather = TorchNativeBackend(shape), TorchNativeBackend(shape, in_place_decode=False)
    assert fast.paged is not None and gather.paged is None
    outs = []
    for backend in (fast, gather):
        batch, q, k_new, v_new = decode_batch(shape, lens, shared, seed=3, extend=extend, int8_kv=int8_kv)
        backend.plan(batch)
        assert (batch.attn_metadata.cascade is not None) == (shared > 0 and backend.groups_pay(batch))
        outs.append(backend.forward(q, k_new, v_new, 0, batch))
    # Over an int8 pool a VNNI host's decode kernel multiplies in int16, its queries and weights rounded to 2^-16
    # of their largest (test_kv_int8.py holds it to that rounding exactly): up to ~5e-5 here.
    tol = 1e-4 if int8_kv and load_kernels("fastcpu").int8_vnni() else 1e-5
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)


@pytest.mark.parametrize("int8_kv", [False, True])
def test_decode_groups_only_where_the_gemm_kernel_attends_them(int8_kv):
    """Decode rows under a shared prefix form no cascade group where the shared part would go through SDPA (no GEMM
    kernel for the pool: fp32 or int8, or a CPU without AVX512_BF16): they read the pool in place, the rows sharing a
    range in one kernel call. Prefill chunks group over either pool; the gather path (no in-place kernel) groups
    whatever shares."""
    shape = AttentionShape(9, 3, 64)
    fast, gather = TorchNativeBackend(shape), TorchNativeBackend(shape, in_place_decode=False)
    assert fast.paged is not None
    decode, *_ = decode_batch(shape, [400, 420, 450, 500], 380, seed=3, int8_kv=int8_kv)
    chunks, *_ = decode_batch(shape, [400, 420, 450, 500], 380, seed=3, extend=12, int8_kv=int8_kv)
    gemm = fast.paged.gemm_shared(decode.kv.shape.dtype)
    assert not gemm  # the pools here are fp32 and int8: the GEMM kernel's rows are bf16
    assert not fast.groups_pay(decode)
    assert fast.groups_pay(chunks) and gather.groups_pay(decode)
    fast.plan(decode)
    assert decode.attn_metadata.cascade is None


def test_dtype_auto_and_quantization_flags():
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert ServerArgs(device="cpu").resolve().dtype == expected
    assert ServerArgs(device="cpu", dtype="float32").resolve().dtype == "float32"
    assert ServerArgs(device="cpu", enable_deterministic_inference=True).resolve().dtype == "float32"
    assert ServerArgs(device="cpu", quantization="int8").resolve().quantization == "int8"
    with pytest.raises(ValueError, match="enable_deterministic_inference"):
        ServerArgs(device="cpu", quantization="int8", enable_deterministic_inference=True).resolve()
    from runtime.config import aten_cpu_capability

    if aten_cpu_capability() != "AVX512":
        with pytest.raises(ValueError, match="dtype"):
            ServerArgs(device="cpu", dtype="bfloat16").resolve()


def test_quality_check_runs_every_format(tiny_model_dir):
    from runtime.bench.quality import measure
    from runtime.config import aten_cpu_capability

    # bfloat16 runs where torch's CPU kernels are AVX-512 ones (elsewhere --dtype bfloat16 is refused)
    formats = ["bfloat16", "int8"] if aten_cpu_capability() == "AVX512" else ["int8"]
    rows = measure(str(tiny_model_dir), formats, count=4, new_tokens=4, engine_args={"max_total_tokens": 4096})
    assert [r.name for r in rows] == ["float32", *formats]
    ref = rows[0]
    assert ref.identical == 1.0 and ref.agreeing_tokens == 1.0 and ref.perplexity_change == 0.0
    for r in rows:
        assert r.prompts == 4 and 0.0 <= r.identical <= r.agreeing_tokens <= 1.0
        assert math.isfinite(r.perplexity) and r.perplexity > 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_silu_and_rope_match_torch(k, dtype):
    from runtime.models.layers import apply_rotary, rms_norm

    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(7, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), **tol)
    gu = torch.randn(3, 256, generator=g).to(dtype)
    torch.testing.assert_close(k.silu_mul(gu), F.silu(gu[:, :128]) * gu[:, 128:], **tol)
    qkv = torch.randn(4, 960, generator=g).to(dtype)
    heads = qkv[:, :768].view(4, 12, 64)  # a strided view, as the model passes q and k
    cos, sin = torch.randn(4, 64, generator=g).to(dtype), torch.randn(4, 64, generator=g).to(dtype)
    torch.testing.assert_close(k.rotary(heads, cos, sin), apply_rotary(heads, cos[:, None], sin[:, None]), **tol)


def test_a_kernel_set_has_one_build_whatever_was_loaded_before():
    """The build key of the fastcpu kernels is the same whether the invariant kernels were loaded first in the
    process (a deterministic server, whose sampler loads fastcpu after them) or not. torch's loader appends to
    the linker flags it is given: when it was given the module's own list, the second set's key changed and it
    was compiled again, inside the server's first step."""
    import subprocess
    import sys

    def fastcpu_module(first: list[str]) -> str:
        code = ("from runtime.kernels.build import load_kernels\n"
                f"for name in {first!r}: load_kernels(name)\n"
                "print(load_kernels('fastcpu').__name__)")
        return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                              timeout=600).stdout.strip()

    assert fastcpu_module(["invariant"]) == fastcpu_module([])
