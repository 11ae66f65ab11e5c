"""Where a scheduler step's time goes, measured in-process on a representative few-shot batch.

The step is the normal loop's, driven through the Scheduler's public steps with a timer between them:

- scheduling + batch building: ``schedule_next()`` (decode room, KV slots for running requests, admission
  with prefix match, then ``build_step``, whose share ``ForwardInput.build_seconds`` reports);
- attention planning: the attention backend's ``plan`` for the batch (cascade groups, slot tables: Python work
  outside the kernels);
- decoder layers: the rest of the model's forward in ``launch()``;
- output projection: ``compute_logits`` of the sampled rows;
- sampling: ``Sampler.sample`` (its ``prepare`` runs while scheduling and counts there);
- result processing: ``process()`` (stop checks, cache inserts, outputs).

Planning, output projection and sampling are timed by wrapping those methods while ``launch`` runs; the decoder
layers are ``launch`` less the three.

Scenarios, as the few-shot workload produces them at concurrency 8: a cold prefill chunk (the shared
~1,000-token block, first request), a mixed step (7 questions admitted with their prefix cached + 1 decode)
and plain decode steps of 8 requests at ~1,050 tokens of context. Each step's time is set next to the
weight-streaming floor of the model's format (``floor.py``: its weights' bytes over the streaming bandwidth,
probed before and after the scenarios). IPC is a ZMQ PUSH/PULL round trip
(ipc://, pickle protocol 5, as ``runtime.server.ipc``) of a BatchTokenOut with 64 outputs: the message a step
sends to the detokenizer at batch 64.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

PARTS = ("scheduling", "batch_build", "planning", "forward", "logits", "sampling", "process")
PART_NAMES = {"scheduling": "scheduling / admission", "batch_build": "batch building",
              "planning": "attention planning", "forward": "decoder layers", "logits": "output projection",
              "sampling": "sampling", "process": "result processing"}
# The native decode stack's phases (fastcpu_decoder.cpp's PhaseClock), grouped as the decode row reports them: the
# matrix products against the attention and the small ops between them.
PHASE_GROUPS = {"linears": ("qkv", "o", "gate_up", "down"), "attention": ("own_attention", "shared_attention"),
                "small ops": ("norms", "rotary", "kv_store", "silu_mul")}
# The decoder layers' time outside that call (the embedding, the RoPE tables, the final norm, the call's arguments):
# the decode row's "decoder layers" less the phases, per step.
AROUND = "around_call"
# The parts of a step outside the layers and the output projection: the scheduler's work on either side of them
# (Python, but for sampling's argmax kernel).
SCHEDULER_PARTS = ("scheduling", "batch_build", "planning", "sampling", "process")


def timed_step(sched: Any) -> dict[str, float] | None:
    """One normal-loop step with each part timed (seconds); None when there was nothing to run."""
    spent = {"sampling": 0.0, "planning": 0.0, "logits": 0.0}

    def timing(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapped

    t0 = time.perf_counter()
    sched.pop_outputs()
    inp = sched.schedule_next()
    if inp is None:
        return None
    t1 = time.perf_counter()
    model = sched.runner.model
    # instance attributes shadow the methods while the step runs
    timed = [(sched.sampler, "sample", "sampling"), (model.attn_backend, "plan", "planning"),
             (model, "compute_logits", "logits")]
    for obj, method, part in timed:
        setattr(obj, method, timing(part, getattr(obj, method)))
    try:
        out = sched.launch(inp)
    finally:
        for obj, method, _ in timed:
            delattr(obj, method)
    t2 = time.perf_counter()
    sched.process(out)
    t3 = time.perf_counter()
    sched.stats.record_step(inp.num_decodes, inp.prefill_tokens, t3 - t0)
    return {"scheduling": t1 - t0 - inp.build_seconds, "batch_build": inp.build_seconds,
            "planning": spent["planning"], "forward": t2 - t1 - sum(spent.values()), "logits": spent["logits"],
            "sampling": spent["sampling"], "process": t3 - t2,
            "total": t3 - t0, "decodes": float(inp.num_decodes), "prefill_tokens": float(inp.prefill_tokens)}


def ipc_round_trip(outputs: int = 64, iters: int = 300) -> dict[str, float]:
    """Median seconds of encode -> send -> receive -> decode, there and back, of a BatchTokenOut."""
    import zmq

    from runtime.core.messages import BatchTokenOut, ReqOutput
    from runtime.server.ipc import decode, encode, pull, push

    msg = BatchTokenOut([ReqOutput(f"req-{i}", [1234], None, 1050, 5, 1020) for i in range(outputs)])
    ctx = zmq.Context()
    folder = tempfile.mkdtemp(prefix="radixserve-bench-ipc-")
    a_in, b_in = pull(ctx, f"ipc://{folder}/a"), pull(ctx, f"ipc://{folder}/b")
    to_a, to_b = push(ctx, f"ipc://{folder}/a"), push(ctx, f"ipc://{folder}/b")
    times, codec = [], []
    try:
        for _ in range(iters):
            t = time.perf_counter()
            to_b.send(encode(msg), copy=False)
            got = decode(b_in.recv())
            to_a.send(encode(got), copy=False)
            decode(a_in.recv())
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            decode(encode(msg))
            codec.append(time.perf_counter() - t)
    finally:
        ctx.destroy(linger=0)
    return {"outputs": float(outputs), "round_trip_s": statistics.median(times),
            "pickle_only_s": statistics.median(codec), "bytes": float(len(encode(msg)))}


def profile_server_args(model: str, threads: int | None, server_flags: list[str]) -> Any:
    """The ServerArgs a profile runs with: ``radixserve serve``'s flags (``server_flags``, e.g. ``--quantization
    int8``, as `bench compare --server-args` passes them to its servers) over the model and thread count."""
    import argparse

    from runtime.config import add_server_args, server_args_from_namespace

    parser = argparse.ArgumentParser(prog="radixserve bench profile --server-args", add_help=False)
    add_server_args(parser)
    ns = parser.parse_args(["--model", model, *server_flags])
    if threads:
        ns.num_threads = threads
    ns.log_level = "warning"
    return server_args_from_namespace(ns).resolve()


def run_profile(model: str = "default", threads: int | None = None, batch: int = 8, decode_steps: int = 16,
                repeats: int = 3, server_flags: list[str] | None = None) -> dict[str, Any]:
    """Time the scenarios (medians over ``repeats``; decode over ``repeats * decode_steps`` steps)."""
    from runtime.bench.floor import stream_bandwidth, weight_bytes, weight_floor
    from runtime.bench.workloads import make_workload
    from runtime.executor.model_runner import ModelRunner
    from runtime.models.folders import load_tokenizer
    from runtime.models.tokenizer import eos_token_ids, tokenize
    from runtime.request.intake import SingleRequest, from_native, prepare
    from runtime.scheduler.scheduler import Scheduler

    args = profile_server_args(model, threads, server_flags or [])
    runner = ModelRunner(args)
    bandwidths = [stream_bandwidth()]
    tokenizer = load_tokenizer(args.tokenizer or runner.model_path)
    sched = Scheduler(args, runner, tokenizer, eos_token_ids(tokenizer, runner.hf_config, runner.model_path))
    wl = make_workload("fewshot", overrides={"questions": batch * repeats})
    sampling = {"max_new_tokens": decode_steps + 8, "temperature": 0.0, "ignore_eos": True}
    # through the intake, as every API's requests: the scheduler only asserts what it checks
    singles: list[SingleRequest] = []
    for i, r in enumerate(wl["requests"]):
        (single,) = from_native({"text": r["body"]["prompt"], "rid": f"p{i}", "sampling_params": sampling},
                                sched.limits.max_n).requests
        prepare(single, lambda text: tokenize(tokenizer, text), sched.limits)
        singles.append(single)

    def submit(i: int) -> None:
        sched.submit(singles[i].message())

    scenarios: dict[str, list[dict[str, float]]] = {"cold prefill": [], "mixed": [], "decode": []}
    # the decode steps' layers phase by phase, where the model runs them in one native call
    stack = runner.model.decode_stack
    phase_steps: list[dict[str, float]] = []
    timed_step(sched)  # nothing queued: a no-op that imports what the first real step would
    for rep in range(repeats):
        base = rep * batch
        submit(base)
        first = timed_step(sched)
        assert first is not None
        scenarios["cold prefill"].append(first)
        while sched.chunked is not None:  # the rest of the first prompt, if it was chunked
            timed_step(sched)
        for i in range(1, batch):
            submit(base + i)
        mixed = timed_step(sched)
        assert mixed is not None
        scenarios["mixed"].append(mixed)
        while sched.waiting or sched.chunked is not None:
            timed_step(sched)
        if stack is not None:
            stack.time_phases(True)
        for _ in range(decode_steps):
            step = timed_step(sched)
            phases = stack.take_phase_times() if stack is not None else {}
            if step is not None and step["prefill_tokens"] == 0:
                scenarios["decode"].append(step)
                if phases.get("runs") == 1:  # the step ran its layers in one native call
                    inside = sum(v for k, v in phases.items() if k != "runs")
                    phase_steps.append({**phases, AROUND: step["forward"] - inside})
        if stack is not None:
            stack.time_phases(False)
        for req in list(sched.running):
            sched.abort(req.rid)
        sched.step()  # hand the aborted requests' outputs back
        sched.flush_cache()  # the next repeat starts cold again
    bandwidths.append(stream_bandwidth())
    # every request was aborted and the cache flushed: the KV books must balance with nothing held
    integrity = sched.check_integrity()
    result: dict[str, Any] = {"model": str(runner.model_path.name), "threads": threads, "batch": batch,
                              "server_flags": server_flags or [], "context_tokens": len(singles[0].input_ids or []),
                              "floor": weight_floor(weight_bytes(runner.model), bandwidths), "kv_integrity": integrity,
                              "scenarios": {}}
    for name, steps in scenarios.items():
        if not steps:
            continue
        med = {k: statistics.median(s[k] for s in steps) for k in (*PARTS, "total", "decodes", "prefill_tokens")}
        result["scenarios"][name] = {"steps": len(steps), **med}
    if phase_steps:
        result["decode_phases"] = {"steps": float(len(phase_steps)), **{
            k: statistics.median(s[k] for s in phase_steps) for k in phase_steps[0] if k != "runs"}}
    result["ipc"] = ipc_round_trip()
    return result


def phase_line(p: dict[str, Any]) -> str | None:
    """The decode steps' decoder layers phase by phase (median ms), grouped, with each group's share of the decode
    step; None where the model ran its layers one by one."""
    ph = p.get("decode_phases")
    if not ph:
        return None
    step_ms = 1e3 * p["scenarios"]["decode"]["total"] if "decode" in p["scenarios"] else 0.0
    parts = []
    for group, names in PHASE_GROUPS.items():
        ms = 1e3 * sum(ph[n] for n in names)
        share = f", {100 * ms / step_ms:.0f}% of the step" if step_ms else ""
        parts.append(f"{group} {ms:.2f}{share} (" + ", ".join(f"{n} {1e3 * ph[n]:.2f}" for n in names) + ")")
    if AROUND in ph:
        parts.append(f"around their native call {1e3 * ph[AROUND]:.2f} (embedding, RoPE tables, final norm, the call)")
    return f"decoder layers of a decode step by phase (median ms of {int(ph['steps'])} steps): " + "; ".join(parts)


def overhead_line(p: dict[str, Any]) -> str | None:
    """What a decode step spends outside its matrix products and attention (median ms, share of the step): the
    scheduler's parts, the work around the layers' native call and the small ops between the kernels; None where
    the model ran its layers one by one (no phases)."""
    ph, sc = p.get("decode_phases"), p["scenarios"].get("decode")
    if not ph or AROUND not in ph or not sc or not sc["total"]:
        return None
    scheduler = 1e3 * sum(sc[k] for k in SCHEDULER_PARTS)
    around, small = 1e3 * ph[AROUND], 1e3 * sum(ph[n] for n in PHASE_GROUPS["small ops"])
    total = scheduler + around + small
    return (f"a decode step outside its matrix products and attention: {total:.2f} ms, "
            f"{100 * total / (1e3 * sc['total']):.0f}% of the step (the scheduler's parts, scheduling to results, "
            f"{scheduler:.2f}; around the layers' native call {around:.2f}; small ops {small:.2f})")


def format_profile(p: dict[str, Any]) -> str:
    """A plain-text table (the report renders its own markdown one)."""
    names = list(p["scenarios"])
    lines = [f"step profile: {p['model']}, batch {p['batch']}, context ~{p['context_tokens']} tokens (median ms)",
             f"{'part':26s}" + "".join(f"{n:>16s}" for n in names)]
    for part in (*PARTS, "total"):
        row = f"{PART_NAMES.get(part, part):26s}"
        for n in names:
            sc = p["scenarios"][n]
            share = f" ({100 * sc[part] / sc['total']:.0f}%)" if part != "total" and sc["total"] else ""
            row += f"{1e3 * sc[part]:>10.2f}{share:>6s}"
        lines.append(row)
    lines.append(f"{'decodes / new prompt tokens':26s}" + "".join(
        f"{int(p['scenarios'][n]['decodes']):>8d} / {int(p['scenarios'][n]['prefill_tokens']):<5d}" for n in names))
    if "floor" in p:
        lines.append(f"{'x weight-streaming floor':26s}" + "".join(f"{floor_ratio(p, n):>15.2f}x" for n in names))
        lines.append(floor_line(p))
    for line in (phase_line(p), overhead_line(p)):
        if line:
            lines.append(line)
    ipc = p["ipc"]
    lines.append(f"IPC: BatchTokenOut of {int(ipc['outputs'])} outputs ({int(ipc['bytes'])} bytes): ZMQ round trip "
                 f"{1e6 * ipc['round_trip_s']:.0f} µs, pickle encode+decode alone {1e6 * ipc['pickle_only_s']:.0f} µs")
    return "\n".join(lines)


def floor_ratio(p: dict[str, Any], scenario: str) -> float:
    """A scenario's median step time over the profile's weight-streaming floor."""
    return 1e3 * p["scenarios"][scenario]["total"] / p["floor"]["floor_ms"]


def floor_line(p: dict[str, Any]) -> str:
    """What the floor row of a profile divides by."""
    f = p["floor"]
    flags = " ".join(p.get("server_flags") or []) or "the default format"
    return (f"floor: {f['weight_mb']:.0f} MB of weights ({flags}) read once per step at {f['bandwidth_gb_s']:.1f} GB/s "
            f"(fastest of the probes {', '.join(map(str, f['probes_gb_s']))} GB/s) = {f['floor_ms']:.2f} ms")
