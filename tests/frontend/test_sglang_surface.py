"""The DSL's public surface against SGLang's frontend: names, signatures and return shapes.

Signatures are compared with the installed SGLang source (read with ``ast``: the package's server
dependencies are not installed, so it is never imported). The behaviour behind the new surface (fork
item assignment, streamed meta_info, ``n``, ``stop_regex``, ``use_thread``, ``generator_style``,
``cache``, ``global_config``) is checked offline against a scripted backend, and ``n`` and streamed
logprobs also against the tiny-model server.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import time
from collections.abc import Iterator
from typing import Any

import pytest

import frontend as sgl
from frontend.backends.base import BaseBackend
from frontend.chat import ChatTemplate
from frontend.ir import GenParams
from frontend.stream_meta import StreamMeta, merge_increments
from tests.frontend.test_sglang_programs import programs_file

# SGLang names the DSL does not provide, and why.
NOT_PROVIDED = {
    "image": "images are out of scope", "video": "video is out of scope",
    "separate_reasoning": "reasoning separation is not implemented",
    "Engine": "SGLang's in-process server; the DSL's is EngineBackend", "ServerArgs": "SGLang's server config",
    "Anthropic": "vendor backend", "Crusoe": "vendor backend", "LiteLLM": "vendor backend",
    "VertexAI": "vendor backend", "__version__": "the package version is radixserve's",
}


# ---------------------------------------------------------------------------- signatures
def sglang_tree(relpath: str) -> ast.Module:
    root = programs_file().parent.parent  # .../sglang
    return ast.parse((root / relpath).read_text())


def _defs(body: list[ast.stmt]) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _class(tree: ast.Module, name: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return _defs(node.body)


def assert_compatible(theirs: ast.FunctionDef | ast.AsyncFunctionDef, ours: Any, where: str) -> None:
    """Every call SGLang's signature accepts, ours accepts: its positional parameters are a prefix of ours
    (same names, same order), its keyword-only ones exist, and ``*args``/``**kwargs`` where it has them."""
    a = theirs.args
    positional = [p.arg for p in a.posonlyargs + a.args if p.arg != "self"]
    params = [p for p in inspect.signature(ours).parameters.values() if p.name != "self"]
    our_positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert our_positional[:len(positional)] == positional, f"{where}: {our_positional} vs SGLang's {positional}"
    names = {p.name for p in params}
    missing = [k.arg for k in a.kwonlyargs if k.arg not in names]
    assert not missing, f"{where}: no keyword(s) {missing}"
    kinds = {p.kind for p in params}
    if a.vararg:
        assert inspect.Parameter.VAR_POSITIONAL in kinds, f"{where}: no *{a.vararg.arg}"
    if a.kwarg:
        assert inspect.Parameter.VAR_KEYWORD in kinds, f"{where}: no **{a.kwarg.arg}"


def test_every_sglang_name_is_provided() -> None:
    tree = sglang_tree("__init__.py")
    exported = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    missing = [name for name in exported if name not in NOT_PROVIDED and not hasattr(sgl, name)]
    assert not missing, missing


@pytest.mark.parametrize("name", ["function", "set_default_backend", "flush_cache", "get_server_info", "gen",
                                  "gen_int", "gen_string", "select", "system", "user", "assistant",
                                  "system_begin", "system_end", "user_begin", "user_end", "assistant_begin",
                                  "assistant_end"])
def test_api_functions(name: str) -> None:
    assert_compatible(_defs(sglang_tree("lang/api.py").body)[name], getattr(sgl, name), name)


@pytest.mark.parametrize(("path", "cls", "ours", "methods"), [
    ("lang/ir.py", "SglFunction", sgl.SglFunction, ["__init__", "bind", "run", "run_batch", "cache", "__call__"]),
    ("lang/interpreter.py", "ProgramState", sgl.ProgramState,
     ["system", "user", "assistant", "var_scope", "fork", "copy", "text", "messages", "sync", "error", "text_iter",
      "text_async_iter", "get_var", "set_var", "get_meta_info", "__iadd__", "__getitem__", "__setitem__",
      "__contains__"]),
    ("lang/interpreter.py", "ProgramStateGroup", sgl.ProgramStateGroup,
     ["__init__", "join", "__getitem__", "__setitem__", "__iadd__"]),
    ("lang/backend/runtime_endpoint.py", "RuntimeEndpoint", sgl.RuntimeEndpoint,
     ["__init__", "get_model_name", "flush_cache", "get_server_info", "get_chat_template", "cache_prefix",
      "commit_lazy_operations"]),
])
def test_class_methods(path: str, cls: str, ours: type, methods: list[str]) -> None:
    theirs = _class(sglang_tree(path), cls)
    for m in methods:
        mine = getattr(ours, m)
        assert_compatible(theirs[m], mine, f"{cls}.{m}")
        is_async = inspect.isasyncgenfunction(mine) or inspect.iscoroutinefunction(mine)
        assert isinstance(theirs[m], ast.AsyncFunctionDef) == is_async, f"{cls}.{m}: async in one only"


def test_dtype_regexes_live_in_the_ir_module() -> None:
    assigned = {t.id: ast.literal_eval(n.value) for n in sglang_tree("lang/ir.py").body if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name) and t.id.startswith("REGEX_")}
    assert assigned and all(getattr(sgl.ir, k) == v for k, v in assigned.items())


# ---------------------------------------------------------------------------- behaviour, offline
class Scripted(BaseBackend):
    """Streams ``reply`` one character per frame, each frame's meta_info holding one logprob entry per
    character so far (cumulative, as radixserve sends them); records the params it was asked with."""

    def __init__(self, reply: str = "abc") -> None:
        self.chat_template = ChatTemplate.chatml()
        self.reply = reply
        self.params: list[GenParams] = []
        self.prefixes: list[str] = []

    def cache_prefix(self, prefix: str) -> dict[str, Any]:
        self.prefixes.append(prefix)
        return {"prompt_tokens": len(prefix)}

    def generate(self, s: Any, params: GenParams) -> Any:
        self.params.append(params)
        if (params.n or 1) > 1:
            return [f"{self.reply}{i}" for i in range(params.n or 1)], [{"i": i} for i in range(params.n or 1)]
        return self.reply, self._meta(len(self.reply))

    def generate_stream(self, s: Any, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        self.params.append(params)
        for i, ch in enumerate(self.reply):
            time.sleep(0.01)
            yield ch, self._meta(i + 1)
        yield "", self._meta(len(self.reply))  # a final frame without text

    @staticmethod
    def _meta(k: int) -> dict[str, Any]:
        return {"completion_tokens": k, "output_token_logprobs": [[-0.5, i, None] for i in range(k)]}


def test_fork_item_assignment() -> None:
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f"branch {i}: " + sgl.gen("x")
        forks.join()
        with pytest.raises(TypeError):
            forks[0] = forks[1]

    state = prog.run(backend=Scripted())
    assert state["x"] == ["abc", "abc"]


def test_stream_meta_reads_cumulative_and_incremental_frames_alike() -> None:
    entries = [[-float(i), i, None] for i in range(5)]
    cumulative, incremental = StreamMeta(), StreamMeta()
    for upto, start in ((2, 0), (2, 2), (5, 2)):  # the middle frame brings no new token
        a, full = cumulative.feed({"completion_tokens": upto, "output_token_logprobs": entries[:upto]})
        b, _ = incremental.feed({"completion_tokens": upto, "output_token_logprobs": entries[start:upto]})
        assert a == b and a["output_token_logprobs"] == entries[start:upto]
        assert a["output_token_logprobs_length"] == upto and full["output_token_logprobs"] == entries[:upto]
    merged = merge_increments([{"output_token_logprobs": [1]}, {"output_token_logprobs": [2], "k": 3}])
    assert merged == {"output_token_logprobs": [1, 2], "k": 3}


def test_text_async_iter_with_meta_data() -> None:
    @sgl.function
    def prog(s):
        s += "Q: " + sgl.gen("answer", return_logprob=True)

    async def collect(**kwargs: Any) -> list[Any]:
        state = prog.run(backend=Scripted("hello"), **kwargs)
        return [chunk async for chunk in state.text_async_iter("answer", return_meta_data=True)]

    chunks = asyncio.run(collect(stream=True))
    assert "".join(text for text, _ in chunks) == "hello"
    assert [len(meta["output_token_logprobs"]) for _, meta in chunks] == [1] * 5
    assert [meta["output_token_logprobs_length"] for _, meta in chunks] == [1, 2, 3, 4, 5]
    (value, meta), = asyncio.run(collect())  # not streamed: the variable and its whole meta_info
    assert value == "hello" and len(meta["output_token_logprobs"]) == 5

    state = prog.run(backend=Scripted("hello"), stream=True)
    assert "".join(state.text_iter("answer")) == "hello"
    assert len(state.get_meta_info("answer")["output_token_logprobs"]) == 5  # cumulative once done
    assert list(prog.run(backend=Scripted(), stream=True).text_iter("never_defined")) == [""]


def test_gen_parameters_in_sglang_order_reach_the_request() -> None:
    be = Scripted("12")

    @sgl.function
    def prog(s):
        s += sgl.gen("a", 5, 2, 3, stop_regex=r"\d+")
        s += sgl.gen_int("b", 7)

    state = prog.run(backend=be, stop_regex="x")
    assert state.error() is None and state["b"] == 12
    a, b = be.params
    assert (a.max_new_tokens, a.min_new_tokens, a.n, a.stop_regex) == (5, 2, 3, r"\d+")
    assert a.to_native()["stop_regex"] == [r"\d+"] and a.to_native()["n"] == 3
    assert b.max_new_tokens == 7 and b.dtype == "int" and b.to_native()["stop_regex"] == ["x"]
    assert "n" not in b.to_native() and "stop_regex" not in GenParams().to_native()
    assert state["a"] == ["120", "121", "122"] and state.text() == "12012"
    with pytest.raises(ValueError):
        sgl.gen("x", n=0)
    with pytest.raises(Exception):  # noqa: B017 - re.error: an invalid pattern fails in the program
        sgl.gen("x", stop_regex="(")


def test_run_options_and_global_config(capsys: pytest.CaptureFixture[str]) -> None:
    be = Scripted()

    @sgl.function
    def prog(s, q):
        s += "A fixed instruction long enough to be worth caching on its own, for every question. " + q
        s += sgl.gen("a")

    state = prog.run("one", backend=be, use_thread=False)
    assert state["a"] == "abc" and state.stream_executor.use_thread is False
    states: Any = prog.run_batch([{"q": "x"}, {"q": "y"}, ("z",)], backend=be, generator_style=True,
                            num_threads=2, progress_bar=False)
    assert isinstance(states, Iterator) and not isinstance(states, list)  # yielded as they finish
    assert [s.text()[-4:] for s in states] == ["xabc", "yabc", "zabc"]
    meta = prog.cache(backend=be)
    assert meta is not None and be.prefixes[-1].endswith("every question.")

    previous = sgl.global_config.default_backend
    try:
        sgl.set_default_backend(None)
        assert sgl.flush_cache() is False and sgl.get_server_info() is None
        sgl.set_default_backend(be)
        assert sgl.global_config.default_backend is be and sgl.get_default_backend() is be
        sgl.global_config.verbosity = 2
        prog.run("v")
        assert "every question. vabc" in capsys.readouterr().out
    finally:
        sgl.global_config.verbosity = 0
        sgl.set_default_backend(previous)


# ---------------------------------------------------------------------------- behaviour, live (tiny model)
def test_n_samples_on_the_server(endpoint: sgl.RuntimeEndpoint) -> None:
    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen("x", max_tokens=4, n=3, temperature=1.0, ignore_eos=True)

    state = prog.run(backend=endpoint)
    assert isinstance(state["x"], list) and len(state["x"]) == 3
    metas = state.get_meta_info("x")
    assert [m["completion_tokens"] for m in metas] == [4, 4, 4]
    assert state.text() == "Once upon a time" + state["x"][0]


def test_streamed_logprobs_from_the_server(endpoint: sgl.RuntimeEndpoint) -> None:
    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen("x", max_tokens=12, return_logprob=True, ignore_eos=True)

    async def collect() -> list[Any]:
        state = prog.run(backend=endpoint, stream=True, temperature=0)
        return [c async for c in state.text_async_iter("x", return_meta_data=True)]

    chunks = asyncio.run(collect())
    assert chunks and all(text for text, _ in chunks)
    prev = 0
    for _, meta in chunks:
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        prev = meta["completion_tokens"]
    plain = prog.run(backend=endpoint, temperature=0)
    assert "".join(t for t, _ in chunks) == plain["x"]
    ids = [e[1] for _, meta in chunks for e in meta["output_token_logprobs"]]
    assert ids == [e[1] for e in plain.get_meta_info("x")["output_token_logprobs"]][:len(ids)]

