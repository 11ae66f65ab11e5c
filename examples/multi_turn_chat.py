"""A multi-turn chat: each turn's request carries the whole conversation, which the cache already holds.

    python examples/multi_turn_chat.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import frontend as sgl

CONVERSATIONS = [
    ["Hi! Can you suggest a name for a small bakery?", "Nice. Write a one-line slogan for it.",
     "Now translate the slogan into French."],
    ["What is a good first programming language?", "Why that one?", "Give me a tiny example program."],
]


@sgl.function
def multi_turn(s, turns, max_tokens=64):
    s += sgl.system("You are a friendly assistant. Keep answers short.")
    for i, message in enumerate(turns):
        s += sgl.user(message)
        s += sgl.assistant(sgl.gen(f"reply_{i}", max_tokens=max_tokens))


def main(url: str = "http://127.0.0.1:30000", max_tokens: int = 64, backend: Any = None) -> dict[str, Any]:
    backend = backend or sgl.RuntimeEndpoint(url)
    backend.flush_cache()  # start from an empty cache, so the hit rate below is this run's alone
    meter = sgl.CacheMeter(backend)
    start = time.perf_counter()
    states = multi_turn.run_batch([{"turns": t, "max_tokens": max_tokens} for t in CONVERSATIONS],
                                  backend=backend, temperature=0, num_threads=len(CONVERSATIONS))
    wall = time.perf_counter() - start
    cached = []
    for state in states:
        for message in state.messages():
            print(f"[{message['role']}] {message['content']}")
        print()
        cached += [state.get_meta_info(f"reply_{i}")["cached_tokens"] for i in range(len(CONVERSATIONS[0]))]
    print(f"wall time {wall:.2f} s, cached tokens per turn {cached}, {meter.summary()}")
    return {"messages": [s.messages() for s in states], "cached_tokens": cached, "wall_s": wall, **meter.stats()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    main(args.url, args.max_tokens)
