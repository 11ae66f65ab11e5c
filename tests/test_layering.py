"""The packages' floors: a module imports only modules on its own floor or below, and no import cycle.

The floors are the architecture of docs/ARCHITECTURE.md. Imports inside functions count too (a lazy import is
still a dependency); only ``typing.TYPE_CHECKING`` blocks are exempt, since they never run.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("radix", "runtime", "frontend", "router")

# unit -> floor. A unit is a package (runtime.<sub>) or a top-level runtime module; most specific wins.
FLOORS: dict[str, int] = {
    "radix": 0, "runtime.config": 0, "runtime.logging_setup": 0, "runtime.build_cache": 0,
    "runtime.core": 1, "runtime.kernels": 1, "runtime.distributed": 1,
    "runtime.constrained": 2, "runtime.attention": 2,
    "runtime.models": 3, "runtime.parsers": 3, "runtime.request": 3,
    "runtime.executor": 4, "runtime.speculative": 4,
    "runtime.scheduler": 5,
    "runtime.server": 6, "runtime.engine": 6,
    "runtime.http": 7,
    "runtime.launch": 8, "runtime.bench": 8, "runtime.cli_top": 8,
    "router": 9, "frontend": 9,
    "runtime.cli": 10,
}


def unit_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in FLOORS:
            return name
    raise AssertionError(f"{module} belongs to no floor; add its package to FLOORS")


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def module_imports() -> dict[str, set[str]]:
    """Every project module and the project modules it imports (resolved to modules, not names)."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from pkg import mod" imports a module; "from mod import name" the module itself
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            for target in targets:
                if target.split(".")[0] in PACKAGES and target != mod:
                    graph[mod].add(target)
        graph.setdefault(mod, set())
    return graph


def test_no_module_imports_a_higher_floor() -> None:
    upward = sorted(
        f"{mod} (floor {FLOORS[unit_of(mod)]}) imports {dep} (floor {FLOORS[unit_of(dep)]})"
        for mod, deps in module_imports().items() for dep in deps
        if FLOORS[unit_of(dep)] > FLOORS[unit_of(mod)])
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    graph = module_imports()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (cycle := visit(mod)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_checker_sees_a_violation() -> None:
    """The floors test is not vacuous: the real graph has edges between floors, and an upward edge is caught."""
    graph = module_imports()
    assert "runtime.core.messages" in graph["runtime.scheduler.scheduler"] | graph["runtime.scheduler.req"]
    assert FLOORS[unit_of("runtime.http.app")] > FLOORS[unit_of("runtime.server.tokenizer_manager")]
