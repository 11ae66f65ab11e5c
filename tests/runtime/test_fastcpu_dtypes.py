"""The fastcpu kernels take and give the model's activations as they are (float32 or bfloat16).

A bf16 model's decode step used to convert every activation to fp32 before a kernel and every result back
in torch; the kernels now do both themselves. What they promise: a bf16 input gives exactly the bits of the
same call on its (exactly) widened fp32 copy, rounded to bf16 the way torch rounds — and a bf16 residual
receives the product as ``residual.add_(y.to(torch.bfloat16))`` would, so the residual stream keeps its bits.
"""

from __future__ import annotations

import pytest
import torch

from runtime.kernels.build import load_kernels
from runtime.models.ops import PackedCpuOps
from runtime.models.packed import pack_weight

KERNELS = load_kernels("fastcpu")


@pytest.fixture(scope="module")
def k():
    return KERNELS


def linear_calls(k) -> dict[str, object]:
    """Each linear kernel built here, as ``f(x, weight, bias, out)`` over its own packing of ``weight``."""
    calls = {}

    def packed(fmt, layout):
        def call(x, w, b, out):
            pw = pack_weight(w, fmt, layout)
            return k.linear_packed(x, pw.data, pw.out_features, pw.scale, b, out)
        return call

    calls["float32"] = packed("float32", "kmajor")
    calls["bfloat16 k-major"] = packed("bfloat16", "kmajor")
    calls["int8 k-major"] = packed("int8", "kmajor")
    if k.bf16_dot():
        def bf16(x, w, b, out):
            pw = pack_weight(w, "bfloat16", "bf16pair")
            return k.linear_bf16(x, pw.data, pw.out_features, b, out)
        calls["bfloat16 pairs"] = bf16
    if k.int8_dot():
        def int8_dot(x, w, b, out):
            pw = pack_weight(w, "int8", "vnni")
            return k.linear_int8(x, pw.data, pw.out_features, pw.scale, b, out, 32)
        calls["int8 dot"] = int8_dot
    return calls


@pytest.mark.parametrize("kernel", list(linear_calls(KERNELS)))
@pytest.mark.parametrize(("m", "kdim", "n"), [(1, 576, 960), (5, 70, 13), (9, 64, 131)])
def test_linear_takes_bf16_activations_and_returns_them_rounded_as_torch(k, kernel, m, kdim, n):
    call = linear_calls(k)[kernel]
    g = torch.Generator().manual_seed(m * kdim + n)
    w, b = torch.randn(n, kdim, generator=g), torch.randn(n, generator=g)
    full = torch.randn(m, kdim + 8, generator=g).bfloat16()
    x = full[:, 3 : 3 + kdim]  # a row-strided view, as a slice of a fused projection is
    ref = call(x.float(), w, b, None)  # fp32 in, fp32 out: the kernel's own arithmetic
    got = call(x, w, b, None)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got, ref.to(torch.bfloat16))


