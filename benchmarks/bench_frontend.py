"""Frontend (DSL) benchmark: a few-shot ``run_batch`` program and a fork-heavy tree-of-thought program
against a running server, reporting wall time and cache hit rates.

It starts no server. Run one server with the radix cache and one without, then compare:

    radixserve serve --port 30000 &
    radixserve serve --port 30001 --disable-radix-cache &
    python benchmarks/bench_frontend.py --url http://127.0.0.1:30000 --baseline-url http://127.0.0.1:30001

Hit rates, per workload:
- server: the server's own counters over the workload (cache hits / prompt tokens admitted);
- requests: sum of ``cached_tokens`` / sum of ``prompt_tokens`` over the workload's requests;
- optimum: the same ratio if every token sequence were computed exactly once -- each request (in the
  order sent) replayed against a token trie of every earlier prompt and its output (needs the model's
  tokenizer, read through transformers from the server's ``tokenizer_path``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import frontend as sgl

ROOT = Path(__file__).resolve().parent.parent


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fewshot_qa = _example("fewshot_qa")
tot = _example("tree_of_thought")


class RecordingEndpoint(sgl.RuntimeEndpoint):
    """A RuntimeEndpoint that keeps every request's prompt, output ids and meta_info, in the order sent."""

    def __init__(self, url: str):
        super().__init__(url)
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def _call(self, payload: dict[str, Any]) -> Any:
        prompts = payload.get("text", payload.get("input_ids"))
        many = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
        items = [{"prompt": p} for p in (prompts if many else [prompts])]
        with self._lock:
            self.records.extend(items)
        out = super()._call(payload)
        for item, res in zip(items, out if isinstance(out, list) else [out]):
            item["output_ids"], item["meta"] = res["output_ids"], res["meta_info"]
        return out


def optimum_hit_rate(records: list[dict[str, Any]], tokenizer: Any) -> float:
    trie: dict[int, Any] = {}
    hit = total = 0
    for rec in records:
        prompt = rec["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else list(tokenizer(prompt).input_ids)
        node, matched = trie, 0
        for t in ids:
            if t not in node:
                break
            node, matched = node[t], matched + 1
        hit, total = hit + matched, total + len(ids)
        node = trie
        for t in ids + list(rec.get("output_ids") or []):
            node = node.setdefault(t, {})
    return hit / total if total else 0.0


# ---------------------------------------------------------------------------- workloads
def fewshot_block(shots: int) -> str:
    lines = ["Answer each question with a single word or number.\n"]
    lines += [f"Question: {q['question']}\nAnswer: {q['answer']}\n" for q in fewshot_qa.make_questions(shots, 1)]
    return "\n".join(lines) + "\n"


@sgl.function
def fewshot_program(s, block, question):
    s += block + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=12, stop="\n")


PUZZLES = [
    "A farmer has 17 sheep. All but 9 run away. How many are left?",
    "If three cats catch three mice in three minutes, how long do 100 cats need for 100 mice?",
    "What is heavier, a kilogram of feathers or a kilogram of iron?",
    "A bat and a ball cost 1.10 in total. The bat costs 1.00 more than the ball. What does the ball cost?",
    "How many months have 28 days?",
    "If you pass the person in second place in a race, what place are you in?",
    "A clock shows 3:15. What is the angle between the hands?",
    "How many times can you subtract 5 from 25?",
]


def run_fewshot(backend: sgl.RuntimeEndpoint, n: int, shots: int, threads: int) -> dict[str, Any]:
    block = fewshot_block(shots)
    questions = fewshot_qa.make_questions(n, seed=0)
    states = fewshot_program.run_batch([{"block": block, "question": q["question"]} for q in questions],
                                       backend=backend, temperature=0, num_threads=threads)
    correct = sum(s["answer"].strip().lower().startswith(q["answer"].lower()) for s, q in zip(states, questions))
    return {"accuracy": correct / n}


# Worked examples in front of each puzzle, as tree-of-thought prompts usually carry: the context every
# branch (and every program) shares.
WORKED = "Here are some puzzles solved step by step.\n\n" + "".join(
    f"Puzzle: {q}\nReasoning: {r}\nAnswer: {a}\n\n" for q, r, a in [
        ("Tom has 5 apples and gives away 2. How many are left?",
         "He starts with 5. Giving away 2 leaves 5 - 2 = 3.", "3"),
        ("A train leaves at 9:00 and arrives at 11:30. How long is the trip?",
         "From 9:00 to 11:00 is 2 hours, plus 30 minutes to 11:30.", "2 hours 30 minutes"),
        ("Which is larger, 0.5 or 0.45?", "0.5 is 0.50, and 0.50 is more than 0.45.", "0.5"),
        ("If a shirt costs 20 and is 25% off, what is the price?",
         "25% of 20 is 5, so the price is 20 - 5 = 15.", "15"),
        ("How many legs do 3 dogs and 2 birds have?", "Dogs have 4 legs: 12. Birds have 2 legs: 4. 12 + 4 = 16.",
         "16"),
        ("A rope of 12 metres is cut into 4 equal parts. How long is each part?", "12 / 4 = 3 metres.", "3 metres"),
        ("Anna is 3 years older than Ben, who is 7. How old is Anna?", "Ben is 7, so Anna is 7 + 3 = 10.", "10"),
        ("What is the next number: 2, 4, 8, 16?", "Each number doubles, so 16 * 2 = 32.", "32"),
    ]) + "Now the new puzzle.\n"


