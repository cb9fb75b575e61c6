"""``scripts/bench_peers.py``'s figures from chunk arrivals (the peers themselves are not needed: their
runs are benchmarks, ``scripts/peers_prep.sh`` installs them outside the project)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_peers.py"
FRAME = 1920


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench_peers = load_script()


def test_steady_pace_is_taken_between_the_chunks_that_complete_a_quarter_and_three_quarters() -> None:
    # a 1-frame first chunk after 1 s, then 4-frame chunks every 0.4 s: 0.1 s a frame in the steady state
    rows = [[1.0, FRAME]] + [[1.0 + 0.4 * i, (1 + 4 * i) * FRAME] for i in range(1, 25)]
    assert bench_peers.steady_s_per_frame(rows, 100) == pytest.approx(0.1)


def test_steady_pace_counts_the_frames_the_chunks_really_hold() -> None:
    # frames 25 and 75 fall inside chunks ending at 28 and 76: (6.0 - 1.0) / 48 frames
    rows = [[0.5, 4 * FRAME], [1.0, 28 * FRAME], [3.0, 52 * FRAME], [6.0, 76 * FRAME], [8.0, 100 * FRAME]]
    assert bench_peers.steady_s_per_frame(rows, 100) == pytest.approx(5.0 / 48)


def test_no_steady_pace_when_one_chunk_holds_the_whole_window_or_the_call_stopped_short() -> None:
    assert bench_peers.steady_s_per_frame([[4.0, 100 * FRAME]], 100) is None
    assert bench_peers.steady_s_per_frame([[1.0, 10 * FRAME], [2.0, 30 * FRAME]], 100) is None
    assert bench_peers.steady_s_per_frame([], 100) is None


def test_a_runs_figures_come_from_its_three_calls() -> None:
    result = {
        "calls": {
            "cold": [[0.9, FRAME], [1.2, 4 * FRAME]],
            "first": [[0.3, FRAME], [0.5, 4 * FRAME]],
            "steady": [[0.3 + 0.1 * i, i * FRAME] for i in range(1, 13)],
        },
        "peak_rss_mib": 1200.5,
        "load_s": 1.5,
    }
    got = bench_peers.figures(result, 12)
    assert got.first_chunk_s == 0.3 and got.first_chunk_frames == 1.0 and got.cold_first_chunk_s == 0.9
    assert got.frames == 12.0 and got.peak_rss_mib == 1200.5 and got.load_s == 1.5
    assert got.steady_s_per_frame == pytest.approx(0.1)


def test_the_table_sets_each_peer_beside_ours_with_ours_over_the_peers_median() -> None:
    def run(steady: float) -> object:
        return bench_peers.RunFigures(steady, 0.2, 1.0, 0.5, 100.0, 1000.0, 1.0)

    results = {"GGML Q8_0": [run(0.30), run(0.26)], "ours int8": [run(0.14), run(0.14)]}
    header, rows = bench_peers.table(results)
    assert header[:4] == ["metric", "GGML Q8_0", "ours int8", "ours / peer"]
    steady = rows[0]
    assert steady[1:4] == ["0.2800", "0.1400", "0.50x"]
    assert steady[4:7] == [None, None, None]  # GGML Q4_K_M and ours int4 did not run: '-' in the table
    assert steady[8] == "0.1400" and steady[9] is None  # vox-tts did not run


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_an_unprepared_scratch_folder_says_which_script_prepares_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--scratch", str(tmp_path), "--doc-file", str(tmp_path / "page.md")],
        capture_output=True, text=True, timeout=50, check=False, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "scripts/peers_prep.sh" in done.stderr and "model.tmod" in done.stderr
    assert not (tmp_path / "page.md").exists()


def test_the_talker_file_follows_the_checkpoints_size(tmp_path: Path) -> None:
    """The GGUF talker is the one scripts/peers_prep.sh converted from this checkpoint: its config's
    ``tts_model_size`` (1b7 or 0b6) names it."""
    for size, name in (("1b7", "qwen-talker-1.7b-customvoice"), ("0b6", "qwen-talker-0.6b-customvoice")):
        (tmp_path / "config.json").write_text(json.dumps({"tts_model_size": size}))
        assert bench_peers.talker(tmp_path) == name