@pytest.mark.parametrize("kernel", list(linear_calls(KERNELS)))
def test_linear_adds_into_a_bf16_residual_as_torch_would(k, kernel):
    call = linear_calls(k)[kernel]
    g = torch.Generator().manual_seed(11)
    m, kdim, n = 7, 96, 80
    w = torch.randn(n, kdim, generator=g)
    x = torch.randn(m, kdim, generator=g).bfloat16()
    residual = (torch.randn(m, n, generator=g) * 30).bfloat16()
    expected = residual.clone().add_(call(x.float(), w, None, None).to(torch.bfloat16))
    returned = call(x, w, None, residual)
    assert returned.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, expected)
    # a float32 residual takes the product directly, whatever x's dtype
    res32 = torch.randn(m, n, generator=g)
    expected32 = res32 + call(x.float(), w, None, None)
    call(x, w, None, res32)
    torch.testing.assert_close(res32, expected32, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", [name for name in linear_calls(KERNELS) if name in ("int8 dot", "bfloat16 pairs")])
def test_a_row_gets_the_same_bits_alone_or_among_many(k, kernel):
    """The int8 and bf16 dot-product kernels compute each row on its own: quantised (int8, in parallel over rows
    from ~56 rows of K = 576) or paired (bf16) straight from its bf16 values, and stored by its own tile, so a row's
    product and residual update are the same bits in a batch of 1 or of 139 (several 48-row chunks). On a CPU with
    AMX the batch runs on the tiles and the single row on vectors: both sum each row's pair products (bf16) or exact
    block sums (int8) in k order into fp32, so this holds across the two paths too."""
    call = linear_calls(k)[kernel]
    g = torch.Generator().manual_seed(5)
    m, kdim, n = 139, 576, 200
    w, b = torch.randn(n, kdim, generator=g), torch.randn(n, generator=g)
    x = torch.randn(m, kdim, generator=g).bfloat16()
    many = call(x, w, b, None)
    residual = (torch.randn(m, n, generator=g) * 30).bfloat16()
    together = residual.clone()
    call(x, w, None, together)
    for r in (0, 47, 48, 100, 138):
        assert torch.equal(call(x[r : r + 1], w, b, None), many[r : r + 1]), r
        alone = residual[r : r + 1].clone()
        call(x[r : r + 1], w, None, alone)
        assert torch.equal(alone, together[r : r + 1]), r


def test_linear_refuses_other_dtypes(k):
    pw = pack_weight(torch.randn(16, 32), "float32", "kmajor")
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        k.linear_packed(torch.randn(2, 32).half(), pw.data, 16, None, None, None)
    with pytest.raises(RuntimeError, match="out must be"):
        k.linear_packed(torch.randn(2, 32), pw.data, 16, None, None, torch.zeros(2, 16, dtype=torch.float64))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_takes_bf16_queries_and_returns_bf16(k, pool_dtype):
    g = torch.Generator().manual_seed(3)
    b, hkv, group, d, slots = 3, 3, 3, 64, 400
    h = hkv * group
    k_pool = torch.randn(slots, hkv * d, generator=g).to(pool_dtype)
    v_pool = torch.randn(slots, hkv * d, generator=g).to(pool_dtype)
    index = torch.stack([torch.randperm(slots - 1, generator=g)[:300] + 1 for _ in range(b)])
    lengths = torch.tensor([300, 17, 258])
    # q as the model hands it over: the query heads of a fused [T, H + Hkv, D] rotary output
    qk = torch.randn(b, h + hkv, d, generator=g).bfloat16()
    q = qk[:, :h]
    ref, ref_lse = k.decode_attention(q.float(), k_pool, v_pool, index, None, lengths, d**-0.5, hkv)
    got, lse = k.decode_attention(q, k_pool, v_pool, index, None, lengths, d**-0.5, hkv)
    assert got.dtype == torch.bfloat16 and lse.dtype == torch.float32
    if pool_dtype == torch.float32 or not k.bf16_dot():  # bf16 q widened exactly: the fp32 call's bits, rounded
        assert torch.equal(got, ref.to(torch.bfloat16)) and torch.equal(lse, ref_lse)
        return
    # bf16 q over a bf16 pool: bf16 dot products (the weights of the values rounded to bf16). Against float64,
    # its error stays within twice that of rounding the exact result to bf16 (the fp32 path's error is that).
    for r, n in enumerate(lengths.tolist()):
        keys = k_pool[index[r, :n]].double().view(n, hkv, d).repeat_interleave(group, 1)
        vals = v_pool[index[r, :n]].double().view(n, hkv, d).repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[r].double(), keys) * d**-0.5
        exact = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
        rounding = (exact.bfloat16().double() - exact).abs()
        err = (got[r].double() - exact).abs()
        assert err.mean() <= 2 * rounding.mean() and err.max() <= 2 * rounding.max(), r
        torch.testing.assert_close(lse[r].double(), torch.logsumexp(scores, -1), rtol=0, atol=1e-5)


