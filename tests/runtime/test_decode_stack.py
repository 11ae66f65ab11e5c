"""The native decode stack (runtime/models/decode_stack.py): every decoder layer of a decode batch in one call
must give exactly the layer-by-layer path's result — same kernels, same order — in every weight format, and the
batches it does not take must still run layer by layer."""

from __future__ import annotations

import random
from typing import Any

import pytest

from runtime.attention import paged_decode
from runtime.config import aten_cpu_capability
from runtime.engine import Engine
from runtime.kernels.build import load_kernels
from runtime.models.decode_stack import DecodeStack
from tests.conftest import checked_engine

pytestmark = pytest.mark.slow

FORMATS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
           "int8-kv": {"kv_cache_dtype": "int8"}, "int8-kv, no pack kept": {"kv_cache_dtype": "int8"},
           "int8+kv8": {"quantization": "int8", "kv_cache_dtype": "int8"}}


class CountedStack:
    """Stands in the model's ``decode_stack`` slot and counts the batches the real stack took."""

    def __init__(self, stack: DecodeStack):
        self.stack = stack
        self.taken = 0
        self.declined = 0
        self.taken_grouped = 0  # batches taken whose rows were in cascade groups
        self.taken_mixed = 0  # batches taken that admitted a prompt beside decode rows

    def run(self, residual: Any, cos: Any, sin: Any, batch: Any) -> bool:
        took = self.stack.run(residual, cos, sin, batch)
        lens = batch.extend_lens_cpu
        self.taken += took
        self.declined += not took
        self.taken_grouped += took and batch.attn_metadata.cascade is not None
        self.taken_mixed += took and 1 in lens and max(lens) > 1
        return took


