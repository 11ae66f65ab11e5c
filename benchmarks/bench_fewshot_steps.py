"""Where a few-shot run's time goes: the peer comparison's few-shot workload on an in-process Engine, step by step.

The workload of ``radixserve bench compare`` (a ~1,050-token block of 30 examples, then 64 questions of ~25 tokens,
16 greedy tokens each) is sent by 8 client threads at a time, as the comparison's client keeps 8 requests in flight,
twice per weight format:

- cold: from an empty cache, as the comparison runs it (its first step prefills the shared block);
- warm: the first question alone first (it caches the block), then the other 63, timed.

For the warm run every scheduler step is recorded (rows decoding, new prompt tokens, seconds) and grouped into
decode steps by batch size, mixed steps (prompt tokens with or without decode rows) and the rest. Inside the mixed
steps the model's linear layers, its attention, and within attention a cascade group's shared part and the
prefill chunks' own parts are timed (the timers cost a little themselves).

In-process, the 8 clients' next questions arrive together and a wave's questions share one step. Behind a server
they arrive one by one (each through HTTP and the tokenizer), and the log shows a step per question, beside the
decode rows of the others. ``--max-prefill-tokens 40`` gives that pattern in-process: about one question per step.
``--mixed-ab ROUNDS`` then also runs the warm part ROUNDS times each way, alternated, with the native decode stack
taking those mixed steps (a cascade group of decode rows and a short chunk) and with them set aside to run layer by
layer, and reports throughput and the mixed and batch-8 decode step medians of each.
``--lone-ab ROUNDS`` times the step of a question that arrives alone after a wave of 8 has decoded under the block
(a server's waves often start so): per round a wave, then 3 questions one at a time with the wave's packed block
kept, which each reads as a cascade group of one, then 3 with the packs dropped before each, so that it runs as a
plain prefill chunk that packs its whole KV in every layer (as every lone question did before groups of one).

    python benchmarks/bench_fewshot_steps.py [--formats bfloat16 int8] [--max-prefill-tokens N] [--mixed-ab ROUNDS]
        [--lone-ab ROUNDS] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from bench_cpu_forward import FORMATS, on_own_thread
from engine_steps import cpu_simd, emit

from runtime.bench.workloads import make_workload
from runtime.engine import Engine

CONCURRENCY = 8
QUESTIONS = len(make_workload("fewshot")["requests"])
LONE_EACH = 3  # --lone-ab: questions timed each way per round


def run_all(eng: Engine, requests: list[dict[str, Any]]) -> float:
    """Seconds to answer ``requests`` with CONCURRENCY of them in flight."""
    queue = list(requests)
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                body = queue.pop(0)["body"]
            eng.generate(prompt=body["prompt"],
                         sampling_params={"max_new_tokens": body["max_tokens"], "temperature": body["temperature"]})

    t = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(CONCURRENCY)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


class StepLog:
    """Records every scheduler step, and times the model's parts inside mixed steps (prompt tokens beside decode
    rows), by wrapping the scheduler's step record and the model's calls."""

    def __init__(self, sched: Any):
        self.steps: list[tuple[int, int, float]] = []
        self.parts: dict[str, float] = defaultdict(float)
        self.mixed = False
        model = sched.runner.model
        self.undo: list[Callable[[], None]] = []
        self._wrap(sched.stats, "record_step", None, self._record)
        self._wrap(model, "forward", None, self._forward)
        for name in ("linear", "add_linear_"):
            self._wrap(model.ops, name, "linear")
        self._wrap(model.attn_backend, "forward", "attention")
        paged = model.attn_backend.paged
        if paged is not None:
            self._wrap(paged, "shared", "attention: shared prefix (cascade group)")
            self._wrap(paged, "extend", "attention: prefill chunks' own tokens")

    def _record(self, inner: Callable[..., Any], decodes: int, prefill_tokens: int, seconds: float) -> Any:
        self.steps.append((decodes, prefill_tokens, seconds))
        return inner(decodes, prefill_tokens, seconds)

    def _forward(self, inner: Callable[..., Any], batch: Any) -> Any:
        lens = batch.extend_lens_cpu
        self.mixed = 1 in lens and max(lens) > 1  # decode rows beside prompt tokens
        try:
            return inner(batch)
        finally:
            if self.mixed:
                self.parts["steps"] += 1
            self.mixed = False

    def _wrap(self, obj: Any, name: str, bucket: str | None,
              around: Callable[..., Any] | None = None) -> None:
        inner = getattr(obj, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return around(inner, *a, **kw) if around is not None else inner(*a, **kw)
            finally:
                if bucket is not None and self.mixed:
                    self.parts[bucket] += time.perf_counter() - t

        setattr(obj, name, wrapped)
        self.undo.append(lambda: delattr(obj, name))

    def close(self) -> None:
        for u in self.undo:
            u()

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for decodes, tokens, seconds in self.steps:
            kind = f"decode b{decodes}" if tokens == 0 else "mixed" if decodes else "prompt only"
            kinds[kind].append((tokens, seconds))
        out: dict[str, Any] = {kind: {"steps": len(v), "seconds": round(sum(s for _, s in v), 3),
                                      "median_ms": round(1e3 * statistics.median(s for _, s in v), 2),
                                      "median_prompt_tokens": statistics.median(t for t, _ in v)}
                               for kind, v in sorted(kinds.items(), key=lambda kv: -sum(s for _, s in kv[1]))}
        mixed = self.parts.get("steps", 0)
        out["mixed_step_parts_ms"] = {k: round(1e3 * v / mixed, 2) for k, v in self.parts.items()
                                      if k != "steps"} if mixed else {}
        return out


class DecodeRowsOnly:
    """Stands in the model's ``decode_stack`` slot and hands it only steps without prompt tokens: the mixed steps
    run layer by layer, as before the stack took them."""

    def __init__(self, stack: Any):
        self.stack = stack

    def run(self, residual: Any, cos: Any, sin: Any, batch: Any) -> bool:
        return max(batch.extend_lens_cpu) == 1 and self.stack.run(residual, cos, sin, batch)


def warm_run(eng: Engine, requests: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    """(seconds, step summary) of the questions after the first, over the block the first one caches."""
    eng.flush_cache()
    run_all(eng, requests[:1])
    log = eng.inspect(StepLog)
    seconds = run_all(eng, requests[1:])
    eng.inspect(lambda s: log.close())
    return seconds, log.summary()


def mixed_ab(eng: Engine, requests: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    stack = eng.inspect(lambda s: s.runner.model.decode_stack)
    if stack is None:
        return {"decode_stack": False}
    runs: dict[str, list[tuple[float, dict[str, Any]]]] = {"stack": [], "layers": []}
    for _ in range(rounds):
        for name, obj in (("stack", stack), ("layers", DecodeRowsOnly(stack))):
            eng.inspect(lambda s, obj=obj: setattr(s.runner.model, "decode_stack", obj))
            runs[name].append(warm_run(eng, requests))
    eng.inspect(lambda s: setattr(s.runner.model, "decode_stack", stack))
    out: dict[str, Any] = {}
    for name, results in runs.items():
        mixed = [summ["mixed"]["median_ms"] for _, summ in results if "mixed" in summ]
        b8 = [summ["decode b8"]["median_ms"] for _, summ in results if "decode b8" in summ]
        out[f"mixed_steps_{name}"] = {
            "seq_s": [round((len(requests) - 1) / sec, 2) for sec, _ in results],
            "mixed_step_ms": mixed, "decode_b8_ms": b8,
            # the host's speed moves between runs: each run's mixed step against its own decode step
            "mixed_over_decode": [round(m / d, 2) for m, d in zip(mixed, b8)]}
    return out


def lone_ab(eng: Engine, requests: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Step times of questions alone after a decoded wave: LONE_EACH with the wave's packs kept (each reads them as a
    group of one, which keeps them for the next), then LONE_EACH with every pack dropped before each, per round."""
    backend: Any = eng.inspect(lambda s: s.runner.attn_backend)
    if backend.paged is None:
        return {"lone_question": "no in-place kernels"}
    eng.flush_cache()
    run_all(eng, requests[:1])
    times: dict[str, list[float]] = {"kept": [], "dropped": []}
    left = iter(requests[1:])  # each question once: a repeated one would find itself cached
    for _ in range(rounds):
        run_all(eng, [next(left) for _ in range(CONCURRENCY)])
        for mode, ms in times.items():
            for _ in range(LONE_EACH):
                if mode == "dropped":
                    eng.inspect(lambda s: backend.paged.keep_packed(()))
                body = next(left)["body"]
                log = eng.inspect(StepLog)
                eng.generate(prompt=body["prompt"], sampling_params={"max_new_tokens": 1, "temperature": 0})
                eng.inspect(lambda s, log=log: log.close())
                ms.append(round(1e3 * log.steps[0][2], 2))
    return {f"lone_question_{mode}": {"step_ms": ms, "median_ms": round(statistics.median(ms), 2)}
            for mode, ms in times.items()}


