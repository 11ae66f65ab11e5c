"""The in-process Engine backend gives the same greedy results as the server through RuntimeEndpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import frontend as sgl
from tests.oracle import WITH_TOP2, dsl_agrees


@pytest.fixture(scope="module")
def engine_backend(tiny_model_dir: Path) -> Iterator[sgl.EngineBackend]:
    backend = sgl.EngineBackend(model=str(tiny_model_dir), max_total_tokens=8192, dtype="float32",
                                log_level="warning")
    yield backend
    report = backend.engine.check_integrity()
    assert report["private"] == 0 and report["protected"] == 0, report
    backend.shutdown()


@sgl.function
def program(s, topic):
    s += sgl.system("You are terse.")
    s += sgl.user("Tell me about " + topic)
    s += sgl.assistant(sgl.gen("answer", max_tokens=10, ignore_eos=True))
    s += sgl.user("Is that right?")
    s += sgl.assistant(sgl.select("verdict", VERDICTS))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += sgl.user(f"Give reason {i + 1}")
        f += sgl.assistant(sgl.gen("reason", max_tokens=6))
    forks.join()
    s += sgl.user("Pick one") + sgl.assistant(sgl.gen("pick", choices=PICKS))
    return forks  # (the test reads each fork's meta_info)


VERDICTS, PICKS = ["yes", "no", "not sure"], ["first", "second"]


def test_same_greedy_results(endpoint, engine_backend) -> None:
    """Equal results, or results that part only at a float near-tie of the Engine's run (tests/oracle.py)."""
    assert engine_backend.get_chat_template() == endpoint.get_chat_template()
    topics = ["cats", "the moon"]
    via_http = program.run_batch([{"topic": t} for t in topics], backend=endpoint, temperature=0, num_threads=1)
    via_engine = program.run_batch([{"topic": t} for t in topics], backend=engine_backend, temperature=0,
                                   num_threads=1, **WITH_TOP2)

    def decode(ids: list[int]) -> str:
        return str(engine_backend.engine.tokenizer.decode(ids, skip_special_tokens=True))

    for a, b in zip(via_http, via_engine):
        assert a.error() is None and b.error() is None
        assert len(b.get_meta_info("answer")["output_top_logprobs"]) == 10  # the reference has its top-2
        # answer -> verdict -> (each fork's reason, and pick): after a near-tie divergence the rest has other inputs
        if not (dsl_agrees(b, a, "answer", decode) and dsl_agrees(b, a, "verdict", decode, VERDICTS)):
            continue
        for fork_b, fork_a in zip(b.ret_value, a.ret_value):
            dsl_agrees(fork_b, fork_a, "reason", decode)
        assert b["reason"] == [f["reason"] for f in b.ret_value] and a["reason"] == [f["reason"] for f in a.ret_value]
        if dsl_agrees(b, a, "pick", decode, PICKS):
            assert a.text() == b.text() and a.messages() == b.messages()


def test_engine_streaming_and_cache_info(engine_backend) -> None:
    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen("x", max_tokens=48, ignore_eos=True)

    meter = sgl.CacheMeter(engine_backend)
    state = prog.run(backend=engine_backend, stream=True, temperature=0)
    chunks = list(state.text_iter("x"))
    # frames that arrive while the reader is busy merge, so the count depends on timing: 48 steps leave room
    assert "".join(chunks) == state["x"] and len(chunks) >= 2
    prog.run(backend=engine_backend, temperature=0).sync()
    assert meter.hit_rate() is not None
    assert engine_backend.flush_cache()
