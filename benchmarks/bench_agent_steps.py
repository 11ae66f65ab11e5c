"""Where an agent run's time goes: the peer comparison's agent workload on an in-process Engine, step by step.

The workload of ``radixserve bench compare`` (8 agents of 5 steps under a shared ~660-token tool-description system
prompt; every step after the first appends the previous answer and a tool result) runs with each agent on its own
client thread, as the comparison's client runs its sessions: a step's request is sent once the previous answer is
in. Each request is the chat history through the tokenizer's chat template, as the server's chat endpoint builds it.

Every scheduler step is recorded (``bench_fewshot_steps.StepLog``), grouped into decode steps, mixed steps (prompt
tokens beside decode rows) and prompt-only steps. Reported per run:

- the decode steps' layers phase by phase (the native decode stack's clock, turned on for steps without prompt
  tokens only): the linears, the rows' own attention and the cascade group's shared part, the small ops;
- inside the mixed steps, the model's linears, attention (the shared part, the chunks' own tokens), the small ops,
  summed over the run and per step (a timer around each call: they cost a little themselves).

    python benchmarks/bench_agent_steps.py [--formats bfloat16 int8+kv8] [--runs 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from bench_cpu_forward import FORMATS, on_own_thread
from bench_fewshot_steps import StepLog
from engine_steps import cpu_simd, emit

from runtime.bench.workloads import make_workload
from runtime.engine import Engine

SMALL_OPS = ("rms_norm", "rotary", "silu_mul", "logits")


class AgentStepLog(StepLog):
    """StepLog with the small ops timed too, and each mixed step's parts kept on their own."""

    def __init__(self, sched: Any):
        super().__init__(sched)
        self.per_step: list[dict[str, Any]] = []
        self._seen: dict[str, float] = {}
        for name in SMALL_OPS:
            self._wrap(sched.runner.model.ops, name, "small op: " + name)

    def _record(self, inner: Any, decodes: int, prefill_tokens: int, seconds: float) -> Any:
        if decodes and prefill_tokens:
            now = dict(self.parts)
            self.per_step.append({"decodes": decodes, "prompt_tokens": prefill_tokens, "ms": round(1e3 * seconds, 1),
                                  "parts_ms": {k: round(1e3 * (v - self._seen.get(k, 0.0)), 1)
                                               for k, v in now.items() if k != "steps"}})
            self._seen = now
        return super()._record(inner, decodes, prefill_tokens, seconds)


def run_sessions(eng: Engine, sessions: list[dict[str, Any]]) -> float:
    """Seconds to run every session, each on its own thread, its steps in order."""
    tokenizer = eng.tokenizer

    def agent(sess: dict[str, Any]) -> None:
        history = list(sess["messages"])
        for step in sess["steps"]:
            history += step["append"]
            prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
            body = step["body"]
            out = eng.generate(prompt=prompt, sampling_params={"max_new_tokens": body["max_tokens"],
                                                               "temperature": body["temperature"]})
            history.append({"role": "assistant", "content": out["text"]})

    t = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(s,)) for s in sessions]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def one_run(eng: Engine, sessions: list[dict[str, Any]]) -> dict[str, Any]:
    eng.flush_cache()
    log = eng.inspect(AgentStepLog)
    stack: Any = eng.inspect(lambda s: s.runner.model.decode_stack)
    if stack is not None:  # the stack's clock on for decode steps only
        take = stack.run

        def run_timed(residual: Any, cos: Any, sin: Any, batch: Any) -> bool:
            stack.time_phases(max(batch.extend_lens_cpu) == 1)
            return take(residual, cos, sin, batch)

        stack.take_phase_times()
        stack.run = run_timed
    try:
        seconds = run_sessions(eng, sessions)
    finally:
        eng.inspect(lambda s: log.close())
        if stack is not None:
            del stack.run
    requests = sum(len(s["steps"]) for s in sessions)
    out: dict[str, Any] = {"seconds": round(seconds, 2), "seq_s": round(requests / seconds, 2),
                           "steps": log.summary(), "mixed_steps": log.per_step}
    if stack is not None:
        phases = stack.take_phase_times()
        runs = phases.pop("runs", 0) or 1
        stack.time_phases(False)
        out["decode_phases_ms"] = {k: round(1e3 * v / runs, 2) for k, v in sorted(phases.items())}
    return out


def measure(fmt: str, runs: int) -> dict[str, Any]:
    sessions = make_workload("agent")["sessions"]
    eng = on_own_thread(lambda: Engine(model="default", log_level="warning", **FORMATS[fmt]))
    try:
        run_sessions(eng, make_workload("agent", overrides={"agents": 2, "steps": 2})["sessions"])  # warm-up
        return {"runs": [one_run(eng, sessions) for _ in range(runs)]}
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["bfloat16"], choices=list(FORMATS))
    ap.add_argument("--runs", type=int, default=2, help="runs of the whole workload per format (default 2)")
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    emit({"cpu": cpu_simd(), "formats": {fmt: measure(fmt, a.runs) for fmt in a.formats}}, a.json)


if __name__ == "__main__":
    main()