def measure(fmt: str, max_prefill_tokens: int | None, ab_rounds: int, lone_rounds: int) -> dict[str, Any]:
    requests = make_workload("fewshot")["requests"]
    options: dict[str, Any] = dict(FORMATS[fmt])
    if max_prefill_tokens is not None:
        options["max_prefill_tokens"] = max_prefill_tokens
    eng = on_own_thread(lambda: Engine(model="default", log_level="warning", **options))
    try:
        run_all(eng, requests[:1])  # compiles and warms what the first steps touch; its cache is flushed below
        eng.flush_cache()
        cold = run_all(eng, requests)
        warm, steps = warm_run(eng, requests)
        out = {"cold_seq_s": round(len(requests) / cold, 2), "warm_seq_s": round((len(requests) - 1) / warm, 2),
               "warm_steps": steps}
        if ab_rounds:
            out.update(mixed_ab(eng, requests, ab_rounds))
        if lone_rounds:
            out.update(lone_ab(eng, requests, lone_rounds))
    finally:
        eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["bfloat16", "int8"], choices=list(FORMATS))
    ap.add_argument("--max-prefill-tokens", type=int, help="the Engine's prefill budget per step (40: about one "
                    "question per step, as a server's staggered arrivals admit them)")
    ap.add_argument("--mixed-ab", type=int, default=0, metavar="ROUNDS",
                    help="also run the warm part ROUNDS times with mixed steps in the decode stack and by layer")
    ap.add_argument("--lone-ab", type=int, default=0, metavar="ROUNDS",
                    help="also time a question arriving alone after a decoded wave, ROUNDS times with the wave's "
                    "packed block kept and dropped")
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    per_round = CONCURRENCY + 2 * LONE_EACH
    if a.lone_ab * per_round > QUESTIONS - 1:
        ap.error(f"--lone-ab: at most {(QUESTIONS - 1) // per_round} rounds (each asks {per_round} new questions)")
    emit({"cpu": cpu_simd(), "concurrency": CONCURRENCY, "max_prefill_tokens": a.max_prefill_tokens,
          "formats": {fmt: measure(fmt, a.max_prefill_tokens, a.mixed_ab, a.lone_ab) for fmt in a.formats}}, a.json)


if __name__ == "__main__":
    main()