def run_tot(backend: sgl.RuntimeEndpoint, programs: int, branches: int, depth: int, max_tokens: int) -> dict:
    batch = [{"question": WORKED + PUZZLES[i % len(PUZZLES)] + (f" (variant {i // len(PUZZLES)})"
                                                                if i >= len(PUZZLES) else ""),
              "branches": branches, "depth": depth, "max_tokens": max_tokens} for i in range(programs)]
    states = tot.tree_of_thought.run_batch(batch, backend=backend, temperature=0, num_threads=programs)
    errors = [s.error() for s in states if s.error() is not None]
    if errors:
        raise errors[0]
    return {"programs": programs}


def measure(url: str, name: str, fn: Any, tokenizer: Any) -> dict[str, Any]:
    backend = RecordingEndpoint(url)
    backend.flush_cache()
    meter = sgl.CacheMeter(backend)
    start = time.perf_counter()
    extra = fn(backend)
    wall = time.perf_counter() - start
    recs = [r for r in backend.records if "meta" in r]
    prompt = sum(r["meta"]["prompt_tokens"] for r in recs)
    cached = sum(r["meta"]["cached_tokens"] for r in recs)
    result = {"workload": name, "url": url, "wall_s": round(wall, 2), "requests": len(recs),
              "prompt_tokens": prompt, "server_hit_rate": meter.hit_rate(),
              "request_hit_rate": cached / prompt if prompt else 0.0, **extra}
    if tokenizer is not None:
        result["optimum_hit_rate"] = optimum_hit_rate(recs, tokenizer)
        result["of_optimum"] = result["request_hit_rate"] / result["optimum_hit_rate"]
    backend.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="the server under test (cache on)")
    parser.add_argument("--baseline-url", default=None, help="a server with --disable-radix-cache, to compare")
    parser.add_argument("--num-questions", type=int, default=64)
    parser.add_argument("--shots", type=int, default=20)
    parser.add_argument("--num-threads", type=int, default=64)
    parser.add_argument("--tot-programs", type=int, default=8)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--only", choices=("fewshot", "tot"), default=None, help="run one workload")
    parser.add_argument("--repeat", type=int, default=1, help="runs per server; the fastest is reported "
                        "(a shared machine's load varies from run to run)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(sgl.RuntimeEndpoint(args.url).model_info["tokenizer_path"])
    except Exception as exc:  # the optimum is optional
        print(f"(no tokenizer, no optimum hit rate: {exc})")
    random.seed(0)
    workloads = {}
    if args.only in (None, "fewshot"):
        workloads[f"few-shot run_batch ({args.num_questions} questions, {args.shots} shots)"] = \
            lambda b: run_fewshot(b, args.num_questions, args.shots, args.num_threads)
    if args.only in (None, "tot"):
        workloads[f"tree-of-thought ({args.tot_programs} programs x {args.branches} branches, depth {args.depth})"] = \
            lambda b: run_tot(b, args.tot_programs, args.branches, args.depth, args.max_tokens)
    urls = [("cache on", args.url)] + ([("cache off", args.baseline_url)] if args.baseline_url else [])
    for _, url in urls:  # warm up each server (first forward passes, allocator)
        sgl.RuntimeEndpoint(url)._call({"text": "warm up", "sampling_params": {"max_new_tokens": 4}})
    results = []
    for name, fn in workloads.items():
        rows = []
        for label, url in urls:
            runs = [measure(url, name, fn, tokenizer) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["wall_s"])
            rows.append(dict(best, label=label, all_wall_s=[r["wall_s"] for r in runs]))
        results += rows
        print(f"\n{name}")
        for r in rows:
            opt = (f", optimum {100 * r['optimum_hit_rate']:.1f}% ({100 * r['of_optimum']:.1f}% of it)"
                   if "optimum_hit_rate" in r else "")
            print(f"  {r['label']:<9} wall {r['wall_s']:7.2f} s  {r['requests']:4d} requests  "
                  f"{r['prompt_tokens']:6d} prompt tokens  hit rate: server {100 * (r['server_hit_rate'] or 0):.1f}%, "
                  f"requests {100 * r['request_hit_rate']:.1f}%{opt}")
        if len(rows) == 2:
            print(f"  speedup with the radix cache: {rows[1]['wall_s'] / rows[0]['wall_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
