"""The import graph, read from the source: layers only import downwards, and no module imports
itself back through others. Every import counts, lazy and type-checking ones included: a lazy
import is still a dependency, and a circle that only type checkers see still knots two modules.

Layers, bottom up: ``kvroute`` (the shared floor) < ``gateway`` and ``replica`` (neither imports
the other) < ``launcher`` (the ``kvroute`` command, ``kvroute up``) < ``loadtests``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYER = {"kvroute": 0, "gateway": 1, "replica": 1, "launcher": 2, "loadtests": 3}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` is ``a.b.c`` when that is a module)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in LAYER and name in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for top in LAYER for p in (ROOT / top).rglob("*.py")]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) - {module_name(p)} for p in paths}


def test_layers_only_import_downwards() -> None:
    wrong = []
    for module, imported in import_graph().items():
        top = module.split(".")[0]
        for target in imported:
            other = target.split(".")[0]
            if other != top and LAYER[other] >= LAYER[top]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)


def test_the_graph_is_read() -> None:
    """The checks above would pass on an empty graph: make sure the walk sees real edges."""
    graph = import_graph()
    assert "kvroute.protocol" in graph["replica.publisher"]
    assert "gateway.app" in graph["launcher.cli"] or any(
        m.startswith("gateway.") for m in graph["launcher.cli"]
    )
