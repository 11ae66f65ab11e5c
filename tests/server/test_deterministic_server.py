"""A server started with ``--enable-deterministic-inference`` answers the same prompt with bit-identical
token ids and logprobs alone, inside a burst of 24 concurrent requests of mixed lengths, and again after
its prefix is cached — on /generate, /v1/completions and /v1/chat/completions, greedy and seeded T=0.8."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_harness import ServerProcess

PROMPT = "The lighthouse keeper counted the ships that passed the rocks each night, and"
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1234}}


@pytest.fixture(scope="module")
def det_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    # a small chunk size, so that the long prompts of the burst are prefilled in pieces next to decodes
    server = ServerProcess(str(tiny_model_dir), ["--enable-deterministic-inference", "--max-total-tokens", "16384",
                                                 "--chunked-prefill-size", "64"]).start()
    yield server
    assert server.stop() == 0, server.log()


def native(url: str, text: str, sp: dict) -> Any:
    body = {"text": text, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **sp},
            "return_logprob": True, "top_logprobs_num": 3}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    return out["output_ids"], meta["output_token_logprobs"], meta["output_top_logprobs"], meta["cached_tokens"]


def completions(url: str, text: str, sp: dict) -> Any:
    body = {"model": "default", "prompt": text, "max_tokens": 24, "logprobs": 3, "ignore_eos": True, **sp}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    lp = out["choices"][0]["logprobs"]
    return (out["choices"][0]["text"], lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


def chat(url: str, text: str, sp: dict) -> Any:
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 24,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True, **sp}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    content = out["choices"][0]["logprobs"]["content"]
    return (out["choices"][0]["message"]["content"], content,
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


API = {"generate": native, "completions": completions, "chat": chat}


def filler(rng: random.Random) -> str:
    words = ["river", "stone", "lamp", "north", "quiet", "harbour", "seven", "glass", "wind", "rope"]
    return " ".join(rng.choice(words) for _ in range(rng.randrange(3, 300)))


@pytest.mark.parametrize("api", list(API))
@pytest.mark.parametrize("mode", list(SAMPLING))
def test_alone_in_a_burst_and_cached_are_bit_identical(det_server, api, mode):
    url, call, sp = det_server.url, API[api], SAMPLING[mode]
    httpx.post(url + "/flush_cache", timeout=30)
    prompt = f"{PROMPT} ({api}, {mode})"
    alone = call(url, prompt, sp)
    assert alone[-1] == 0, "the first request must run cold"

    rng = random.Random(hash((api, mode)) % 1000)
    others = [(filler(rng), {"temperature": rng.choice([0, 0.7]), "seed": rng.randrange(100)}) for _ in range(23)]
    with ThreadPoolExecutor(24) as pool:
        mine = pool.submit(lambda: [call(url, prompt, sp)])
        burst = [pool.submit(call, url, text, o) for text, o in others]
        in_burst = mine.result()[0]
        for f in burst:
            f.result()
    cached = call(url, prompt, sp)
    assert cached[-1] > 0, "the prompt must hit the cache the third time"
    assert in_burst[:-1] == alone[:-1]
    assert cached[:-1] == alone[:-1]
    kv = httpx.get(url + "/get_server_info", timeout=30).json()["kv"]  # idle: nothing held by requests
    assert kv["private"] == 0 and kv["protected"] == 0, kv
    assert kv["free"] + kv["evictable"] == kv["capacity"], kv
