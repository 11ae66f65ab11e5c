"""Few-shot question answering over a small built-in dataset, with ``run_batch``.

Every program starts with the same few-shot block, so before the batch fans out the frontend prefills
that block once; each question then only computes its own few tokens.

    radixserve serve &              # the default model, port 30000
    python examples/fewshot_qa.py --num-questions 64 --num-threads 16
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import frontend as sgl

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Germany", "Berlin"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Greece", "Athens"), ("Norway", "Oslo"), ("Portugal", "Lisbon"),
            ("Austria", "Vienna"), ("Russia", "Moscow"), ("Thailand", "Bangkok"), ("Cuba", "Havana")]

FEW_SHOT = [
    ("What is 12 + 7?", "19"), ("What is the capital of Poland?", "Warsaw"), ("What is 30 - 4?", "26"),
    ("What is the capital of Sweden?", "Stockholm"), ("What is 6 + 9?", "15"),
    ("What is the capital of Ireland?", "Dublin"), ("What is 41 - 20?", "21"),
    ("What is the capital of Chile?", "Santiago"),
]


def make_questions(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` questions, half arithmetic and half capital cities, each with its expected answer."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            out.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
        else:
            country, city = CAPITALS[rng.randrange(len(CAPITALS))]
            out.append({"question": f"What is the capital of {country}?", "answer": city})
    return out


def few_shot_block() -> str:
    lines = ["Answer each question with a single word or number.\n"]
    for q, a in FEW_SHOT:
        lines.append(f"Question: {q}\nAnswer: {a}\n")
    return "\n".join(lines) + "\n"


@sgl.function
def few_shot_qa(s, question):
    s += few_shot_block()
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=12, stop="\n")


def main(url: str = "http://127.0.0.1:30000", num_questions: int = 64, num_threads: int = 16,
         progress_bar: bool = True, backend: Any = None) -> dict[str, Any]:
    backend = backend or sgl.RuntimeEndpoint(url)
    questions = make_questions(num_questions)
    backend.flush_cache()  # start from an empty cache, so the hit rate below is this run's alone
    meter = sgl.CacheMeter(backend)
    start = time.perf_counter()
    states = few_shot_qa.run_batch([{"question": q["question"]} for q in questions], backend=backend,
                                   temperature=0, num_threads=num_threads, progress_bar=progress_bar)
    wall = time.perf_counter() - start
    answers = [s["answer"].strip() for s in states]
    correct = sum(a.lower().startswith(q["answer"].lower()) for a, q in zip(answers, questions))
    for q, a in list(zip(questions, answers))[:8]:
        print(f"{q['question']:<40} -> {a!r} (expected {q['answer']})")
    print(f"accuracy {correct}/{len(questions)}, wall time {wall:.2f} s, {meter.summary()}")
    return {"answers": answers, "accuracy": correct / len(questions), "wall_s": wall, **meter.stats()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--num-questions", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=16)
    args = parser.parse_args()
    main(args.url, args.num_questions, args.num_threads)
