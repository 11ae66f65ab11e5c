"""SGLang's own test programs (``sglang.test.test_programs``), unchanged, executed by our DSL.

The programs are not copied into this repository: their source is read from the installed ``sglang``
distribution (``pip install sglang==0.5.23 --no-deps``; its server dependencies are not installed, so
the package itself is never imported) and executed with every ``import sglang`` in it resolved to
``frontend``. Two helpers of SGLang's server package that the file imports for its own checks are
stood in for: ``sglang.srt.utils.is_hip`` (False: no ROCm here) and
``sglang.srt.utils.hf_transformers_utils.get_tokenizer`` (the model's tokenizer through transformers).

Each program runs against a live radixserve server through ``frontend.RuntimeEndpoint``, set as the
default backend the way SGLang's own tests set ``sgl.Runtime(...)`` (a handle whose ``.endpoint`` is
the backend). Programs that need no chat template use the tiny random model; the ones built from
``sgl.system/user/assistant`` turns use the default SmolLM2 model. The programs whose assertions
depend on what a capable model answers are skipped, each with its reason (``SKIPPED``).
"""

from __future__ import annotations

import builtins
import importlib.util
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import frontend
import frontend.choices
import frontend.ir
from tests.server_harness import ServerProcess, assert_kv_clean

SGLANG_VERSION = "0.5.23"

# Programs not run, and why. Every test_* function of the file is either run below or listed here
# (test_every_program_is_accounted_for), so a program added by a later SGLang release is not missed.
SKIPPED = {
    "test_few_shot_qa": "model quality: asserts the answers are Washington, Tokyo, London, Beijing",
    "test_decode_int": "model quality: asserts 24 hours in a day and 365 days in a year",
    "test_tool_use": "model quality: evaluates the expression the model writes and asserts 257 * 983",
    "test_react": "model quality: the variable 'answer' exists only if the model picks Finish within four "
                  "steps, and it must name Finland or the States",
    "test_image_qa": "images are out of the DSL's scope (sgl.image)",
    "test_completion_speculative": "API speculative execution (num_api_spec_tokens) belongs to SGLang's "
                                   "OpenAI backend (it reads backend.token_usage) and is not implemented here; "
                                   "its saving also depends on the model following the format",
    "test_chat_completion_speculative": "API speculative execution for chat models (several gens in one "
                                        "assistant turn answered by one chat request) is an OpenAI-backend "
                                        "feature not implemented here",
}


