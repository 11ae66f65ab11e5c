"""JSON extraction: ``gen(json_schema=...)`` turns free text into records the server guarantees to parse.

    python examples/json_extraction.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import frontend as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

DOCUMENTS = [
    "Maria Lopez, 34, moved to Valencia last spring to open a bookshop.",
    "At 71, retired pilot Tom Becker still flies gliders every weekend near Munich.",
    "Aiko Tanaka (26) writes software for a robotics startup in Osaka.",
    "Samuel Okafor is a 45-year-old architect who lives and works in Lagos.",
]


@sgl.function
def extract(s, document, max_tokens=96):
    s += sgl.system("You extract facts from text and answer with JSON only.")
    s += sgl.user("Give the person's name, age and city as JSON.\nText: " + document)
    s += sgl.assistant(sgl.gen("record", max_tokens=max_tokens, json_schema=SCHEMA))


def parse(state: sgl.ProgramState) -> dict[str, Any] | None:
    """The record, or None when the output is not valid JSON (cut by max_tokens, or not constrained)."""
    try:
        value = json.loads(state["record"])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def main(url: str = "http://127.0.0.1:30000", max_tokens: int = 96, backend: Any = None) -> dict[str, Any]:
    backend = backend or sgl.RuntimeEndpoint(url)
    backend.flush_cache()  # start from an empty cache, so the hit rate below is this run's alone
    meter = sgl.CacheMeter(backend)
    start = time.perf_counter()
    states = extract.run_batch([{"document": d, "max_tokens": max_tokens} for d in DOCUMENTS],
                               backend=backend, temperature=0, num_threads=len(DOCUMENTS))
    records = [parse(s) for s in states]
    wall = time.perf_counter() - start
    for doc, state, record in zip(DOCUMENTS, states, records):
        shown = json.dumps(record) if record is not None else f"(not valid JSON) {state['record']!r}"
        print(f"{doc[:50]:<52} -> {shown}")
    print(f"{sum(r is not None for r in records)}/{len(records)} valid records, wall time {wall:.2f} s, "
          f"{meter.summary()}")
    return {"records": records, "raw": [s["record"] for s in states],
            "finish_reasons": [s.get_meta_info("record")["finish_reason"] for s in states],
            "wall_s": wall, **meter.stats()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    main(args.url, args.max_tokens)
