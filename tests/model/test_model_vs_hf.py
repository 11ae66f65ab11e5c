"""Our Llama-family model + torch_native attention against Hugging Face transformers on tiny random models.

Every comparison is at the same token positions: full prefills batched together, prefills over a cached
prefix (chunked), single-token decodes mixed with prefills, pure decode batches with equal and unequal
lengths, page sizes 1 and 16, greedy generation, and bf16.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from model_helpers import TINY_CONFIGS, VOCAB, PoolDriver, hf_logits

from runtime.models.loader import load_model
from tests.oracle import Greedy, assert_greedy_agrees

ARCHS = list(TINY_CONFIGS)
ATOL = 1e-4


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _load(checkpoints: dict[str, tuple[Any, Any]], arch: str, dtype: torch.dtype = torch.float32) -> tuple:
    hf, folder = checkpoints[arch]
    model, _ = load_model(folder, dtype=dtype)
    return hf, model


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_matches_hf(hf_checkpoints, arch: str, page_size: int) -> None:
    hf, model = _load(hf_checkpoints, arch)
    driver = PoolDriver(model, page_size=page_size)
    prompts = {"a": _ids(1, 1), "b": _ids(2, 9), "c": _ids(3, 37), "d": _ids(4, 9)}
    outs = driver.run(list(prompts.items()))
    for (rid, ids), logits in zip(prompts.items(), outs):
        torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0, msg=f"request {rid}")
    # Decode steps: b and d alone have equal lengths (no key mask); then all four, padded and masked.
    for work in ([("b", [7]), ("d", [8])], [(rid, [11]) for rid in prompts]):
        for (rid, _), logits in zip(work, driver.run(work)):
            torch.testing.assert_close(logits[-1], hf_logits(hf, driver.tokens[rid])[-1], atol=ATOL, rtol=0,
                                       msg=f"decode of request {rid}")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_mixed_decode_matches_hf(hf_checkpoints, arch: str, page_size: int) -> None:
    hf, model = _load(hf_checkpoints, arch)
    driver = PoolDriver(model, page_size=page_size)
    full = {"a": _ids(10, 40), "b": _ids(11, 6), "c": _ids(12, 21)}
    extra = {rid: _ids(20 + i, 6) for i, rid in enumerate(full)}  # tokens fed one per decode step
    refs = {rid: hf_logits(hf, full[rid] + extra[rid]) for rid in full}
    seen: dict[str, int] = {rid: 0 for rid in full}

    def check(work: list[tuple[str, list[int]]]) -> None:
        for (rid, ids), logits in zip(work, driver.run(work)):
            start = seen[rid]
            seen[rid] += len(ids)
            torch.testing.assert_close(logits, refs[rid][start : seen[rid]], atol=ATOL, rtol=0,
                                       msg=f"{arch} request {rid} positions {start}..{seen[rid] - 1}")

    a, b, c = full["a"], full["b"], full["c"]
    check([("a", a[:13])])  # a's first chunk
    check([("a", a[13:30]), ("b", b)])  # a's second chunk over its cached prefix, b whole
    check([("a", a[30:]), ("b", extra["b"][:1]), ("c", c[:5])])  # chunk + decode + new prefill
    check([("c", c[5:]), ("b", extra["b"][1:2]), ("a", extra["a"][:1])])
    for _ in range(4):  # pure decode batches of three different lengths
        check([(rid, [extra[rid][seen[rid] - len(full[rid])]]) for rid in ("a", "b", "c")])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(hf_checkpoints, arch: str) -> None:
    hf, model = _load(hf_checkpoints, arch)
    driver = PoolDriver(model, page_size=4)
    prompts = {"x": _ids(30, 5), "y": _ids(31, 12), "z": _ids(32, 8)}
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    rows: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    work = list(prompts.items())
    for _ in range(16):  # the first iteration prefills, the rest decode
        outs = driver.run(work)
        work = []
        for rid, logits in zip(prompts, outs):
            token = int(logits[-1].argmax())
            generated[rid].append(token)
            rows[rid].append(logits[-1])
            work.append((rid, [token]))
    for rid, ids in prompts.items():
        ref = Greedy.from_hf_generate(hf, ids, 16, min_new_tokens=16, eos_token_id=None, pad_token_id=0)
        ours = Greedy.from_logits(generated[rid], torch.stack(rows[rid]))
        assert_greedy_agrees(ref, ours, f"{arch} request {rid}")


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_stays_close(hf_checkpoints, arch: str) -> None:
    """bf16 through our code is about as far from fp32 as HF's own bf16 model is."""
    hf, model = _load(hf_checkpoints, arch, dtype=torch.bfloat16)
    assert model.embed_tokens.dtype == torch.bfloat16
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    driver = PoolDriver(model, page_size=16)
    prompts = {"a": _ids(40, 30), "b": _ids(41, 3)}
    outs = dict(zip(prompts, driver.run(list(prompts.items()))))
    for token in (5, 6, 7):
        for rid, logits in zip(prompts, driver.run([(rid, [token]) for rid in prompts])):
            outs[rid] = torch.cat([outs[rid], logits])
    for rid, ours in outs.items():
        assert ours.dtype == torch.float32
        ref = hf_logits(hf, driver.tokens[rid])
        hf_err = (hf_logits(hf_bf16, driver.tokens[rid]) - ref).abs().max().item()
        err = (ours - ref).abs().max().item()
        assert err <= 2 * hf_err + 0.02, f"{arch}/{rid}: bf16 off by {err}, HF's bf16 by {hf_err}"
        # Where fp32 has a clear winner (top-2 gap above bf16 noise), bf16 must pick the same token.
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * hf_err + 0.02
        same = ours.argmax(-1) == ref.argmax(-1)
        assert bool(same[clear].all()), f"{arch}/{rid}: bf16 changes a clear argmax"


