"""Where the native kernels are built, when they are rebuilt, and what is said meanwhile.

No test here compiles: the builds are stood in for by a recorder, and the one test that loads the
real extension in a second process runs only when this environment's build already exists
(``scripts/test`` makes it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")

from s2s_daemon.tts.torch_qwen3 import native  # noqa: E402 - after the importorskip

ROOT = Path(__file__).resolve().parents[1]


def _python(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.integration
def test_the_key_is_stable_across_calls_and_processes() -> None:
    assert native.build_key() == native.build_key()
    done = _python("-c", "from s2s_daemon.tts.torch_qwen3 import native; print(native.build_folder())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(native.build_folder())


def test_the_folder_names_torch_and_python_and_honours_torch_extensions_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = native.build_folder()
    assert folder.parent == tmp_path
    assert folder.name.startswith(f"torch{torch.__version__.split('+')[0]}-{sys.implementation.cache_tag}-")


def test_another_torch_installation_gets_another_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two virtual environments with the same torch version: torch's ninja file names each one's
    include and lib folders, so sharing a folder would rebuild on every alternation."""
    here = native.build_folder()
    monkeypatch.setattr(torch, "__file__", "/opt/other-venv/lib/python3.11/site-packages/torch/__init__.py")
    assert native.build_key()["torch"] == torch.__version__
    assert native.build_folder() != here
    monkeypatch.undo()
    assert native.build_folder() == here


@pytest.mark.parametrize("change", ["compiler", "torch_version", "python_include", "source_path"])
def test_whatever_changes_the_build_command_changes_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    here = native.build_folder()
    if change == "compiler":
        monkeypatch.setenv("CXX", "clang++")
    elif change == "torch_version":
        monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    elif change == "python_include":
        import sysconfig

        real = sysconfig.get_paths

        def other_python() -> dict[str, str]:
            return {**real(), "include": "/usr/include/python3.11"}

        monkeypatch.setattr(sysconfig, "get_paths", other_python)
    else:  # another checkout with the same text: the ninja file names the source by its path
        copy = tmp_path / "linear.cpp"
        shutil.copyfile(native._SOURCE, copy)
        digest = native.build_key()["source_sha256"]
        monkeypatch.setattr(native, "_SOURCE", copy)
        assert native.build_key()["source_sha256"] == digest
    assert native.build_folder() != here


def test_an_edited_source_gets_another_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "linear.cpp"
    shutil.copyfile(native._SOURCE, source)
    monkeypatch.setattr(native, "_SOURCE", source)
    before = native.build_folder()
    source.write_bytes(source.read_bytes() + b"\n// edited\n")
    assert native.build_folder() != before


class _FakeBuild:
    """Stands in for ``torch.utils.cpp_extension.load``: records calls and leaves the ``.so``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> object:
        self.calls.append(kwargs)
        folder = Path(kwargs["build_directory"])
        (folder / f"{kwargs['name']}.so").write_bytes(b"")
        return object()


def test_a_build_is_announced_and_timed_and_a_built_folder_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")
    import torch.utils.cpp_extension as cpp_extension

    fake = _FakeBuild()
    monkeypatch.setattr(cpp_extension, "load", fake)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_state", {})
    with structlog.testing.capture_logs() as logs:
        assert native.load() is not None
    events = [entry["event"] for entry in logs]
    assert events == ["native_kernels_building", "native_kernels_built"]
    assert logs[0]["expected_s"] == native.BUILD_EXPECTED_S and logs[0]["cached_in"] == str(native.build_folder())
    assert isinstance(logs[1]["build_s"], float)
    assert fake.calls[0]["build_directory"] == str(native.build_folder())
    assert (native.build_folder() / "key.json").is_file()

    monkeypatch.setattr(native, "_state", {})  # a second process
    with structlog.testing.capture_logs() as logs:
        assert native.load() is not None
    assert [entry["event"] for entry in logs] == ["native_kernels_cached"]


@pytest.mark.integration
def test_a_second_process_loads_the_build_without_compiling() -> None:
    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")
    folder = native.build_folder()
    if not native.is_built(folder):
        pytest.skip(f"no build in {folder} yet (python -m s2s_daemon.tts.torch_qwen3.native makes it)")
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix in (".so", ".o")}
    done = _python("-m", "s2s_daemon.tts.torch_qwen3.native")
    assert done.returncode == 0, done.stderr
    assert "building" not in done.stdout and str(folder) in done.stdout
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix in (".so", ".o")} == before


@pytest.mark.integration
def test_the_prebuild_exits_0_and_says_why_without_a_compiler() -> None:
    done = _python("-m", "s2s_daemon.tts.torch_qwen3.native", CXX="/nonexistent/c++")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("native kernels: not used here (")
    assert "torch's own kernels" in done.stdout
