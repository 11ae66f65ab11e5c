"""SGLang's own frontend (the ``sglang`` package's ``sglang.lang``, unchanged) against a live radixserve server.

``sgl.RuntimeEndpoint(url)`` speaks SGLang's native API: /get_model_info, /server_info, /flush_cache and
/generate with every ``sampling_params`` field (``stop_regex: []`` among them), batches for ``select``,
streams. Programs from ``sglang.test.test_programs`` that exercise mechanics rather than model quality run
as SGLang ships them; the others (few-shot answers, arithmetic, JSON from a 135M model, images, OpenAI-only
speculative execution, ``concate_and_append`` which SGLang's own server does not serve) are left out.

Model quality does not matter to these programs, so most run on the tiny random model (fast); the chat
program runs on the default model. ``test_stream_logprobs`` is not run through SGLang's frontend: its
interpreter keeps only the latest frame's meta_info, so two frames that arrive before its iterator wakes are
merged in text but not in logprobs, and the program's check then fails by timing alone (seen on the default
model too, on SGLang's own server as well). The same program runs through our DSL, whose stream reader merges
every frame, in tests/frontend/test_sglang_programs.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.server.sglang_frontend import load_test_programs, sglang_frontend
from tests.server_harness import ServerProcess, assert_kv_clean


@pytest.fixture(scope="module")
def sgl() -> Iterator[ModuleType]:
    with sglang_frontend() as module:
        yield module


@pytest.fixture(scope="module")
def programs(sgl: ModuleType) -> ModuleType:
    return load_test_programs()


@pytest.fixture(scope="module")
def tiny_endpoint(sgl: ModuleType, tiny_server: ServerProcess) -> Iterator[Any]:
    endpoint = sgl.RuntimeEndpoint(tiny_server.url)
    yield endpoint
    assert_kv_clean(tiny_server.url)


@pytest.fixture
def tiny(sgl: ModuleType, tiny_endpoint: Any) -> Any:
    sgl.set_default_backend(tiny_endpoint)
    return tiny_endpoint


@pytest.fixture
def smol(sgl: ModuleType, smol_server: ServerProcess) -> Iterator[Any]:
    # SmolLM2 speaks ChatML; SGLang picks a chat template by model path and does not know this one's
    endpoint = sgl.RuntimeEndpoint(smol_server.url, chat_template_name="chatml")
    sgl.set_default_backend(endpoint)
    yield endpoint
    assert_kv_clean(smol_server.url)


def native(url: str, text: str, **sampling: Any) -> dict[str, Any]:
    """The same request through radixserve's /generate, to compare the frontend's results with."""
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": sampling}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


# ---------------------------------------------------------------------- sglang.test.test_programs, unchanged
@pytest.mark.parametrize("name", ["test_mt_bench", "test_select", "test_expert_answer", "test_regex",
                                  "test_dtype_gen", "test_stream", "test_parallel_decoding"])
def test_sglang_program(programs: ModuleType, tiny: Any, name: str) -> None:
    program = getattr(programs, name)
    if name in ("test_select", "test_expert_answer"):
        program(check_answer=False)  # the answer itself is model quality
    else:
        program()


@dataclass
class RuntimeHandle:
    """What ``sgl.Runtime`` is to a program: a default backend whose ``endpoint`` is the RuntimeEndpoint
    (``test_gen_min_new_tokens`` reads ``global_config.default_backend.endpoint.get_model_name()``)."""

    endpoint: Any


def test_sglang_gen_min_new_tokens(sgl: ModuleType, programs: ModuleType, smol: Any) -> None:
    # it re-tokenizes the answer and counts its tokens: only a real model's text re-tokenizes the same way
    sgl.set_default_backend(RuntimeHandle(smol))
    programs.test_gen_min_new_tokens()


# ---------------------------------------------------------------------- the frontend's API, checked
def test_server_info_and_flush(sgl: ModuleType, tiny: Any, tiny_server: ServerProcess) -> None:
    info = sgl.get_server_info()
    assert info["model_info"]["vocab_size"] > 0
    assert set(info) == set(httpx.get(tiny_server.url + "/get_server_info", timeout=30).json())
    assert tiny.get_model_name() == info["model_info"]["model_path"]
    assert_kv_clean(tiny_server.url)
    sgl.flush_cache()  # raises unless the server answered 200


def test_gen_with_logprobs_matches_the_native_api(sgl: ModuleType, tiny: Any, tiny_server: ServerProcess) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "The weather today is"
        s += sgl.gen("out", max_tokens=8, min_tokens=8, temperature=0, return_logprob=True, top_logprobs_num=2,
                     return_text_in_logprobs=True)

    state = prog.run()
    meta = state.get_meta_info("out")
    ref = native(tiny_server.url, "The weather today is", max_new_tokens=8, min_new_tokens=8, temperature=0)
    assert state["out"] == ref["text"]
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == ref["output_ids"] and all(isinstance(e[2], str) for e in entries)
    assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == 8
    assert len(meta["output_top_logprobs"]) == 8 and all(len(t) == 2 for t in meta["output_top_logprobs"])


def test_select_picks_the_best_normalized_choice(sgl: ModuleType, tiny: Any) -> None:
    choices = ["red", "green", "blue sky"]

    @sgl.function
    def prog(s: Any) -> None:
        s += "My favourite colour is " + sgl.select("colour", choices=choices)

    state = prog.run()
    meta = state.get_meta_info("colour")
    scores = meta["normalized_prompt_logprobs"]
    assert state["colour"] == choices[max(range(3), key=lambda i: scores[i])]
    assert state.text() == "My favourite colour is " + state["colour"]


def test_fork_dtype_regex_and_stop_regex(sgl: ModuleType, tiny: Any, tiny_server: ServerProcess) -> None:
    prefix = "Items of a list. "
    base = native(tiny_server.url, prefix + "First:", max_new_tokens=16, temperature=0, ignore_eos=True)["text"]
    stop = re.escape(base[6:8]) + r"[\s\S]"  # a stop_regex that matches mid-output
    cut = re.search(stop, base)
    assert cut is not None
    seen: dict[str, Any] = {}

    @sgl.function
    def prog(s: Any) -> None:
        s += prefix
        forks = s.fork(2)
        forks[0] += "First:" + sgl.gen("a", max_tokens=16, temperature=0, ignore_eos=True)
        forks[1] += "First:" + sgl.gen("b", max_tokens=16, temperature=0, ignore_eos=True, stop_regex=stop)
        forks.join()
        seen["b_meta"] = forks[1].get_meta_info("b")
        s += "Count: " + sgl.gen("n", dtype=int, max_tokens=6) + "\n"
        s += "Pet: " + sgl.gen("pet", regex=r"(cat|dog)s?", temperature=0)

    state = prog.run()
    assert state["a"] == [base]  # join gathers each fork's variables
    assert state["b"] == [base[: cut.start()]]  # cut before the match, as with a stop string
    assert seen["b_meta"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert re.fullmatch(r"[-+]?[0-9]+", state["n"].strip()), state["n"]
    assert re.fullmatch(r"(cat|dog)s?", state["pet"])


def test_streaming_equals_the_whole_answer(sgl: ModuleType, tiny: Any) -> None:
    # A stream frame carries whatever text is new when the HTTP side gets to it, so a client that falls behind
    # receives several tokens in one frame; 24 tokens of the tiny model once arrived as a single frame on a
    # loaded machine. 160 tokens take long enough that a single frame would mean no streaming at all.
    @sgl.function
    def prog(s: Any) -> None:
        s += "Tell me a story:" + sgl.gen("story", max_tokens=160, temperature=0, ignore_eos=True)

    whole = prog.run()["story"]
    state = prog.run(stream=True)
    chunks = list(state.text_iter("story"))
    assert len(chunks) > 1 and "".join(chunks) == whole


def test_run_batch_maps_arguments_to_states(sgl: ModuleType, tiny: Any) -> None:
    @sgl.function
    def echo(s: Any, word: str) -> None:
        s += "Repeat the word " + word + ": " + sgl.gen("echo", regex=re.escape(word), temperature=0)

    words = ["alpha", "beta", "gamma", "delta"]
    states = echo.run_batch([{"word": w} for w in words], num_threads=4)
    assert [st["echo"] for st in states] == words


def test_chat_roles(sgl: ModuleType, smol: Any) -> None:
    @sgl.function
    def chat(s: Any) -> None:
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))

    state = chat.run()
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.text().startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert state["answer"].strip() and "<|im_end|>" not in state["answer"]
