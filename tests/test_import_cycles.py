"""No import cycle between the package's modules: counting every import, those at module level and
also those inside functions and under ``if TYPE_CHECKING`` (a cycle hidden there is still two
modules that need each other: one of them is not where it belongs). ``from package import module``
is an arrow to the module only (a package being imported is no cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import s2s_daemon

PACKAGE = Path(s2s_daemon.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, source: str, is_package: bool = False) -> set[str]:
    """The package's modules the module ``name`` (its ``source``) imports, anywhere in it."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # a submodule (its package is only the way to it), or a name of ``base``
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in MODULES else base)
    return {t for t in targets if t in MODULES and t != name}


def graph() -> dict[str, set[str]]:
    return {
        name: imported(name, path.read_text(encoding="utf-8"), path.name == "__init__.py")
        for name, path in MODULES.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_imports_under_type_checking_and_in_function_bodies() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import s2s_daemon.errors\n"
        "from s2s_daemon.pipeline import jobs\n"
        "try:\n    from s2s_daemon.pipeline.queue import RequestQueue\nexcept ImportError:\n    pass\n"
        "if TYPE_CHECKING:\n    from s2s_daemon.app import Daemon\n"
        "def later():\n    from s2s_daemon.wiring import build_stages\n"
        "from .journal import RequestJournal\n"
    )
    found = imported("s2s_daemon.pipeline.example", source)
    assert found == {
        "s2s_daemon.errors",
        "s2s_daemon.pipeline.jobs",
        "s2s_daemon.pipeline.queue",
        "s2s_daemon.pipeline.journal",
        "s2s_daemon.app",
        "s2s_daemon.wiring",
    }


def test_a_cycle_is_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_import_cycle_between_the_package_modules() -> None:
    edges = graph()
    assert sum(len(e) for e in edges.values()) > 100  # the walk sees the package's imports
    assert cycles(edges) == []
