"""Every request option is declared once: in ``RequestOptions``, which the intake's ``SingleRequest``, the wire's
``TokenizedRequest`` and the scheduler's ``Req`` hold by reference.

The check reads the source of every dataclass under runtime/ (no import needed, so no module escapes it): a
dataclass that declares a field named like one of ``RequestOptions``' is a second declaration of that option,
unless it is listed in ``OTHER_MEANING`` with the reason the name means something else there.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from runtime.core.messages import RequestOptions, TokenizedRequest
from runtime.core.sampling_params import SamplingParams
from runtime.request.intake import SingleRequest
from runtime.scheduler.req import Req

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
OPTIONS = {f.name for f in dataclasses.fields(RequestOptions)}

# (file under runtime/, class, field): why the name is not a request option there
OTHER_MEANING: dict[tuple[str, str, str], str] = {
    ("executor/sampling_batch.py", "SamplingBatch", "return_logprob"):
        "a batch's per-row mask tensor, built from the rows' options when the batch is sampled",
    ("bench/compare.py", "CompareOptions", "timeout"): "a benchmark client's HTTP timeout",
}


def dataclass_fields(source: str) -> dict[str, set[str]]:
    """Class name -> the fields it declares, for every ``@dataclass`` class in ``source``."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            continue
        out[node.name] = {
            s.target.id for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and "ClassVar" not in ast.unparse(s.annotation)
        }
    return out


def redeclared(files: dict[str, str]) -> set[tuple[str, str, str]]:
    """(file, class, field) of every option declared outside RequestOptions."""
    found = set()
    for rel, source in files.items():
        for cls, names in dataclass_fields(source).items():
            if (rel, cls) == ("core/messages.py", "RequestOptions"):
                continue
            found |= {(rel, cls, name) for name in names & OPTIONS}
    return found


def runtime_sources() -> dict[str, str]:
    return {p.relative_to(RUNTIME).as_posix(): p.read_text() for p in RUNTIME.rglob("*.py")}


def test_no_dataclass_redeclares_a_request_option() -> None:
    found = redeclared(runtime_sources())
    unexplained = found - set(OTHER_MEANING)
    assert not unexplained, f"declared again outside RequestOptions: {sorted(unexplained)}"
    stale = set(OTHER_MEANING) - found
    assert not stale, f"OTHER_MEANING lists fields that are gone: {sorted(stale)}"


def test_the_check_catches_a_redeclaration() -> None:
    """The scan itself: re-declaring an option on the wire message is found."""
    sources = runtime_sources()
    patched = sources["core/messages.py"].replace(
        "class TokenizedRequest:\n", "class TokenizedRequest:\n    top_logprobs_num: int = 0\n")
    assert patched != sources["core/messages.py"]
    assert ("core/messages.py", "TokenizedRequest", "top_logprobs_num") in redeclared({"core/messages.py": patched})


def test_request_types_hold_the_options_object() -> None:
    for cls in (SingleRequest, TokenizedRequest, Req):
        names = {f.name for f in dataclasses.fields(cls)}
        assert not names & OPTIONS, (cls.__name__, names & OPTIONS)
        assert typing.get_type_hints(cls)["options"] is RequestOptions, cls.__name__


def test_the_options_object_travels_by_reference() -> None:
    opts = RequestOptions(return_logprob=True, top_logprobs_num=3, cache_namespace="ns", priority=2, stream=True)
    single = SingleRequest("r", None, [1, 2, 3], SamplingParams(max_new_tokens=4), opts)
    req = Req.from_message(single.message(), seed=7, eos_ids=frozenset())
    assert req.options is opts
    assert req.return_logprob and req.top_logprobs_num == 3  # the sampler's row view reads the same object