def test_rotary_tables_grow_on_demand(hf_checkpoints) -> None:
    from runtime.models.layers import RotaryCache

    hf, model = _load(hf_checkpoints, "llama")
    arch = model.arch
    model.rotary = RotaryCache(arch.head_dim, arch.max_positions, arch.rope, model.dtype, "cpu", initial=4)
    driver = PoolDriver(model)
    ids = _ids(50, 21)
    (logits,) = driver.run([("a", ids)])
    assert model.rotary.cos.shape[0] >= 21
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_fp32_model_over_bf16_kv_pool(hf_checkpoints) -> None:
    """KV pool in another dtype than the model: attention runs in the pool's dtype, output in the model's."""
    hf, model = _load(hf_checkpoints, "qwen2")
    driver = PoolDriver(model, page_size=16, kv_dtype=torch.bfloat16)
    prompts = {"a": _ids(60, 12), "b": _ids(61, 4)}
    outs = driver.run(list(prompts.items()))
    outs = [torch.cat([o, n]) for o, n in zip(outs, driver.run([(rid, [9]) for rid in prompts]))]
    for rid, ours in zip(prompts, outs):
        ref = hf_logits(hf, driver.tokens[rid])
        assert ours.dtype == torch.float32
        assert (ours - ref).abs().max().item() < 0.1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_native_on_cuda(hf_checkpoints, arch: str) -> None:
    hf, folder = hf_checkpoints[arch]
    model, _ = load_model(folder, dtype=torch.float32, device="cuda")
    driver = PoolDriver(model, page_size=16)
    prompts = {"a": _ids(70, 17), "b": _ids(71, 5)}
    outs = driver.run(list(prompts.items()))
    outs = [torch.cat([o, n]) for o, n in zip(outs, driver.run([(rid, [9]) for rid in prompts]))]
    for rid, ours in zip(prompts, outs):
        # TF32 and other GPU kernels: looser than the CPU comparison.
        torch.testing.assert_close(ours, hf_logits(hf, driver.tokens[rid]), atol=5e-3, rtol=0)


def test_bool_prefix_mask_path(hf_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """Huge causal-with-prefix masks switch to bool; same numbers."""
    import runtime.attention.torch_native_plan as torch_native_plan

    monkeypatch.setattr(torch_native_plan, "_FLOAT_MASK_LIMIT", 0)
    test_chunked_prefill_then_mixed_decode_matches_hf(hf_checkpoints, "qwen3", 16)