def generate(eng: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[Any]]]:
    eng.flush_cache()
    outs = eng.generate(input_ids=prompts, return_logprob=True, sampling_params={
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]


@pytest.mark.parametrize("fmt", [
    "float32",
    pytest.param("bfloat16", marks=pytest.mark.skipif(
        aten_cpu_capability() != "AVX512", reason="bfloat16 on the CPU needs torch's AVX-512 kernels")),
    "int8", "int8-kv",
    pytest.param("int8-kv, no pack kept", marks=pytest.mark.skipif(
        not load_kernels("fastcpu").bf16_dot(), reason="prefixes are packed only where the bf16 GEMM kernel is built "
        "(without it this case is the int8-kv one)"))])
def test_stack_gives_the_layer_by_layer_result_bit_for_bit(fmt, monkeypatch):
    if fmt.endswith("no pack kept"):  # no room for packs: each call packs a group's prefix from the int8 pool itself
        monkeypatch.setattr(paged_decode, "PACKED_PREFIX_BYTES", 0)
    rng = random.Random(3)
    shared = [rng.randrange(3, 49000) for _ in range(90)]
    # one alone, then three sharing a prefix and a fourth of another length: batches of 1 and 4 decode rows,
    # and the steps that admit them mix prefill chunks with decode rows (those the stack declines)
    alone = [[rng.randrange(3, 49000) for _ in range(200)]]
    batch = [shared + [rng.randrange(3, 49000) for _ in range(n)] for n in (5, 40, 77)] + [alone[0][:33]]
    # four under a 400-token block: cascade groups (their shared part through the GEMM kernel for a bf16 model)
    block = [rng.randrange(3, 49000) for _ in range(400)]
    grouped = [block + [rng.randrange(3, 49000) for _ in range(n)] for n in (3, 20, 41, 60)]
    with checked_engine("default", max_total_tokens=8192, **FORMATS[fmt]) as eng:
        stack = eng.inspect(lambda s: s.runner.model.decode_stack)
        assert isinstance(stack, DecodeStack)
        counted = CountedStack(stack)
        eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", counted))
        with_stack = [generate(eng, alone), generate(eng, batch), generate(eng, grouped)]
        assert counted.taken >= 2 * 11 - 2, "decode steps ran without the stack"
        assert counted.declined > 0, "no mixed step reached the stack"
        # cascade groups go through the stack where their shared part takes the GEMM kernel (rows reaching it in
        # bf16: a bf16 pool, or an int8 pool under a bf16 model, converted as the kernel packs them)
        gemm_shared = eng.inspect(lambda s: s.runner.model.attn_backend.paged.gemm_shared(s.runner.kv.shape.dtype))
        assert (counted.taken_grouped >= 5) == gemm_shared
        eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", None))
        by_layer = [generate(eng, alone), generate(eng, batch), generate(eng, grouped)]
    # logprobs equal as floats: the logits are the same bits
    assert with_stack == by_layer


def test_stack_is_not_built_where_layers_must_run_one_by_one(tiny_engine):
    # the tiny model's 16-dim heads are below the kernels' 32-wide RoPE step
    eng = tiny_engine()
    assert eng.inspect(lambda s: s.runner.model.decode_stack) is None
    out = eng.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert len(out[0]["output_ids"]) == 3


@pytest.mark.parametrize("fmt", [
    pytest.param("bfloat16", marks=pytest.mark.skipif(
        aten_cpu_capability() != "AVX512", reason="bfloat16 on the CPU needs torch's AVX-512 kernels")),
    pytest.param("int8+kv8", marks=pytest.mark.skipif(
        not load_kernels("fastcpu").bf16_dot(), reason="a mixed step runs in the stack only where the bf16 GEMM "
        "kernel is built (without it the decode steps are the first test's)"))])
def test_a_question_admitted_beside_its_blocks_decode_rows_runs_in_the_stack_bit_for_bit(fmt):
    """A server admits few-shot questions one per step as they arrive, beside the decode rows of those before them,
    all under one cached block: with a prefill budget of 16 tokens each question below gets a step of its own. Where
    the block's shared part takes the GEMM kernel, those mixed steps (a cascade group of decode rows and one chunk)
    run in the stack too, and every token and logprob equals the layer-by-layer path's."""
    rng = random.Random(5)
    block = [rng.randrange(3, 49000) for _ in range(400)]
    questions = [block + [rng.randrange(3, 49000) for _ in range(n)] for n in (9, 12, 14, 16, 11)]

    def answers(eng: Engine) -> list[tuple[list[int], list[Any]]]:
        eng.flush_cache()
        eng.generate(input_ids=[block], sampling_params={"max_new_tokens": 1, "temperature": 0})  # caches the block
        outs = eng.generate(input_ids=questions, return_logprob=True, sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]

    with checked_engine("default", max_total_tokens=8192, max_prefill_tokens=16, **FORMATS[fmt]) as eng:
        stack = eng.inspect(lambda s: s.runner.model.decode_stack)
        assert isinstance(stack, DecodeStack)
        counted = CountedStack(stack)
        eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", counted))
        with_stack = answers(eng)
        gemm_shared = eng.inspect(lambda s: s.runner.model.attn_backend.paged.gemm_shared(s.runner.kv.shape.dtype))
        # the third to fifth questions join a group that saves enough (3 members or more under 400 slots)
        assert (counted.taken_mixed >= 3) == gemm_shared, counted.taken_mixed
        eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", None))
        by_layer = answers(eng)
    assert with_stack == by_layer


def test_phase_clock_times_each_phase_of_the_runs_it_is_on_for_and_changes_nothing():
    """`radixserve bench profile` reads the stack's phase clock: while it is on, each native run adds its wall time
    phase by phase (every phase of a layer a lap of its own) and counts itself; off, the runs leave it at zero; and the
    tokens and logprobs are the same bits either way."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49000) for _ in range(n)] for n in (30, 45)]
    with checked_engine("default", max_total_tokens=4096, quantization="int8") as eng:
        stack = eng.inspect(lambda s: s.runner.model.decode_stack)
        assert isinstance(stack, DecodeStack)
        plain = generate(eng, prompts)
        assert stack.take_phase_times()["runs"] == 0  # off by default
        stack.time_phases(True)
        try:
            timed = generate(eng, prompts)
            times = stack.take_phase_times()
        finally:
            stack.time_phases(False)
        assert timed == plain
        # 11 decode steps of the two rows after their prefill (the stack takes decode batches)
        assert times["runs"] >= 11, times
        phases = {k: v for k, v in times.items() if k != "runs"}
        assert set(phases) == {"norms", "qkv", "rotary", "kv_store", "own_attention", "shared_attention", "o",
                               "gate_up", "silu_mul", "down"}
        assert all(v > 0 for k, v in phases.items() if k != "shared_attention"), phases  # no cascade group here
        assert stack.take_phase_times() == {"runs": 0, **dict.fromkeys(phases, 0.0)}  # taken: zero again
        generate(eng, prompts)
        assert stack.take_phase_times()["runs"] == 0  # off again
