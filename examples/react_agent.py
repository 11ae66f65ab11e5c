"""A ReAct-style agent: the model picks a tool with ``select``, writes its input with ``gen``, and the
program runs the tool locally and appends the observation -- the growing transcript stays cached.

    python examples/react_agent.py --url http://127.0.0.1:30000 --max-steps 4
"""

from __future__ import annotations

import argparse
import ast
import operator
import time
from collections.abc import Callable
from typing import Any

import frontend as sgl

FACTS = {"france": "Paris is the capital of France; population about 67 million.",
         "japan": "Tokyo is the capital of Japan; population about 125 million.",
         "mount everest": "Mount Everest is 8849 metres high.",
         "python": "Python is a programming language created by Guido van Rossum in 1991."}

_OPS: dict[type, Callable[..., Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                        ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluates + - * / ** over numbers (parsed with ast; nothing is executed)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)  # floats: a huge power overflows at once instead of running for ages
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.operand)))
        raise ValueError("only arithmetic on numbers is allowed")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as exc:
        return f"error: {exc}"
    return f"{value:g}"


def lookup(topic: str) -> str:
    key = topic.strip().strip("\"'.").lower()
    return next((fact for name, fact in FACTS.items() if name in key or (key and key in name)),
                f"no entry for {topic.strip()!r}; known topics: {', '.join(FACTS)}")


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "lookup": lookup}

PROMPT = """Answer the question using the tools.
Tools:
- calculator: evaluates an arithmetic expression, e.g. 3 * (4 + 5)
- lookup: returns a fact about a topic, e.g. France
Use this format:
Thought: what to do next
Action: calculator, lookup or finish
Action Input: the tool input, or the final answer after finish
Observation: the tool result
"""


@sgl.function
def react_agent(s, question, max_steps=4, max_tokens=32):
    s += PROMPT + "\nQuestion: " + question + "\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=max_tokens, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action_{step}", ["calculator", "lookup", "finish"]) + "\n"
        s += "Action Input:" + sgl.gen(f"input_{step}", max_tokens=max_tokens, stop="\n") + "\n"
        action = s[f"action_{step}"]
        if action == "finish":
            s["answer"] = s[f"input_{step}"].strip()
            return
        s += f"Observation: {TOOLS[action](s[f'input_{step}'])}\n"
    s += "Final Answer:" + sgl.gen("final", max_tokens=max_tokens, stop="\n")
    s["answer"] = s["final"].strip()


def main(url: str = "http://127.0.0.1:30000", max_steps: int = 4, max_tokens: int = 32,
         question: str = "What is the population of Japan divided by the population of France?",
         backend: Any = None) -> dict[str, Any]:
    backend = backend or sgl.RuntimeEndpoint(url)
    backend.flush_cache()  # start from an empty cache, so the hit rate below is this run's alone
    meter = sgl.CacheMeter(backend)
    start = time.perf_counter()
    state = react_agent.run(question=question, max_steps=max_steps, max_tokens=max_tokens, backend=backend,
                            temperature=0)
    answer = state["answer"]
    wall = time.perf_counter() - start
    print(state.text())
    actions = [state[f"action_{i}"] for i in range(max_steps) if f"action_{i}" in state]
    print(f"actions {actions}, answer {answer!r}, wall time {wall:.2f} s, {meter.summary()}")
    return {"answer": answer, "actions": actions, "wall_s": wall, **meter.stats()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--question", default="What is the population of Japan divided by the population of France?")
    args = parser.parse_args()
    main(args.url, args.max_steps, question=args.question)
