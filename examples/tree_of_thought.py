"""Tree of thought: fork into several lines of reasoning, let the model judge each with ``select``, keep the best.

Each ``fork`` first prefills the shared text once, so every branch (and every judgement) reuses it.

    python examples/tree_of_thought.py --url http://127.0.0.1:30000 --branches 3
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import frontend as sgl

QUESTION = ("A farmer has 17 sheep. All but 9 run away. Then he buys 4 more. "
            "How many sheep does he have now?")


@sgl.function
def tree_of_thought(s, question, branches=3, depth=2, max_tokens=32):
    s += sgl.system("You solve puzzles step by step.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    s += "Let me think about this in a few different ways.\n"
    thoughts = s.fork(branches)
    for i, t in enumerate(thoughts):
        t += f"Idea {i + 1}: " + sgl.gen("idea", max_tokens=max_tokens, stop="\n") + "\n"
        if depth > 1:  # each idea is expanded once more, in parallel
            steps = t.fork(2)
            for j, st in enumerate(steps):
                st += f"Step {j + 1}: " + sgl.gen("step", max_tokens=max_tokens, stop="\n") + "\n"
            steps.join("concate_and_append")
        t += "Is this reasoning sound? " + sgl.select("verdict", ["yes", "no"]) + "\n"
        t += "So the answer is " + sgl.gen("answer", max_tokens=8, stop=["\n", "."])
    thoughts.join()
    # The first branch the model itself judged sound; the first one if none was.
    best = next((i for i, v in enumerate(s["verdict"]) if v == "yes"), 0)
    s += f"The most convincing idea was idea {best + 1}, so the answer is {s['answer'][best].strip()}."
    s += sgl.assistant_end()
    s["best"] = best


def main(url: str = "http://127.0.0.1:30000", branches: int = 3, depth: int = 2, max_tokens: int = 32,
         backend: Any = None) -> dict[str, Any]:
    backend = backend or sgl.RuntimeEndpoint(url)
    backend.flush_cache()  # start from an empty cache, so the hit rate below is this run's alone
    meter = sgl.CacheMeter(backend)
    start = time.perf_counter()
    state = tree_of_thought.run(question=QUESTION, branches=branches, depth=depth, max_tokens=max_tokens,
                                backend=backend, temperature=0)
    text = state.text()
    wall = time.perf_counter() - start
    error = state.error()
    if error is not None:
        raise error
    for i, (idea, verdict, answer) in enumerate(zip(state["idea"], state["verdict"], state["answer"])):
        print(f"idea {i + 1}: {idea.strip()!r}  sound: {verdict}  answer: {answer.strip()!r}")
    print(text.splitlines()[-1])
    print(f"wall time {wall:.2f} s, {meter.summary()}")
    return {"ideas": state["idea"], "verdicts": state["verdict"], "answers": state["answer"],
            "best": state["best"], "wall_s": wall, **meter.stats()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--depth", type=int, default=2, choices=(1, 2))
    args = parser.parse_args()
    main(args.url, args.branches, args.depth)
