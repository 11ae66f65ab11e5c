"""One user chatting alone: decode tokens/s of one streamed request over a ~1k-token prompt, radixserve in
each weight format vs llama.cpp's server (llama-cpp-python, the same model's Q4_1 GGUF), in one run.

Each server gets the same prompt once to warm up, then a different ~1k-token prompt, streamed through
/v1/completions with 128 new tokens (ignore_eos). Decode tokens/s counts the tokens after the first over
the time between the first and the last streamed chunk; time to first token is reported too.

    python benchmarks/bench_single_stream.py [--formats bfloat16 float32 int8 int8+kv8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from engine_steps import emit

from runtime.bench.servers import llama_cpp_server, llama_cpp_status, radixserve_server

FORMAT_FLAGS = {"float32": ["--dtype", "float32"], "bfloat16": ["--dtype", "bfloat16"],
                "int8": ["--quantization", "int8"],  # activations and KV in the default dtype, as the flag alone
                "int8+kv8": ["--quantization", "int8", "--kv-cache-dtype", "int8"]}  # and the KV cache in int8
WORDS = ["river", "stone", "lamp", "north", "quiet", "harbour", "seven", "glass", "wind", "rope", "market",
         "winter", "letter", "garden", "engine", "bridge", "orange", "silver", "window", "morning"]


def prompt(seed: int, words: int = 900) -> str:
    rng = random.Random(seed)
    return "Continue the notes.\n" + " ".join(rng.choice(WORDS) for _ in range(words))


def stream_once(url: str, model: str, text: str, new_tokens: int) -> dict[str, float]:
    body = {"model": model, "prompt": text, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    return {"ttft_s": stamps[0] - t0, "chunks": len(stamps),
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def measure(server: Any, new_tokens: int) -> dict[str, float]:
    server.start(timeout=900)
    try:
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        stream_once(server.url, model, prompt(0), 16)
        return stream_once(server.url, model, prompt(1), new_tokens)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=list(FORMAT_FLAGS), choices=list(FORMAT_FLAGS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", help="also save the result here")
    a = ap.parse_args()
    threads = torch.get_num_threads()
    logs = Path(tempfile.mkdtemp(prefix="radixserve-single-"))
    result: dict[str, Any] = {"threads": threads, "new_tokens": a.new_tokens, "systems": {}}
    for fmt in a.formats:
        result["systems"][f"radixserve {fmt}"] = measure(radixserve_server(logs, extra=FORMAT_FLAGS[fmt]),
                                                         a.new_tokens)
    ok, why = llama_cpp_status()
    if ok:
        try:
            result["systems"]["llama.cpp Q4_1"] = measure(llama_cpp_server(logs, threads), a.new_tokens)
            ref = result["systems"]["llama.cpp Q4_1"]["decode_tok_s"]
            result["vs_llamacpp"] = {k: v["decode_tok_s"] / ref for k, v in result["systems"].items()}
        except httpx.HTTPError as exc:  # e.g. its server process died mid-request
            result["llamacpp"] = f"failed: {exc} (log: {logs / 'llamacpp.log'})"
    else:
        result["llamacpp"] = why
    emit(result, a.json)


if __name__ == "__main__":
    main()
