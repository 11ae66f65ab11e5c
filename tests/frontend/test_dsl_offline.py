"""The interpreter's semantics against a scripted in-memory backend (no model, no server)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import frontend as sgl
from frontend.backends.base import BaseBackend
from frontend.chat import ChatTemplate
from frontend.choices import ChoicesDecision
from frontend.ir import GenParams
from frontend.run import shared_prefix


class ScriptedBackend(BaseBackend):
    """Answers every gen with ``reply`` (a string or a function of the prompt), every select with its
    last choice, and records what it was asked."""

    def __init__(self, reply: Any = "ok", delay: float = 0.0, template: ChatTemplate | None = None):
        self.chat_template = template or ChatTemplate.chatml("Default system.")
        self.reply, self.delay = reply, delay
        self.prompts: list[str] = []
        self.params: list[GenParams] = []
        self.prefixes: list[str] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()

    def cache_prefix(self, prefix: str) -> dict[str, Any]:
        self.prefixes.append(prefix)
        return {"prompt_tokens": len(prefix)}

    def generate(self, s: Any, params: GenParams) -> tuple[str, dict[str, Any]]:
        with self.lock:
            self.prompts.append(s.text_)
            self.params.append(params)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(self.delay)
        with self.lock:
            self.in_flight -= 1
        text = self.reply(s.text_) if callable(self.reply) else self.reply
        return text, {"prompt_tokens": len(s.text_), "cached_tokens": 0}

    def generate_stream(self, s: Any, params: GenParams) -> Any:
        text, meta = self.generate(s, params)
        for ch in text:
            time.sleep(0.02)  # slow enough that a reader sees several pieces
            yield ch, meta

    def select(self, s: Any, choices: list[str], temperature: float, method: Any) -> ChoicesDecision:
        return ChoicesDecision(choices[-1], {"scores": list(range(len(choices)))})


def test_roles_text_and_messages() -> None:
    be = ScriptedBackend("Paris")

    @sgl.function
    def prog(s, country):
        s += sgl.user("Capital of " + country + "?")
        s += sgl.assistant(sgl.gen("city", max_tokens=4))
        with s.user():
            s += "Thanks"

    state = prog.run(country="France", backend=be)
    assert state["city"] == "Paris"
    assert state.text() == ("<|im_start|>system\nDefault system.<|im_end|>\n<|im_start|>user\nCapital of France?"
                            "<|im_end|>\n<|im_start|>assistant\nParis<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n")
    assert state.messages() == [{"role": "system", "content": "Default system."},
                                {"role": "user", "content": "Capital of France?"},
                                {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "Thanks"}]
    # The gen saw the prompt up to the assistant prefix; the template's stop string was added.
    assert be.prompts[0].endswith("<|im_start|>assistant\n")
    assert be.params[0].max_new_tokens == 4 and "<|im_end|>" in be.params[0].stop_list


def test_begin_end_forms_and_explicit_system() -> None:
    @sgl.function
    def prog(s):
        s += sgl.system_begin() + "Be brief." + sgl.system_end()
        s += sgl.user_begin() + "Hi" + sgl.user_end()
        s += sgl.assistant_begin() + sgl.gen("a") + sgl.assistant_end()

    state = prog.run(backend=ScriptedBackend("yo"))
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[0]["content"] == "Be brief."  # no default system prompt when one is given


def test_defaults_and_gen_overrides() -> None:
    be = ScriptedBackend()

    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x") + sgl.gen("y", temperature=0.5, max_tokens=3, stop="\n")

    prog.run(backend=be, temperature=0, max_new_tokens=7, top_k=5).sync()  # run() returns before the gens end
    assert (be.params[0].temperature, be.params[0].max_new_tokens, be.params[0].top_k) == (0, 7, 5)
    assert (be.params[1].temperature, be.params[1].max_new_tokens) == (0.5, 3)
    assert be.params[1].stop_list[0] == "\n"
    native = be.params[1].to_native()
    assert native["stop"][0] == "\n" and "dtype" not in native and "return_logprob" not in native


def test_typed_gen_sends_regex_and_converts() -> None:
    replies = iter(["42", "2.5", "True", '"abc"'])
    be = ScriptedBackend(lambda _: next(replies))

    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen("i", dtype=int) + " f=" + sgl.gen("f", dtype=float)
        s += " b=" + sgl.gen("b", dtype=bool) + " s=" + sgl.gen_string("s")

    state = prog.run(backend=be)
    assert (state["i"], state["f"], state["b"], state["s"]) == (42, 2.5, True, "abc")
    assert state.text() == 'n=42 f=2.5 b=True s="abc"'  # the text keeps the raw output
    assert be.params[0].regex is not None and {" ", "\n"} <= set(be.params[0].stop_list)
    assert be.params[2].regex == "(True|False)"


def test_typed_gen_failure_is_reported() -> None:
    @sgl.function
    def prog(s):
        s += sgl.gen("i", dtype=int)

    state = prog.run(backend=ScriptedBackend("not a number"))
    assert isinstance(state.error(), sgl.DtypeError)
    with pytest.raises(RuntimeError, match="was not produced"):
        state["i"]


def test_select_and_gen_choices() -> None:
    @sgl.function
    def prog(s):
        s += "Pick: " + sgl.select("a", ["x", "y"]) + " " + sgl.gen("b", choices=["p", "q", "r"])

    state = prog.run(backend=ScriptedBackend())
    assert (state["a"], state["b"], state.text()) == ("y", "r", "Pick: y r")
    assert state.get_meta_info("a") == {"scores": [0, 1]}
    with pytest.raises(ValueError):
        sgl.select("c", [])


def test_fork_prefills_runs_branches_concurrently_and_gathers() -> None:
    be = ScriptedBackend(lambda p: p[-1], delay=0.2)

    @sgl.function
    def prog(s):
        s += "shared prefix "
        forks = s.fork(3)
        forks += lambda i: str(i)
        for f in forks:
            f += sgl.gen("x")
        forks.join()

    state = prog.run(backend=be)
    assert state["x"] == ["0", "1", "2"]
    # all three branches were in the backend at once (a wall-clock bound would say so only on an idle host)
    assert be.prefixes == ["shared prefix "] and be.max_in_flight == 3
    assert state.text() == "shared prefix "  # gather_variable leaves the parent's text alone


def test_join_concate_and_append_and_copy() -> None:
    @sgl.function
    def prog(s):
        s += "P:"
        forks = s.fork(2)
        forks += ["a", "b"]
        forks.join("concate_and_append")
        with s.copy() as c:
            c += sgl.gen("z")
        s += "!"

    state = prog.run(backend=ScriptedBackend("Z"))
    assert state.text() == "P:ab!"
    assert state["z"] == ["Z"]


def test_var_scope_bind_and_ret_value() -> None:
    @sgl.function
    def prog(s, a, b="B"):
        with s.var_scope("span"):
            s += a + b
        return len(a)

    state = prog.bind(b="C").run(a="xy", backend=ScriptedBackend())
    assert state["span"] == "xyC" and state.ret_value == 2
    with pytest.raises(TypeError):
        prog.bind(nope=1)
    with pytest.raises(TypeError):
        sgl.function(lambda x: None)


def test_streaming_text_iter() -> None:
    @sgl.function
    def prog(s):
        s += "Q:"
        s += sgl.gen("x")

    state = prog.run(backend=ScriptedBackend("hello"), stream=True)
    assert "".join(state.text_iter()) == "Q:hello"
    state = prog.run(backend=ScriptedBackend("hello"), stream=True)
    chunks = list(state.text_iter("x"))
    assert "".join(chunks) == "hello" and len(chunks) >= 2


def test_errors_in_the_program_function_propagate() -> None:
    @sgl.function
    def prog(s):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        prog.run(backend=ScriptedBackend())
    with pytest.raises(ValueError, match="backend"):
        sgl.set_default_backend(None)
        prog.run()


FEW_SHOT = "".join(f"Question: q{i} is a long enough question?\nAnswer: a{i}\n\n" for i in range(6))


@sgl.function
def fewshot(s, question):
    s += FEW_SHOT + "Question: " + question + "\nAnswer:" + sgl.gen("answer")


def test_run_batch_prefills_the_shared_prefix_once() -> None:
    be = ScriptedBackend(" yes", delay=0.05)
    states = fewshot.run_batch([{"question": f"What is {i}?"} for i in range(6)], backend=be, num_threads=3)
    assert [s["answer"] for s in states] == [" yes"] * 6
    # Traced up to the first gen; the divergence is inside "What is N?" so the prefix ends before " N?".
    assert be.prefixes == [FEW_SHOT + "Question: What is"]
    assert be.max_in_flight == 3


def test_run_batch_positional_args_progress_bar_and_order(capsys: pytest.CaptureFixture[str]) -> None:
    be = ScriptedBackend(lambda p: p.split("Question: ")[-1][:7])
    states = fewshot.run_batch([[f"item {i:02d}"] for i in range(5)], backend=be, num_threads=2,
                               progress_bar=True)
    assert [s["answer"] for s in states] == [f"item {i:02d}" for i in range(5)]
    assert "5/5" in capsys.readouterr().err
    with pytest.raises(TypeError):
        fewshot.run_batch([["a", "b"]], backend=be)
    assert fewshot.run_batch([], backend=be) == []


def test_shared_prefix_needs_agreement() -> None:
    be = ScriptedBackend()

    @sgl.function
    def prog(s, q):
        s += q + sgl.gen("x")

    defaults = GenParams()
    assert shared_prefix(prog, be, [{"q": "alpha one"}, {"q": "beta one"}], defaults) == ""
    assert shared_prefix(prog, be, [{"q": "same text"}, {"q": "same text"}], defaults) == "same text"
    assert be.prompts == []  # the dry run never calls the model
