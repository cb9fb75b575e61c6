"""Every package the code, the tests and the scripts import is declared in pyproject.toml (the
dependencies or an extra): one that only comes in with another package (jinja2 with torch) goes
missing the day that package stops bringing it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("s2s_daemon", "tests", "scripts")

NOT_OURS = {
    "qwen_tts": "the official package, imported by bench/reference_worker.py in its own environment only",
    "vox": "vox-tts, a peer of scripts/bench_peers.py, in the peers' own environment only",
    "qwentts_cpp_cpu": "qwentts.cpp's wheel, a peer of scripts/bench_peers.py, in the peers' own environment only",
}
"""Imported where they are installed apart (another interpreter); never a dependency of ours."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions pyproject.toml names, in its dependencies and every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {normalized(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]) for requirement in requirements}


def imported(path: Path) -> Iterator[tuple[str, int]]:
    """Top-level names of the absolute imports in a file (at any depth: lazy ones count), with lines."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.partition(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0], node.lineno


def sources() -> Iterator[Path]:
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.slow
def test_every_imported_package_is_declared() -> None:
    ours = {path.stem for path in ROOT.glob("*/__init__.py")} | {"s2s_daemon", "tests", "scripts"}
    ours |= {path.stem for path in (ROOT / "scripts").glob("*.py")}  # scripts import their neighbours
    distributions = importlib.metadata.packages_distributions()
    names = declared()
    undeclared: list[str] = []
    for path in sources():
        for module, line in imported(path):
            if module in sys.stdlib_module_names or module in ours or module in NOT_OURS or module == "__future__":
                continue
            provided = {normalized(d) for d in distributions.get(module, [])}
            if not provided & names:
                what = ", ".join(sorted(provided)) or "not installed"
                undeclared.append(f"{path.relative_to(ROOT)}:{line}: {module} ({what})")
    assert not undeclared, "imported but not declared in pyproject.toml:\n" + "\n".join(undeclared)


def test_the_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    """The scan itself: an import of a package that is installed but not declared is found."""
    source = tmp_path / "uses.py"
    source.write_text("import os\n\ndef f():\n    import jinja2.sandbox\n    from yaml import safe_load\n")
    assert list(imported(source)) == [("os", 1), ("jinja2", 4), ("yaml", 5)]
    assert "pyyaml" in declared() and "s2s-daemon" in declared()  # an extra naming our own extras
