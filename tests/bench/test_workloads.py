"""The built-in benchmark workloads: seeded and deterministic, the documented sizes and prefix-sharing
structure, and workload files (the format ``--workload-file`` reads)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.bench.workload_files import dump_workload, load_workload_file
from runtime.bench.workloads import QUICK_PARAMS, WORKLOADS, agent_system_prompt, make, make_workload, parse_params

REPO = Path(__file__).resolve().parents[2]


def _user_texts(wl: dict[str, Any]) -> list[str]:
    if wl["kind"] == "independent":
        return [r["body"]["prompt"] if r["endpoint"] == "completions" else r["body"]["messages"][-1]["content"]
                for r in wl["requests"]]
    return [m["content"] for s in wl["sessions"] for step in s["steps"] for m in step["append"]]


# ---------------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_same_seed_same_requests_other_seed_other_text(name: str) -> None:
    a, b = make(name, seed=3), make(name, seed=3)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    other = make(name, seed=4)
    assert _user_texts(other) != _user_texts(a)
    assert a["params"]["seed"] == 3 and a["name"] == name


# The default workloads, byte for byte. String seeds are hashed with SHA-512 by random.Random, so these hold
# on every machine and supported Python; a change here changes every benchmark figure and must be deliberate
# (say so in docs/benchmarks.md).
PINNED = {"fewshot": "8d191b0770121644", "multiturn": "b345312b98b45515", "parallel": "74b096083f32afea",
          "agent": "0e6e28c1e3c8c80c"}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_default_workloads_are_pinned(name: str) -> None:
    digest = hashlib.sha256(json.dumps(make(name), sort_keys=True).encode()).hexdigest()[:16]
    assert digest == PINNED[name]


# ---------------------------------------------------------------------------------------------- structure
def test_fewshot_one_shared_block_then_distinct_questions() -> None:
    wl = make("fewshot")
    reqs = wl["requests"]
    assert wl["kind"] == "independent" and len(reqs) == 64
    prefix = reqs[0]["body"]["prompt"][: wl["shared_prefix_chars"]]
    assert prefix.count("Question: ") == 30 and prefix.count("\nAnswer: ") == 30
    for r in reqs:
        assert r["endpoint"] == "completions"
        assert r["body"]["prompt"].startswith(prefix) and r["body"]["prompt"].endswith("\nAnswer:")
        assert r["body"]["max_tokens"] == 16 and r["body"]["temperature"] == 0.0
    tails = [r["body"]["prompt"][len(prefix):] for r in reqs]
    assert len(set(tails)) >= 60  # a few random questions may repeat; the block must not vary
    assert len({r["id"] for r in reqs}) == 64
    small = make("fewshot", questions=5, examples=4, max_tokens=3)
    assert len(small["requests"]) == 5 and small["requests"][0]["body"]["max_tokens"] == 3
    assert small["requests"][0]["body"]["prompt"][: small["shared_prefix_chars"]].count("Question: ") == 4


def test_fewshot_answers_are_correct() -> None:
    # The examples teach the model the task; a wrong one would make the benchmark's outputs meaningless.
    checks = [
        (r"had (\d+) .* and received (\d+) more", r"It has (\d+)\.", lambda a, b: a + b),
        (r"holds (\d+) .* in (\d+) ", r"There are (\d+)\.", lambda a, b: a * b),
        (r"had (\d+) euros and spent (\d+) ", r"(\d+) euros are left\.", lambda a, b: a - b),
        (r"at (\d+):00 for a (\d+)-hour trip", r"It arrives at (\d+):00\.", lambda a, b: a + b),
    ]
    checked = 0
    for seed in range(3):
        prefix = make("fewshot", seed=seed, questions=1)["requests"][0]["body"]["prompt"]
        for block in prefix.split("Question: ")[1:-1]:
            question, answer = block.strip().split("\nAnswer: ")
            for q_pattern, a_pattern, expected in checks:
                q = re.search(q_pattern, question)
                if q:
                    a = re.fullmatch(a_pattern, answer)
                    assert a is not None and int(a.group(1)) == expected(int(q.group(1)), int(q.group(2))), block
                    checked += 1
    assert checked >= 20


def test_multiturn_sessions_share_the_system_prompt_and_grow() -> None:
    wl = make("multiturn")
    sessions = wl["sessions"]
    assert wl["kind"] == "sessions" and len(sessions) == 8
    systems = {json.dumps(s["messages"]) for s in sessions}
    assert len(systems) == 1 and sessions[0]["messages"][0]["role"] == "system"
    for s in sessions:
        assert s["endpoint"] == "chat" and len(s["steps"]) == 4
        for step in s["steps"]:
            assert [m["role"] for m in step["append"]] == ["user"]
            assert step["body"] == {"max_tokens": 32, "temperature": 0.0}
    firsts = [s["steps"][0]["append"][0]["content"] for s in sessions]
    assert len(set(firsts)) == 8
    assert len(make("multiturn", sessions=3, turns=2)["sessions"][2]["steps"]) == 2


def test_parallel_n_samples_of_distinct_prompts() -> None:
    wl = make("parallel")
    reqs = wl["requests"]
    assert wl["kind"] == "independent" and len(reqs) == 8
    assert [r["body"]["seed"] for r in reqs] == list(range(1000, 1008))
    for r in reqs:
        body = r["body"]
        assert r["endpoint"] == "chat" and body["n"] == 8 and body["temperature"] == 0.8 and body["top_p"] == 1.0
        assert body["max_tokens"] == 32 and [m["role"] for m in body["messages"]] == ["system", "user"]
    assert len({r["body"]["messages"][0]["content"] for r in reqs}) == 1
    assert len({r["body"]["messages"][1]["content"] for r in reqs}) == 8


def test_agent_sessions_share_the_tool_prompt_and_append_tool_output() -> None:
    wl = make("agent")
    sessions = wl["sessions"]
    assert wl["kind"] == "sessions" and len(sessions) == 8
    system = agent_system_prompt()
    assert wl["shared_prefix_chars"] == len(system)
    for s in sessions:
        assert [m["role"] for m in s["messages"]] == ["system", "user"]
        assert s["messages"][0]["content"] == system
        assert len(s["steps"]) == 5 and s["steps"][0]["append"] == []
        for step in s["steps"][1:]:
            assert len(step["append"]) == 1 and step["append"][0]["content"].startswith("OUTPUT of ")
    assert len({s["messages"][1]["content"] for s in sessions}) == 8


def test_sizes_in_tokens_match_the_reference_shapes(smol_dir: Path) -> None:
    """The token sizes the benchmark figures were measured with (default model's tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir))

    def n(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)

    def chat(messages: list[dict[str, Any]]) -> int:
        return len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])

    few = make("fewshot")
    assert 980 <= n(few["requests"][0]["body"]["prompt"][: few["shared_prefix_chars"]]) <= 1080
    prompts = [n(r["body"]["prompt"]) for r in few["requests"]]
    assert 1000 <= sum(prompts) / len(prompts) <= 1110
    multi = make("multiturn")
    first = [chat(s["messages"] + s["steps"][0]["append"]) for s in multi["sessions"]]
    assert 85 <= sum(first) / len(first) <= 115
    later = [n(step["append"][0]["content"]) for s in multi["sessions"] for step in s["steps"][1:]]
    assert 35 <= sum(later) / len(later) <= 55
    par = [chat(r["body"]["messages"]) for r in make("parallel")["requests"]]
    assert 95 <= sum(par) / len(par) <= 120
    assert 620 <= n(agent_system_prompt()) <= 700
    results = [n(step["append"][0]["content"]) for s in make("agent")["sessions"] for step in s["steps"][1:]]
    assert min(results) >= 30 and max(results) <= 160 and 65 <= sum(results) / len(results) <= 100


