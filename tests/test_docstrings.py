"""No dated reading and no machine in the code's prose: docstrings and comments under
``s2s_daemon/`` say what and why and name the benchmark (``scripts/bench_*.py``) that measures
it; its figures, with machine and date, live in ``docs/``. A date or a CPU model there is a
reading that will go stale."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "s2s_daemon"

_MONTH = "January|February|March|April|May|June|July|August|September|October|November|December"
DATE = re.compile(
    r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"  # 2026-12-02
    rf"|\b(?:0?[1-9]|[12]\d|3[01]) (?:{_MONTH}) 20\d\d\b"  # 2 December 2026
    rf"|\b(?:{_MONTH}) (?:0?[1-9]|[12]\d|3[01]),? 20\d\d\b"  # December 2, 2026
    rf"|\b(?:{_MONTH}) 20\d\d\b"  # December 2026
)
"""A calendar date, in the forms a dated reading takes (a version like ``2022.9`` is not one)."""
CPU = re.compile(
    r"\b(?:Xeon|EPYC|Opteron|Threadripper|Ryzen|Core i[3579]|Celeron|Pentium"
    r"|(?:Sapphire|Emerald|Granite|Cooper|Ice|Cascade|Raptor|Alder) (?:Rapids|Lake)"
    r"|Skylake|Graviton\d?|Neoverse|(?:Apple )?M[1-4] (?:Pro|Max|Ultra))\b"
    r"|\bApple M[1-4]\b"
)
"""A CPU model or family name (an instruction set such as AVX-512 or a vendor's library is not one)."""
EXEMPT = {Path("bench/machine.py")}
"""It reads CPU model names from ``lscpu``: the names in its prose are its input, not a reading."""


def _docstrings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every string that stands alone as a statement: module, class, function and attribute docstrings."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def _python_comments(source: str) -> Iterator[tuple[int, str]]:
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def _cpp_comments(source: str) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(source.splitlines(), 1):
        if (at := line.find("//")) >= 0:
            yield number, line[at:]
    for match in re.finditer(r"/\*.*?\*/", source, re.DOTALL):
        yield source.count("\n", 0, match.start()) + 1, match.group()


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each docstring and comment of ``path``."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        yield from _docstrings(ast.parse(source))
        yield from _python_comments(source)
    else:
        yield from _cpp_comments(source)


def findings(root: Path) -> list[str]:
    """``path:line: what`` for every date or CPU model in the prose of the sources under ``root``."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in {".py", ".cpp", ".h"}):
        if path.relative_to(root) in EXEMPT:
            continue
        for line, text in prose(path):
            for pattern, what in ((DATE, "a date"), (CPU, "a CPU model")):
                for match in pattern.finditer(text):
                    found.append(f"{path.relative_to(root.parent)}:{line}: {what}: {match.group()!r}")
    return found


@pytest.mark.slow
def test_no_docstring_or_comment_holds_a_date_or_a_machine() -> None:
    assert findings(PACKAGE) == []


@pytest.mark.parametrize(
    "text",
    [
        "2 December 2026",
        "on 2026-12-02",
        "December 2, 2026",
        "in November 2026",
        "the 2-core Intel Xeon",
        "an AMD EPYC with AVX-512",
        "Sapphire Rapids",
        "an M2 Max",
        "Apple M1",
        "Ryzen 9",
    ],
)
def test_the_check_finds(text: str, tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(f'"""Timed {text}."""\n\nX = 1  # or here: {text}\n')
    (package / "k.cpp").write_text(f"// took 3 ms, {text}\nint x;\n")
    assert len(findings(package)) == 3


@pytest.mark.parametrize(
    "text",
    [
        "Home Assistant 2022.9+",
        "AVX-512 VNNI, AVX2 and FMA",
        "a 2048 x 256 codebook, 12.5 frames per second",
        "max(1, int(interval * 12.5))",
        "mlx-community/Qwen3-TTS-12Hz-0.6B",
        "the M4 macro",
        "may be 2 or 3",
        "ISO 8601 time like 07:56",
    ],
)
def test_the_check_lets_legitimate_text_be(text: str, tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(f'"""{text}."""\n\nX = "{text} 2 December 2026"  # {text}\n')
    assert findings(package) == []