@pytest.mark.skipif(not KERNELS.bf16_dot(), reason="extend_attention is built only for CPUs with AVX512_BF16")
def test_extend_attention_takes_bf16_queries(k):
    g = torch.Generator().manual_seed(4)
    t, hkv, group, d, slots = 20, 3, 3, 64, 200
    k_pool = torch.randn(slots, hkv * d, generator=g).bfloat16()
    v_pool = torch.randn(slots, hkv * d, generator=g).bfloat16()
    index = torch.randperm(slots - 1, generator=g)[:150] + 1
    lengths = torch.arange(131, 151)
    q = torch.randn(t, hkv * group + hkv, d, generator=g).bfloat16()[:, : hkv * group]
    ref = k.extend_attention(q.float(), k_pool, v_pool, index, lengths, d**-0.5, hkv)
    got = k.extend_attention(q, k_pool, v_pool, index, lengths, d**-0.5, hkv)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_packed_ops_keep_the_activation_dtype(fmt):
    """PackedCpuOps hands bf16 activations to the kernels as they are and gets bf16 back; a bf16 residual is
    added into in place with the bits torch's add of the rounded product gives."""
    g = torch.Generator().manual_seed(9)
    ops = PackedCpuOps(fmt)
    w = torch.nn.Parameter(torch.randn(96, 64, generator=g), requires_grad=False)
    ops.pack([w], release=lambda _: False)
    # 3 rows: within every format's packed-kernel limit (bf16 without bf16 dot products hands 4+ rows to oneDNN)
    x = torch.randn(3, 64, generator=g).bfloat16()
    y = ops.linear(x, w, None)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ops.linear(x.float(), w, None).to(torch.bfloat16))
    residual = torch.randn(3, 96, generator=g).bfloat16()
    expected = residual.clone().add_(y)
    ops.add_linear_(residual, x, w, None)
    assert torch.equal(residual, expected)
    # the output projection: the kernel's fp32 sums, which round to the bf16 product's bits
    logits = ops.logits(x, w)
    assert logits.dtype == torch.float32 and torch.equal(logits.to(torch.bfloat16), y)
    assert torch.equal(logits, ops.linear(x.float(), w, None))


@pytest.mark.parametrize(("fmt", "kernel"), [("bfloat16", None), ("int8", "float")])
def test_logits_beyond_the_packed_rows_or_without_a_packed_copy(fmt, kernel):
    """Past the packed kernel's rows, int8 weights still give fp32 sums (the GEMM over their dequantised copy), bf16
    weights the library GEMM's bf16 product widened to fp32, and a weight with no packed copy torch's product."""
    g = torch.Generator().manual_seed(11)
    ops = PackedCpuOps(fmt, int8_kernel=kernel)
    w = torch.nn.Parameter(torch.randn(96, 64, generator=g).bfloat16(), requires_grad=False)
    ops.pack([w], release=lambda _: False)
    x = torch.randn(ops.small_m + 1, 64, generator=g).bfloat16()
    assert not ops.runs_packed(x.shape[0])
    logits = ops.logits(x, w)
    assert logits.dtype == torch.float32
    if fmt == "int8":
        assert torch.equal(logits, ops.linear(x.float(), w, None))
        assert torch.equal(logits.to(torch.bfloat16), ops.linear(x, w, None))
    else:
        assert torch.equal(logits, ops.linear(x, w, None).float())
    unpacked = torch.randn(80, 64, generator=g).bfloat16()
    assert torch.equal(ops.logits(x[:2], unpacked), torch.nn.functional.linear(x[:2], unpacked).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_rows_index_copy_would(k, dtype):
    g = torch.Generator().manual_seed(6)
    slots_total, hkv, d, t = 50, 3, 64, 7
    k_pool, v_pool = torch.zeros(slots_total, hkv * d, dtype=dtype), torch.zeros(slots_total, hkv * d, dtype=dtype)
    qkv = torch.randn(t, 9 + 2 * hkv, d, generator=g).to(dtype)  # k and v as row-strided views of a fused output
    kk, vv = qkv[:, 9 : 9 + hkv], qkv[:, 9 + hkv :]
    slots = torch.tensor([4, 49, 1, 17, 18, 30, 2])
    k.store_kv(k_pool, v_pool, slots, kk, vv)
    ek, ev = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    ek.index_copy_(0, slots, kk.reshape(t, -1))
    ev.index_copy_(0, slots, vv.reshape(t, -1))
    assert torch.equal(k_pool, ek) and torch.equal(v_pool, ev)
    with pytest.raises(RuntimeError, match="slot out of range"):
        k.store_kv(k_pool, v_pool, torch.tensor([0, 1, 2, 3, 4, 5, 50]), kk, vv)
    with pytest.raises(RuntimeError, match="pool's dtype"):
        k.store_kv(k_pool, v_pool, slots, kk.double(), vv.double())
