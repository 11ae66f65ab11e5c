"""What the packed weights on huge pages buy a decode step: two runtimes in one process, alternated.

Every decode step streams the packed weights (``radix/hugepages.py`` explains why they live on transparent huge
pages). This builds the runtime twice in one process, once as it is and once with the weights left on 4 KB pages
(the huge-page probe answers "never" while that runner packs them), puts the same few-shot requests into both
schedulers, and times their decode steps in turn, ``--steps`` at a time for ``--rounds`` rounds, the order
flipping every round: on a shared VM the memory's speed moves by tens of percent from one minute to the next,
so only steps timed side by side compare. Each round gives a ratio (huge pages over 4 KB pages); the median ratio
is the figure. Both runtimes keep their cascade groups' packs on huge pages (that is planning-time, not load-time).

It also times the streaming probe on both kinds of pages (``floor.stream_bandwidth``), alternated the same way.

    python benchmarks/bench_huge_pages.py [--batch 1] [--rounds 12] [--steps 16] [--server-args '--quantization int8']
        [--json out.json]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from typing import Any

from engine_steps import cpu_simd, emit

import radix.hugepages
from runtime.bench.floor import stream_bandwidth
from runtime.bench.profile import profile_server_args
from runtime.bench.workloads import make_workload
from runtime.executor.model_runner import ModelRunner
from runtime.models.folders import load_tokenizer
from runtime.models.tokenizer import eos_token_ids, tokenize
from runtime.request.intake import from_native, prepare
from runtime.scheduler.scheduler import Scheduler


def build(flags: list[str], huge: bool) -> tuple[Scheduler, Any]:
    """A scheduler over its own runner, its weights packed on huge pages or (``huge`` False) on 4 KB pages."""
    probe = radix.hugepages.huge_pages_mode
    if not huge:  # weight_arena() asks this probe; "never" leaves the packed weights where torch put them
        radix.hugepages.huge_pages_mode = lambda: "never"
    try:
        args = profile_server_args("default", None, flags)
        runner = ModelRunner(args)
    finally:
        radix.hugepages.huge_pages_mode = probe
    tokenizer = load_tokenizer(args.tokenizer or runner.model_path)
    return Scheduler(args, runner, tokenizer, eos_token_ids(tokenizer, runner.hf_config, runner.model_path)), tokenizer


def start(sched: Scheduler, tokenizer: Any, batch: int, tag: str) -> None:
    """``batch`` few-shot questions under their shared block, decoding (long enough for every round)."""
    sampling = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
    for i, r in enumerate(make_workload("fewshot", overrides={"questions": batch})["requests"]):
        (single,) = from_native({"text": r["body"]["prompt"], "rid": f"{tag}{i}", "sampling_params": sampling},
                                sched.limits.max_n).requests
        prepare(single, lambda text: tokenize(tokenizer, text), sched.limits)
        sched.submit(single.message())
    while sched.waiting or sched.chunked is not None or len(sched.running) < batch:
        sched.step()
    for _ in range(4):  # past the first decode steps (packs kept, buffers sized)
        sched.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1, help="Requests decoding together.")
    ap.add_argument("--rounds", type=int, default=12, help="Rounds of steps per runtime (order flips every round).")
    ap.add_argument("--steps", type=int, default=16, help="Decode steps timed per runtime and round (median).")
    ap.add_argument("--server-args", default="", help="radixserve serve flags for both runtimes (a weight format).")
    ap.add_argument("--json", help="Save the results here.")
    a = ap.parse_args()
    flags = shlex.split(a.server_args)
    runtimes = {name: build(flags, huge) for name, huge in (("4 KB pages", False), ("huge pages", True))}
    for name, (sched, tokenizer) in runtimes.items():
        start(sched, tokenizer, a.batch, name[:2])
    steps: dict[str, list[float]] = {name: [] for name in runtimes}
    probes: dict[str, list[float]] = {"4 KB pages": [], "huge pages": []}
    order = list(runtimes)
    for r in range(a.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            sched = runtimes[name][0]
            times = []
            for _ in range(a.steps):
                t = time.perf_counter()
                sched.step()
                times.append(time.perf_counter() - t)
            steps[name].append(1e3 * statistics.median(times))
        if r % 4 == 0:
            probes["4 KB pages"].append(stream_bandwidth(huge_pages=False) / 1e9)
            probes["huge pages"].append(stream_bandwidth() / 1e9)
    ratios = [h / k for k, h in zip(steps["4 KB pages"], steps["huge pages"])]
    emit({"cpu": cpu_simd(), "batch": a.batch, "server_args": a.server_args, "rounds": a.rounds, "steps": a.steps,
          "decode_step_ms": {n: round(statistics.median(v), 3) for n, v in steps.items()},
          "decode_step_ms_per_round": {n: [round(x, 3) for x in v] for n, v in steps.items()},
          "huge_over_4k_median_ratio": round(statistics.median(ratios), 3),
          "probe_gb_s": {n: [round(x, 1) for x in v] for n, v in probes.items()}}, a.json)


if __name__ == "__main__":
    main()