# ---------------------------------------------------------------------------- loading the programs
def programs_file() -> Path:
    """``sglang/test/test_programs.py`` of the installed distribution, found without importing sglang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the sglang package is not installed: pip install sglang=={SGLANG_VERSION} --no-deps")
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_programs.py"
    assert path.is_file(), f"{path} is missing from the installed sglang"
    return path


def _get_tokenizer(model_path: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, **kwargs)


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


# What ``sglang`` and the submodules the programs import resolve to.
ALIASES: dict[str, types.ModuleType] = {
    "sglang": frontend,
    "sglang.lang.ir": frontend.ir,
    "sglang.lang.choices": frontend.choices,
    "sglang.srt.utils": _module("sglang.srt.utils", is_hip=lambda: False),
    "sglang.srt.utils.hf_transformers_utils": _module("sglang.srt.utils.hf_transformers_utils",
                                                      get_tokenizer=_get_tokenizer),
}


def _sglang_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                   level: int = 0) -> Any:
    if level == 0 and (name == "sglang" or name.startswith("sglang.")):
        if name not in ALIASES:
            raise ImportError(f"{name} is not part of the SGLang surface the DSL provides")
        return ALIASES[name] if fromlist else frontend  # ``import sglang.x`` binds the top package
    return builtins.__import__(name, globals, locals, fromlist, level)


def load_programs() -> types.ModuleType:
    """The programs module, its ``sglang`` imports resolved through the module's own ``__import__`` (so
    nothing in ``sys.modules`` changes and a real sglang elsewhere in the process is unaffected)."""
    path = programs_file()
    module = types.ModuleType("sglang_test_programs_on_frontend")
    module.__file__ = str(path)
    module.__dict__["__builtins__"] = {**builtins.__dict__, "__import__": _sglang_import}
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def programs() -> types.ModuleType:
    return load_programs()


# ---------------------------------------------------------------------------- servers and backends
@dataclass
class ServerHandle:
    """What SGLang's ``sgl.Runtime`` is to a program: a handle whose ``.endpoint`` is the backend
    (``test_gen_min_new_tokens`` reads ``global_config.default_backend.endpoint.get_model_name()``)."""

    endpoint: frontend.RuntimeEndpoint


@pytest.fixture(scope="module")
def smol_server() -> Iterator[ServerProcess]:
    server = ServerProcess("default", ["--max-total-tokens", "32768"]).start()
    yield server
    assert_kv_clean(server.url)
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.log()}"


@pytest.fixture(scope="module")
def tiny_handle(tiny_server: ServerProcess) -> Iterator[ServerHandle]:
    handle = ServerHandle(frontend.RuntimeEndpoint(tiny_server.url))
    yield handle
    handle.endpoint.shutdown()


@pytest.fixture(scope="module")
def smol_handle(smol_server: ServerProcess) -> Iterator[ServerHandle]:
    handle = ServerHandle(frontend.RuntimeEndpoint(smol_server.url))
    yield handle
    handle.endpoint.shutdown()


@pytest.fixture
def on_tiny(tiny_handle: ServerHandle, tiny_server: ServerProcess) -> Iterator[ServerHandle]:
    yield from _as_default(tiny_handle, tiny_server)


@pytest.fixture
def on_smol(smol_handle: ServerHandle, smol_server: ServerProcess) -> Iterator[ServerHandle]:
    yield from _as_default(smol_handle, smol_server)


def _as_default(handle: ServerHandle, server: ServerProcess) -> Iterator[ServerHandle]:
    previous = frontend.global_config.default_backend
    frontend.set_default_backend(handle)
    try:
        yield handle
    finally:
        frontend.set_default_backend(previous)
    assert_kv_clean(server.url)  # every request the program sent handed its KV back


def run(programs: types.ModuleType, name: str, **kwargs: Any) -> None:
    program: Callable[..., Any] = getattr(programs, name)
    program(**kwargs)


# ---------------------------------------------------------------------------- the programs
def test_every_program_is_accounted_for(programs: types.ModuleType) -> None:
    names = {n for n, f in vars(programs).items() if n.startswith("test_") and inspect.isfunction(f)}
    ran = {"test_" + n[len("test_program_"):] for n in globals() if n.startswith("test_program_")}
    assert not ran - names, f"programs run here but not in SGLang's file: {sorted(ran - names)}"
    assert names == ran | set(SKIPPED), f"neither run nor skipped: {sorted(names - ran - set(SKIPPED))}"
    assert not ran & set(SKIPPED)


# Tiny random model: the programs' assertions are about mechanics (variables, types, regexes, forks).
def test_program_select(programs: types.ModuleType, on_tiny: ServerHandle) -> None:
    run(programs, "test_select", check_answer=False)  # one of the choices, not the right one


def test_program_expert_answer(programs: types.ModuleType, on_tiny: ServerHandle) -> None:
    run(programs, "test_expert_answer", check_answer=False)


def test_program_parallel_decoding(programs: types.ModuleType, on_tiny: ServerHandle) -> None:
    run(programs, "test_parallel_decoding")  # forks[i] += ..., join, then each fork's variable


def test_program_parallel_encoding(programs: types.ModuleType, on_tiny: ServerHandle) -> None:
    # join(mode="concate_and_append") appends the forks' text (SGLang's own server has no KV-level
    # concatenation endpoint; the DSL concatenates text, which any server serves).
    run(programs, "test_parallel_encoding", check_answer=False)


def test_program_regex(programs: types.ModuleType, on_tiny: ServerHandle) -> None:
    run(programs, "test_regex")


def test_program_dtype_gen(programs: types.ModuleType, on_tiny: ServerHandle) -> None:
    run(programs, "test_dtype_gen")


# SmolLM2: chat turns (sgl.system/user/assistant), and JSON built from regex-constrained pieces. SGLang's
# number regexes admit text JSON rejects ("+.1", "-") and its string regex has no length bound, so the JSON
# programs need a model that writes plausible values (the tiny random model does not); the assertions
# themselves are about mechanics (the text parses, the types are right).
@pytest.mark.slow
def test_program_decode_json_regex(programs: types.ModuleType, on_smol: ServerHandle) -> None:
    run(programs, "test_decode_json_regex")


@pytest.mark.slow
def test_program_decode_json(programs: types.ModuleType, on_smol: ServerHandle) -> None:
    run(programs, "test_decode_json")


@pytest.mark.slow
def test_program_mt_bench(programs: types.ModuleType, on_smol: ServerHandle) -> None:
    run(programs, "test_mt_bench")


@pytest.mark.slow
def test_program_stream(programs: types.ModuleType, on_smol: ServerHandle) -> None:
    run(programs, "test_stream")


@pytest.mark.slow
def test_program_stream_logprobs(programs: types.ModuleType, on_smol: ServerHandle) -> None:
    run(programs, "test_stream_logprobs")  # text_async_iter("answer", return_meta_data=True)


@pytest.mark.slow
def test_program_gen_min_new_tokens(programs: types.ModuleType, on_smol: ServerHandle) -> None:
    run(programs, "test_gen_min_new_tokens")
