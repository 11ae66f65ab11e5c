"""Where the benchmark tool writes, and how it writes paths into reports without machine-specific parts.

Generated pages (docs/benchmarks.md) are read on other machines, so a command recorded in them must not
carry the absolute paths of the machine that ran it: the interpreter becomes ``python``, files of the
checkout become relative to it, installed packages ``<site-packages>/...``, the home folder ``~``, and any
other absolute path ``<abs>/<last part>``.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def in_checkout() -> bool:
    """True when running from a source checkout (an editable install), not from an installed wheel."""
    return (REPO / "pyproject.toml").is_file() and (REPO / "runtime" / "bench").is_dir()


def default_results_root() -> Path:
    """``bench_results/`` of the checkout, or of the working directory for an installed package."""
    return (REPO if in_checkout() else Path.cwd()) / "bench_results"


def docs_page() -> Path:
    """The checkout's docs/benchmarks.md (what ``--update-docs`` rewrites)."""
    if not in_checkout():
        raise FileNotFoundError("docs/benchmarks.md belongs to a source checkout; this radixserve is installed "
                                "from a package (pass --docs PAGE or --local)")
    return REPO / "docs" / "benchmarks.md"


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_SITE = re.compile(r"/(?:site|dist)-packages/(.*)$")


def portable_path(text: str, base: Path | None = None) -> str:
    """``text`` unchanged unless it is an absolute path; then a form that names no machine."""
    if not text.startswith("/"):
        return text
    base = Path(base) if base is not None else REPO
    path = Path(text)
    if text in (sys.executable, os.path.realpath(sys.executable)) or (
            path.parent.name == "bin" and _PYTHON.fullmatch(path.name)):
        return "python"
    site = _SITE.search(text)
    if site:
        return f"<site-packages>/{site.group(1)}"
    try:
        rel = path.relative_to(base)
        return str(rel) if str(rel) != "." else "."
    except ValueError:
        pass
    home = Path.home()
    try:
        return f"~/{path.relative_to(home)}"
    except ValueError:
        pass
    for prefix in ("/root/", "/home/"):  # a report written on another machine
        if text.startswith(prefix):
            rest = text[len(prefix):] if prefix == "/root/" else text[len(prefix):].partition("/")[2]
            return f"~/{rest}" if rest else "~"
    return f"<abs>/{path.name}" if path.name else "<abs>"


def _join(parts: list[str]) -> str:
    """A readable command line: arguments quoted only when they hold spaces or quotes (the ``<...>``
    placeholders are for reading, not for pasting into a shell)."""
    return " ".join(shlex.quote(p) if not p or re.search(r"[\s'\"]", p) else p for p in parts)


def portable_command(cmd: list[str], base: Path | None = None) -> str:
    """A command line with every path argument made portable (``--opt=/path`` forms too)."""
    out = []
    for part in cmd:
        opt, eq, value = part.partition("=")
        if eq and opt.startswith("-") and value.startswith("/"):
            out.append(f"{opt}={portable_path(value, base)}")
        else:
            out.append(portable_path(part, base))
    return _join(out)


def portable_text(text: str, base: Path | None = None) -> str:
    """Free text (a recorded command, "in-process: ... (fp32, /root/.cache/x)") with each absolute path made
    portable; URLs and relative paths are left alone."""
    return re.sub(r"(?<![\w<>~.:/])/[^\s,;()`'\"]+", lambda m: portable_path(m.group(0), base), text)
