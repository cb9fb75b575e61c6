"""``scripts/bench_voices.py`` runs end to end on the tiny Base checkpoint (a smoke run, not figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "tests" / "fixtures" / "qwen3_tiny" / "base"


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_voices_reports_each_state_side_by_side(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "report.json"
    command = [
        sys.executable,
        str(REPO / "scripts" / "bench_voices.py"),
        str(BASE),
        "--sources",
        "library",
        "--runs",
        "1",
        "--kernels",
        "torch",
        "--chunk-frames",
        "1",
        "--json",
        str(out),
        "--doc-file",
        str(tmp_path / "performance.md"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=170, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu"] and report["machine"]["date"]
    assert report["engine"] == "torch" and report["quantization"] == "int8"
    rows = {r["state"]: r for r in report["results"]}
    assert set(rows) == {"cold", "memory", "disk"}
    for row in rows.values():
        assert row["source"] == "library" and row["samples"] == 1
        for field in ("ttfa_ms", "prepare_ms", "clone_ms", "lookup_ms"):
            assert isinstance(row[field], float) and row[field] >= 0, (row["state"], field)
        assert row["clone_ms"] <= row["prepare_ms"] <= row["ttfa_ms"]
    # The states are what they say: the encoders ran only cold; disk read the prompt cold stored.
    assert (rows["cold"]["encoder_runs"], rows["cold"]["disk_loads"]) == (1, 0)
    assert rows["memory"]["encoder_runs"] == 0
    assert (rows["disk"]["encoder_runs"], rows["disk"]["disk_loads"]) == (0, 1)
    assert set(report["goal"]) == {"cached_clone_ms_max", "encoder_clone_ms", "limit_ms", "met"}
    for state in ("cold", "memory", "disk"):
        assert state in done.stdout
    assert "goal:" in done.stdout and report["machine"]["cpu"] in done.stdout
    # --doc: the same figures as a table on the (scratch) performance page.
    page = (tmp_path / "performance.md").read_text(encoding="utf-8")
    assert page.startswith("<!-- bench:voices -->\n## First audio with a cloned voice")
    for state in ("cold", "memory", "disk"):
        row = next(line for line in page.splitlines() if line.startswith(f"| library    | {state}"))
        assert f" {rows[state]['ttfa_ms']} |" in row, row
