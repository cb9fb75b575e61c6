"""``s2s-daemon bench`` checks what can only fail at the end (matplotlib for --png, writable outputs) first.

Each case runs the real command with a plugin that leaves a marker file in every worker it is
called in: no marker means no engine was loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
MARKER_PLUGIN = """\
import os
from pathlib import Path

from tests.support.tone_engine import register as register_tone


def register():
    Path(os.environ["BENCH_MARKER"]).touch()
    register_tone()
"""
NO_MATPLOTLIB = 'raise ImportError("matplotlib is hidden by the test")\n'


def run_bench(
    tmp_path: Path, *args: str, hide_matplotlib: bool = False
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m s2s_daemon bench`` with the tone engine; the result and its wall time in seconds."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "bench_marker.py").write_text(MARKER_PLUGIN, encoding="utf-8")
    if hide_matplotlib:
        (site / "matplotlib").mkdir(exist_ok=True)
        (site / "matplotlib" / "__init__.py").write_text(NO_MATPLOTLIB, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    env["BENCH_MARKER"] = str(tmp_path / "engine-loaded")
    command = [sys.executable, "-m", "s2s_daemon", "bench", "--plugin", "bench_marker:register"]
    command += ["--model", "tone-model", "--engine", "tone", "--texts", "short", "--runs", "1", "--no-progress"]
    start = time.monotonic()
    done = subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=90, env=env, check=False)
    return done, time.monotonic() - start


def test_png_without_matplotlib_fails_at_once_with_69(tmp_path: Path) -> None:
    done, elapsed_s = run_bench(tmp_path, "--png", str(tmp_path / "bench.png"), hide_matplotlib=True)
    assert done.returncode == 69, done.stderr
    assert "--png needs matplotlib" in done.stderr and "s2s-daemon[bench]" in done.stderr, done.stderr
    assert not (tmp_path / "engine-loaded").exists(), "a worker loaded an engine before the check"
    assert not (tmp_path / "bench.png").exists()
    assert elapsed_s < 15, elapsed_s


def test_unwritable_outputs_fail_at_once_with_78_and_writable_ones_are_left_for_the_run(tmp_path: Path) -> None:
    for flag, target in (
        ("--json", tmp_path / "no-such-dir" / "bench.json"),
        ("--png", tmp_path),  # a folder, not a file
    ):
        done, _ = run_bench(tmp_path, flag, str(target))
        assert done.returncode == 78, done.stderr
        assert f"{flag} {target}: cannot write there" in done.stderr, done.stderr
        assert not (tmp_path / "engine-loaded").exists(), "a worker loaded an engine before the check"
    # The same command with writable files runs (the marker proves the plugin works) and writes them.
    json_path = tmp_path / "bench.json"
    json_path.write_text("old\n", encoding="utf-8")
    done, _ = run_bench(tmp_path, "--json", str(json_path), "--png", str(tmp_path / "bench.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "engine-loaded").exists()
    assert json_path.read_text(encoding="utf-8").startswith("{")
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
