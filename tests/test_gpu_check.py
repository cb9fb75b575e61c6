"""scripts/gpu_check.sh: shell syntax, the code comparison, and a short CPU dry run end to end.

The real check runs once on a lent GPU machine; here it runs with ``S2S_GPU_DEVICE=cpu`` on the
tiny fixture (CPU against CPU is trivially equal), with the structlog stand-in that the GPU
image needs, two speed configs and four frames, so the whole path is exercised in well under a minute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_shell_syntax() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(SCRIPT)], check=True)


def test_compare_reports_first_difference() -> None:
    gc = _driver()
    with np.load(ROOT / "tests" / "fixtures" / "qwen3_tiny" / "golden" / "cv_ryan_english.npz") as gold:
        codes = gold["codes"].astype(np.int64)
    wav = np.zeros(codes.shape[0] * 1920, dtype=np.float32)
    ref = {"cv_ryan_english__codes": codes, "cv_ryan_english__wav": wav}
    same = gc.compare(dict(ref), ref, "cv_ryan_english")
    assert same["code_match"] == "1.000" and same["first_diff"] == "none" and same["golden_match"] == "1.000"
    assert same["wav_maxabs"] == 0.0
    changed = codes.copy()
    changed[9, 3] += 1
    other = wav.copy()
    other[9 * 1920 :] += 0.5
    got = gc.compare({"cv_ryan_english__codes": changed, "cv_ryan_english__wav": other}, ref, "cv_ryan_english")
    assert got["first_diff"].startswith("(9,3)") and got["first_diff_frame"] == 9
    assert got["frames_differing"] == 1
    assert float(got["code_match"]) == pytest.approx(1 - 1 / codes.size, abs=1e-3)
    assert got["wav_maxabs"] == pytest.approx(0.5)
    assert got["wav_maxabs_before_diff"] == 0.0  # the chunks before frame 8 saw equal codes


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("S2S_", "OUT"))}
    env.update(S2S_GPU_CHECK_RESULTS=str(tmp_path / "results"), TMPDIR=str(tmp_path), **extra)
    return env


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_cpu_dry_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    env = _env(
        tmp_path,
        S2S_GPU_DEVICE="cpu",
        S2S_GPU_PYTHON=sys.executable,
        S2S_GPU_CHECK_FRAMES="4",
        S2S_GPU_CHECK_RUNS="1",
        S2S_GPU_CHECK_CONFIGS="bf16_graphs,fp32_eager",
        S2S_GPU_CHECK_FAKE_STRUCTLOG="1",
        S2S_GPU_CHECK_TIMEOUT="220",
    )
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--quick"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=230, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = tmp_path / "results"
    summary = json.loads((results / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "complete"
    configs = summary["correctness"]["configs"]
    assert set(configs) == {"cpu_fp32_eager", "cpu_fp32_graphs"}
    for entry in configs.values():
        assert entry["cases"] and all(c["code_match"] == "1.000" for c in entry["cases"].values())
    perf = {row["config"]: row for row in summary["perf"]}
    assert set(perf) == {"bf16_graphs", "fp32_eager"}
    assert all(row["ok"] and row["frames"] == 4 and row["rtf_x"] > 0 for row in perf.values())
    assert "reference*" in proc.stdout and "RTX 4090" in proc.stdout
    assert {p.name for p in results.iterdir()} >= {"summary.json", "run.log", "steps.log", "nvidia-smi.txt"}
    assert "stand-in" in (results / "steps.log").read_text(encoding="utf-8")
    assert not list(tmp_path.glob("gpu_check.*")), "the work dir was not removed"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_no_cuda_interpreter_exits_2(tmp_path: Path) -> None:
    """Asked for cuda where no interpreter has a usable GPU, the script says so and exits 2."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = _env(tmp_path, S2S_GPU_DEVICE="cuda", S2S_GPU_PYTHON=sys.executable)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin"
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stdout
    assert "available=False" in proc.stdout and "no interpreter" in proc.stdout
