"""``scripts/bench_text.py`` runs over the corpus, prints the cost per sentence against the goal and
publishes its table with ``--doc`` (into a scratch copy of the performance page)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from s2s_daemon.bench.performance_page import PAGE_ENV, sections

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def test_bench_text_prints_both_ways_and_publishes_its_section(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_bytes((REPO / "docs" / "performance.md").read_bytes())
    env = {**os.environ, PAGE_ENV: str(tmp_path / "never-written.md")}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_text.py"), "--rounds", "1", "--doc", "--doc-file", str(page)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("whole ") and "the goal" in line for line in lines), done.stdout
    assert any(line.startswith("streamed ") and "the goal" in line for line in lines), done.stdout
    text = page.read_text(encoding="utf-8")
    start, end = sections(text)["text"]
    assert "| whole " in text[start:end] and "| streamed " in text[start:end]
    assert "scripts/bench_text.py --rounds 1" in text[start:end]
    assert not (tmp_path / "never-written.md").exists()
