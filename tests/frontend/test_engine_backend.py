"""The in-process Engine backend gives the same greedy results as the server through RuntimeEndpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import frontend as sgl


@pytest.fixture(scope="module")
def engine_backend(tiny_model_dir: Path) -> Iterator[sgl.EngineBackend]:
    backend = sgl.EngineBackend(model=str(tiny_model_dir), max_total_tokens=8192, log_level="warning")
    yield backend
    backend.shutdown()


@sgl.function
def program(s, topic):
    s += sgl.system("You are terse.")
    s += sgl.user("Tell me about " + topic)
    s += sgl.assistant(sgl.gen("answer", max_tokens=10, ignore_eos=True))
    s += sgl.user("Is that right?")
    s += sgl.assistant(sgl.select("verdict", ["yes", "no", "not sure"]))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += sgl.user(f"Give reason {i + 1}")
        f += sgl.assistant(sgl.gen("reason", max_tokens=6))
    forks.join()
    s += sgl.user("Pick one") + sgl.assistant(sgl.gen("pick", choices=["first", "second"]))


def variables(state: sgl.ProgramState) -> dict:
    return {k: state[k] for k in ("answer", "verdict", "reason", "pick")}


def test_same_greedy_results(endpoint, engine_backend) -> None:
    assert engine_backend.get_chat_template() == endpoint.get_chat_template()
    topics = ["cats", "the moon"]
    via_http = program.run_batch([{"topic": t} for t in topics], backend=endpoint, temperature=0, num_threads=1)
    via_engine = program.run_batch([{"topic": t} for t in topics], backend=engine_backend, temperature=0,
                                   num_threads=1)
    for a, b in zip(via_http, via_engine):
        assert a.error() is None and b.error() is None
        assert variables(a) == variables(b)
        assert a.text() == b.text() and a.messages() == b.messages()


def test_engine_streaming_and_cache_info(engine_backend) -> None:
    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen("x", max_tokens=6, ignore_eos=True)

    meter = sgl.CacheMeter(engine_backend)
    state = prog.run(backend=engine_backend, stream=True, temperature=0)
    chunks = list(state.text_iter("x"))
    assert "".join(chunks) == state["x"] and len(chunks) >= 2
    prog.run(backend=engine_backend, temperature=0).sync()
    assert meter.hit_rate() is not None
    assert engine_backend.flush_cache()
