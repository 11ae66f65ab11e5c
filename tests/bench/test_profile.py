"""`radixserve bench profile`: every step is set next to the weight-streaming floor of the format it ran, measured
in the same run at the fastest of its bandwidth probes, and the report renders the same figures."""

from __future__ import annotations

from pathlib import Path

import pytest

import runtime.bench.floor as floor
from runtime.bench.profile import PARTS, floor_ratio, format_profile, profile_server_args, run_profile
from runtime.bench.report import render_section


def test_profile_takes_serve_flags() -> None:
    args = profile_server_args("default", 1, ["--quantization", "int8", "--max-total-tokens", "4096"])
    assert (args.quantization, args.max_total_tokens, args.num_threads) == ("int8", 4096, 1)
    with pytest.raises(SystemExit):  # argparse's own error for a flag serve does not have
        profile_server_args("default", None, ["--no-such-flag"])


def test_each_step_is_set_against_the_floor_of_the_fastest_probe(tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([2e9, 8e9])  # a slow probe, then a fast one: the floor must use the fast one
    monkeypatch.setattr(floor, "stream_bandwidth", lambda: next(readings))
    weights: list[int] = []
    real_weight_bytes = floor.weight_bytes
    monkeypatch.setattr(floor, "weight_bytes", lambda model: weights.append(real_weight_bytes(model)) or weights[-1])
    p = run_profile(str(tiny_model_dir), threads=1, batch=2, decode_steps=2, repeats=1,
                    server_flags=["--dtype", "float32"])
    f = p["floor"]
    assert f["probes_gb_s"] == [2.0, 8.0] and f["bandwidth_gb_s"] == 8.0
    assert weights and f["floor_ms"] == pytest.approx(1e3 * weights[-1] / 8e9)
    assert p["server_flags"] == ["--dtype", "float32"]
    # the KV accounting invariant held after the scenarios (check_integrity raises otherwise), nothing held
    assert p["kv_integrity"]["private"] == 0 and p["kv_integrity"]["protected"] == 0, p["kv_integrity"]
    text = format_profile(p)
    for name, sc in p["scenarios"].items():
        # the parts partition the step: the layers are launch() less planning, projection and sampling (one repeat
        # and two decode steps: each part's median is then a mean, so the medians add up like the steps)
        assert sum(sc[part] for part in PARTS) == pytest.approx(sc["total"], rel=1e-6), (name, sc)
        assert sc["planning"] > 0 and sc["forward"] > 0, (name, sc)
        # a chunk of a longer prompt samples nothing, so only steps with a decode row project logits for sure
        assert sc["logits"] > 0 or sc["decodes"] == 0, (name, sc)
        ratio = floor_ratio(p, name)
        assert ratio == pytest.approx(1e3 * sc["total"] / f["floor_ms"]) and ratio > 0
        assert f"{ratio:.2f}x" in text
    assert "at 8.0 GB/s (fastest of the probes 2.0, 8.0 GB/s)" in text
    section = render_section({"results": [], "profile": p}, [])
    assert "| x weight-streaming floor |" in section and "--dtype float32" in section


def test_the_decode_phases_are_grouped_and_set_against_the_decode_step() -> None:
    from runtime.bench.profile import phase_line

    ms = {"qkv": 1.0, "o": 0.5, "gate_up": 2.0, "down": 1.5, "own_attention": 0.75, "shared_attention": 1.25,
          "norms": 0.25, "rotary": 0.125, "kv_store": 0.125, "silu_mul": 0.5}
    phases = {"steps": 16.0, **{k: v / 1e3 for k, v in ms.items()}}
    p = {"scenarios": {"decode": {"total": 0.010}}, "decode_phases": phases}
    line = phase_line(p)
    assert line is not None and "(median ms of 16 steps)" in line
    assert "linears 5.00, 50% of the step (qkv 1.00, o 0.50, gate_up 2.00, down 1.50)" in line
    assert "attention 2.00, 20% of the step (own_attention 0.75, shared_attention 1.25)" in line
    assert "small ops 1.00, 10% of the step (norms 0.25, rotary 0.12, kv_store 0.12, silu_mul 0.50)" in line
    assert phase_line({"scenarios": {}}) is None  # layers run one by one: no phases


def test_a_decode_steps_overhead_sums_the_scheduler_the_call_and_the_small_ops() -> None:
    """Outside the matrix products and attention: the scheduler's parts of the decode row, the layers' time around
    their native call, and the small ops between the kernels, against the whole step."""
    from runtime.bench.profile import AROUND, overhead_line, phase_line

    ms = {"qkv": 1.0, "o": 0.5, "gate_up": 2.0, "down": 1.5, "own_attention": 0.75, "shared_attention": 1.25,
          "norms": 0.25, "rotary": 0.125, "kv_store": 0.125, "silu_mul": 0.5, AROUND: 0.5}
    decode = {"total": 0.010, "scheduling": 0.0002, "batch_build": 0.0003, "planning": 0.0004, "sampling": 0.0005,
              "process": 0.0001, "forward": 0.0075, "logits": 0.001}
    p = {"scenarios": {"decode": decode}, "decode_phases": {"steps": 16.0, **{k: v / 1e3 for k, v in ms.items()}}}
    line = overhead_line(p)
    assert line == ("a decode step outside its matrix products and attention: 3.00 ms, 30% of the step (the "
                    "scheduler's parts, scheduling to results, 1.50; around the layers' native call 0.50; "
                    "small ops 1.00)")
    assert "around their native call 0.50" in (phase_line(p) or "")
    del p["decode_phases"][AROUND]  # a profile saved before the split: no line rather than a wrong sum
    assert overhead_line(p) is None
