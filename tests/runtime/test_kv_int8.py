"""The int8 KV cache (``--kv-cache-dtype int8``, radix/kv_int8.py): one rounding whichever path writes a row, the
decode kernel reading the rows as stored, the capacity it buys, the flags it refuses, and a served model whose
perplexity stays within 1% of the same model over a float KV cache."""

from __future__ import annotations

import pytest
import torch

from radix.host_pool import HostKVPool
from radix.kv_int8 import SCALE_BYTES, dequantize, quantize
from radix.kv_storage import KVShape, KVStorage
from runtime.bench.quality import TEXT, perplexity
from runtime.config import ServerArgs
from runtime.kernels.build import load_kernels
from tests.conftest import checked_engine


@pytest.fixture(scope="module")
def k():
    return load_kernels("fastcpu")


def test_rounding_error_is_at_most_half_a_step_per_value():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[7, 2] = 0.0  # an all-zero row: values and scale 0
    rows = quantize(x)
    assert rows.shape == (50, 3, 64 + SCALE_BYTES) and rows.dtype == torch.int8
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale[..., 0], x.abs().amax(-1) / 127)
    assert (rows[..., :64].abs().amax(-1) == torch.where(x.abs().amax(-1) > 0, 127, 0)).all()
    back = dequantize(rows, torch.float32)
    assert ((back - x).abs() <= scale * 0.5 * (1 + 1e-6)).all()
    assert torch.equal(back[7, 2], torch.zeros(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_store_kernel_writes_the_bytes_torch_writes(k, dtype):
    g = torch.Generator().manual_seed(1)
    heads, dim, slots = 3, 64, 400
    new_k = (torch.randn(60, heads, dim, generator=g) * 4).to(dtype)
    new_v = torch.randn(60, heads, dim, generator=g).to(dtype)
    new_k[5, 1] = 0.0
    # a row whose largest value is 127 (steps of exactly 1): its halves are ties, rounded to even by both writers
    new_k[6, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    where = torch.randperm(slots, generator=g)[:60]
    k_pool = torch.zeros(slots, heads * (dim + SCALE_BYTES), dtype=torch.int8)
    v_pool = torch.zeros_like(k_pool)
    k.store_kv(k_pool, v_pool, where, new_k, new_v)
    assert torch.equal(k_pool[where], quantize(new_k).view(60, -1))
    assert torch.equal(v_pool[where], quantize(new_v).view(60, -1))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[where] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


def int16_rounded(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` as the VNNI decode kernel hands it to its integer dot products: round-half-even to int16 steps of
    max|x| / 32767 along ``dim``, back in float64."""
    amax = x.float().abs().amax(dim, keepdim=True)
    steps = (x.float() * (torch.tensor(32767.0) / amax)).round().nan_to_num()
    return steps.double() * (amax.double() / 32767)


def attention_over_rows(q, keys, vals, v_scale, scale, int16: bool):
    """float64 attention of one row's query heads [H, D] over its dequantised keys and values [H, n, D]; with
    ``int16``, the queries and each tile of 16 positions' weights (probability times the V row's scale) rounded
    as the VNNI kernel rounds them."""
    q = int16_rounded(q) if int16 else q.double()
    scores = (q[:, None] @ keys.transpose(1, 2))[:, 0] * scale
    probs = torch.softmax(scores, -1)
    if int16:  # the weights on the int8 values, v_scale [H, n], rounded per tile; a tile's scale is immaterial
        w = probs * v_scale
        w = torch.cat([int16_rounded(w[:, t : t + 16]) for t in range(0, w.shape[1], 16)], -1)
        probs = w / v_scale
    return (probs[:, None] @ vals)[:, 0], torch.logsumexp(scores, -1)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_over_an_int8_pool_equals_attention_over_the_dequantised_rows(k, q_dtype):
    """Where the host has VNNI the kernel multiplies in int16: its queries and weights rounded to 2^-16 of their
    largest. Against float64 attention with those roundings it is exact up to fp32 arithmetic; against exact
    attention the two roundings cost under 2e-4, far below the int8 rows' own rounding (2^-8 of a row's
    largest value)."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, pool = 9, 3, 64, 3000
    k_rows = quantize(torch.randn(pool, kv_heads, dim, generator=g) * 2)
    v_rows = quantize(torch.randn(pool, kv_heads, dim, generator=g))
    lengths = torch.tensor([1, 15, 17, 256, 257, 1200])
    index = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.int64)
    for b, n in enumerate(lengths.tolist()):
        index[b, :n] = torch.randperm(pool, generator=g)[:n]
    q = torch.randn(len(lengths), heads, dim, generator=g).to(q_dtype)
    q[2, 4] = 0.0  # an all-zero query head
    out, lse = k.decode_attention(q, k_rows.view(pool, -1), v_rows.view(pool, -1), index, None, lengths,
                                  dim**-0.5, kv_heads)
    assert out.dtype == q_dtype
    keys, vals = dequantize(k_rows, torch.float64), dequantize(v_rows, torch.float64)
    v_scale = v_rows[..., dim:].contiguous().view(torch.float32)[..., 0].double()
    # fp32 arithmetic; a bf16 output adds its own rounding (2^-8 relative)
    tol = 1e-5 if q_dtype == torch.float32 else 8e-3
    for b, n in enumerate(lengths.tolist()):
        rows = index[b, :n]
        kb, vb = (x[rows].repeat_interleave(3, 1).transpose(0, 1) for x in (keys, vals))  # [H, n, D]
        vs = v_scale[rows].repeat_interleave(3, 1).T
        want, want_lse = attention_over_rows(q[b], kb, vb, vs, dim**-0.5, k.int8_vnni())
        torch.testing.assert_close(out[b].double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[b].double(), want_lse, rtol=1e-5, atol=1e-5)
        exact, exact_lse = attention_over_rows(q[b], kb, vb, vs, dim**-0.5, False)
        torch.testing.assert_close(out[b].double(), exact, rtol=max(tol, 2e-4), atol=max(tol, 2e-4))
        torch.testing.assert_close(lse[b].double(), exact_lse, rtol=2e-4, atol=2e-4)


@pytest.mark.skipif(not load_kernels("fastcpu").bf16_dot(), reason="extend_attention needs AVX512_BF16")
@pytest.mark.parametrize("dim", [64, 128])
def test_extend_kernel_reads_an_int8_pool_as_its_dequantised_bf16_rows(k, dim):
    """The GEMM kernel converts an int8 pool's rows to bf16 as it packs them: its packs, and its attention for a
    prefill chunk over scattered slots, are the same bits as over the bf16 pool torch's dequantisation gives."""
    g = torch.Generator().manual_seed(3)
    kv_heads, heads, pool, prefix, chunk = 3, 9, 2500, 1050, 40
    k_rows = quantize(torch.randn(pool, kv_heads, dim, generator=g) * 3)
    v_rows = quantize(torch.randn(pool, kv_heads, dim, generator=g))
    k_rows[17, 1] = quantize(torch.zeros(dim))  # an all-zero row: values and scale 0
    k8, v8 = k_rows.view(pool, -1), v_rows.view(pool, -1)
    k16, v16 = (dequantize(r, torch.bfloat16).view(pool, -1) for r in (k_rows, v_rows))
    index = torch.randperm(pool, generator=g)[: prefix + chunk]
    index[5] = 17
    for a, b in zip(k.pack_prefix(k8, v8, index, kv_heads, dim), k.pack_prefix(k16, v16, index, kv_heads, dim)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    q = torch.randn(chunk, heads, dim, generator=g).bfloat16()
    lengths = torch.arange(prefix + 1, prefix + chunk + 1)
    got = k.extend_attention(q, k8, v8, index, lengths, dim**-0.5, kv_heads, None)
    want = k.extend_attention(q, k16, v16, index, lengths, dim**-0.5, kv_heads, None)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_int8_rows_hold_nearly_twice_the_tokens_of_bf16():
    bf16 = KVShape(30, 3, 64, torch.bfloat16)
    int8 = KVShape(30, 3, 64, torch.bfloat16, int8=True)
    assert int8.row_dim == 68 and int8.storage_dtype == torch.int8
    assert bf16.bytes_per_token == 2 * 30 * 3 * 128 and int8.bytes_per_token == 2 * 30 * 3 * 68
    budget = 2**30
    assert int8.tokens_for_bytes(budget) / bf16.tokens_for_bytes(budget) > 1.88
    pool = KVStorage(int8, 64)
    assert pool.k_buffer.shape == (30, 64, 3, 68) and pool.nbytes == 64 * int8.bytes_per_token
    with pytest.raises(ValueError, match="paged view"):
        pool.paged_view(0)


def test_host_tier_copies_int8_rows_as_they_are():
    shape = KVShape(2, 3, 64, torch.float32, int8=True)
    device = KVStorage(shape, 64)
    g = torch.Generator().manual_seed(4)
    for layer in range(2):
        device.set_kv(layer, torch.arange(64), torch.randn(64, 3, 64, generator=g), torch.randn(64, 3, 64, generator=g))
    host = HostKVPool.for_device(device, 32)
    assert host.k_buffer.dtype == torch.int8 and host.k_buffer.shape[-1] == 68
    src = torch.arange(10, 26)
    host_slots, copy = host.backup(device, src)
    copy.wait()
    restored = KVStorage(shape, 64)
    host.restore(host_slots, restored, src).wait()
    assert torch.equal(restored.read(src)[0], device.read(src)[0])
    assert torch.equal(restored.read(src)[1], device.read(src)[1])


def test_flags_that_cannot_read_an_int8_cache_are_refused():
    args = ServerArgs(device="cpu", kv_cache_dtype="int8").resolve()
    assert args.attention_backend == "torch_native"
    for bad, match in [({"attention_backend": "flashinfer"}, "torch_native"),
                       ({"enable_deterministic_inference": True}, "kv-cache-dtype auto"),
                       ({"device": "cuda"}, "implemented for the CPU"),
                       ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype: 'fp8' is not one of: auto, int8")]:
        with pytest.raises(ValueError, match=match):
            ServerArgs(**{"device": "cpu", "kv_cache_dtype": "int8", **bad}).validate()


@pytest.mark.slow
def test_served_model_over_an_int8_cache_keeps_its_perplexity():
    """The shipped quality text scored by the default model over a float KV cache and over the int8 one: its
    ~900-token prefill goes through the gathering path in 1024-token chunks, and the same text again in chunks of
    40 through the in-place kernel; then a batch of decode rows and a shared prefix. The perplexity target of the
    quality check (within 1% for bf16) holds, and the KV accounting closes."""
    text = TEXT.read_text()
    results = {}
    for kv in ("auto", "int8"):
        with checked_engine("default", max_total_tokens=4096, kv_cache_dtype=kv) as eng:
            whole = perplexity(eng, text)
            eng.flush_cache()
            ids = eng.tokenizer(text).input_ids
            for end in range(40, len(ids), 40):  # each chunk extends the previous one's cached prefix
                eng.generate(input_ids=ids[:end], sampling_params={"max_new_tokens": 1})
            chunked = perplexity(eng, text)
            outs = eng.generate(input_ids=[ids[:300] + [5 + i] for i in range(6)],
                                sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert all(len(o["output_ids"]) == 16 for o in outs)
            results[kv] = (whole, chunked)
    for i in range(2):
        assert abs(results["int8"][i] / results["auto"][i] - 1) < 0.01, results


def test_disk_blocks_of_an_int8_cache_are_read_back_by_int8_servers_only(tiny_engine, tmp_path):
    """Blocks written by a server with the int8 cache hold its rows as stored: a restarted int8 server resumes from
    them (the same work as the first server reading them back, so the same tokens and logprobs), and a server
    with a float cache, whose rows have another shape, has another fingerprint and never reads them."""
    store = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
    ids = list(range(300, 500))
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    def ask(engine):
        out = engine.generate(input_ids=ids, return_logprob=True, sampling_params=sampling)
        meta = out["meta_info"]
        return out["output_ids"], [lp for lp, *_ in meta["output_token_logprobs"]], meta["cached_tokens"]

    first = tiny_engine(kv_cache_dtype="int8", **store)
    assert ask(first)[2] == 0
    assert first.flush_cache()  # waits for the disk writer; device and host tiers emptied
    from_disk = ask(first)
    assert from_disk[2] >= 192
    other = tiny_engine(**store)
    assert ask(other)[2] == 0 and other.server_info()["cache"]["tiers"]["disk"]["blocks_read"] == 0
    restarted = tiny_engine(kv_cache_dtype="int8", **store)
    assert ask(restarted) == from_disk
    for engine in (first, other, restarted):
        report = engine.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report


def test_tensor_parallel_ranks_hand_the_tiers_whole_int8_rows(tiny_model_dir):
    """At tp 2 each rank stores its KV heads' int8 rows; the host tier receives every head's rows (values and
    scales) and scatters them back, so a decode step over the restored slots equals one over the originals."""
    from runtime.executor.model_runner import ModelRunner
    from tests.runtime.test_tensor_parallel import rank_processes
    from tests.runtime.test_tensor_parallel_tiers import PROMPT, bits, decode, prefill

    r = ModelRunner(ServerArgs(model=str(tiny_model_dir), tp_size=2, max_total_tokens=1024, dtype="float32",
                               kv_cache_dtype="int8", log_level="warning"))
    try:
        assert r.kv_pages.shape == KVShape(2, 2, 16, torch.float32, int8=True)
        slots = prefill(r, 0, PROMPT)
        k, v = r.kv_pages.read(slots)
        assert k.dtype == torch.int8 and k.shape == (2, len(PROMPT), 2, 16 + SCALE_BYTES)
        pool = HostKVPool.for_device(r.kv_pages, 64)
        host, handle = pool.backup(r.kv_pages, slots)
        handle.wait()
        fresh = r.allocator.alloc(len(PROMPT))
        pool.restore(host, r.kv_pages, fresh).wait()
        k2, v2 = r.kv_pages.read(fresh)
        assert torch.equal(k2, k) and torch.equal(v2, v)
        assert torch.equal(bits(decode(r, 1, fresh, 7)), bits(decode(r, 2, slots, 7)))
    finally:
        r.close()
    assert rank_processes() == []