# ---------------------------------------------------------------------------------------------- parameters
def test_quick_sizes_and_overrides() -> None:
    for name, params in QUICK_PARAMS.items():
        wl = make_workload(name, quick=True)
        assert all(wl["params"][k] == v for k, v in params.items())
    assert len(make_workload("fewshot", True, {"questions": 3})["requests"]) == 3
    with pytest.raises(ValueError, match="no parameter"):
        make_workload("fewshot", overrides={"sessions": 2})
    # compare applies one set to every workload: strict=False drops what a workload does not take
    assert len(make_workload("agent", overrides={"questions": 2, "agents": 1}, strict=False)["sessions"]) == 1
    with pytest.raises(ValueError, match="unknown workload"):
        make("nope")


def test_parse_params() -> None:
    assert parse_params(["questions=16", "temperature=0.5", "label=x"]) == {
        "questions": 16, "temperature": 0.5, "label": "x"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_params(["questions"])


# ---------------------------------------------------------------------------------------------- files
@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_workload_file_round_trip(tmp_path: Path, name: str, suffix: str) -> None:
    wl = make_workload(name, quick=True)
    back = load_workload_file(dump_workload(wl, tmp_path / f"{name}{suffix}"))
    key = "sessions" if wl["kind"] == "sessions" else "requests"
    assert back["kind"] == wl["kind"] and back[key] == wl[key]
    assert back["name"] == name and back["source"] == f"{name}{suffix}"


def test_workload_file_shorthand_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    lines = [{"prompt": "Once upon a time", "max_tokens": 4, "model": "x", "stream": False},
             {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
             {"id": "third", "body": {"prompt": "Hello", "max_tokens": 2}},
             {"id": "fourth", "endpoint": "chat", "body": {"messages": [{"role": "user", "content": "Yo"}]}}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    wl = load_workload_file(path)
    assert wl["name"] == "mine" and wl["kind"] == "independent"
    assert [r["id"] for r in wl["requests"]] == ["mine-000", "mine-001", "third", "fourth"]
    assert [r["endpoint"] for r in wl["requests"]] == ["completions", "chat", "completions", "chat"]
    assert wl["requests"][0]["body"] == {"prompt": "Once upon a time", "max_tokens": 4}  # client fields dropped
    assert wl["params"] == {"file": "mine.jsonl", "requests": 4}

    sessions = tmp_path / "chats.json"
    sessions.write_text(json.dumps({"name": "chats", "sessions": [
        {"messages": [{"role": "system", "content": "Be brief."}],
         "steps": [{"append": [{"role": "user", "content": "One?"}], "body": {"max_tokens": 3}},
                   {"append": [{"role": "user", "content": "Two?"}]}]}]}))
    wl = load_workload_file(sessions)
    assert wl["kind"] == "sessions" and wl["sessions"][0]["id"] == "chats-000"
    assert wl["sessions"][0]["steps"][1] == {"append": [{"role": "user", "content": "Two?"}], "body": {}}


@pytest.mark.parametrize(("content", "suffix", "error"), [
    ('{"prompt": "a"}\n{"steps": [{"append": []}]}\n', ".jsonl", "mixes sessions"),
    ('{"prompt": "a"}\nnot json\n', ".jsonl", r"x\.jsonl:2: not JSON"),
    ('[{"max_tokens": 3}]', ".json", "needs \"prompt\""),
    ('[{"endpoint": "embeddings", "body": {"prompt": "a"}}]', ".json", "endpoint must be"),
    ('[{"messages": "hello"}]', ".json", "messages must be a list"),
    ('[{"steps": []}]', ".json", "non-empty"),
    ('[{"steps": [{"body": {"prompt": "a"}}]}]', ".json", "takes no messages/prompt"),
    ('[{"id": "a", "body": {"prompt": "a"}}, {"id": "a", "body": {"prompt": "b"}}]', ".json", "duplicate ids"),
    ('{"kind": "sessions", "requests": [{"prompt": "a"}]}', ".json", "kind is 'sessions'"),
    ("[]", ".json", "no requests"),
    ("3", ".json", "expected a workload object"),
])
def test_workload_file_errors_name_the_problem(tmp_path: Path, content: str, suffix: str, error: str) -> None:
    path = tmp_path / f"x{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError, match=error):
        load_workload_file(path)


def test_missing_workload_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_workload_file(tmp_path / "absent.json")


# ---------------------------------------------------------------------------------------------- CLI
def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "runtime.cli", "bench", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_cli_writes_a_workload_file_that_reads_back(tmp_path: Path) -> None:
    out = tmp_path / "agent.jsonl"
    proc = _cli("workload", "agent", "--quick", "--param", "steps=3", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "agent: 2 sessions, 6 requests" in proc.stdout
    assert load_workload_file(out)["sessions"] == make("agent", agents=2, steps=3)["sessions"]


def test_cli_rejects_bad_input_with_a_message(tmp_path: Path) -> None:
    proc = _cli("workload", "fewshot", "--param", "sessions=2")
    assert proc.returncode == 2 and "no parameter" in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    proc = _cli("run", "--url", "http://127.0.0.1:9", "--workload-file", str(bad), "--no-optimum")
    assert proc.returncode == 2 and "expected a JSON object" in proc.stderr
    proc = _cli("run", "--url", "http://127.0.0.1:9", "--workload-file", str(bad), "--quick")
    assert proc.returncode == 2 and "--quick and --param" in proc.stderr
    proc = _cli("run", "--url", "http://127.0.0.1:9")
    assert proc.returncode == 2 and "--workload" in proc.stderr
