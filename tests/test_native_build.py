"""The native kernels are built at install and only loaded at run time.

``setup.py`` builds ``_kernels.so`` with ``pip install`` (in place for ``pip install -e``, as
``scripts/test`` does); the daemon never invokes a compiler. These tests check what the library is
built from and refused for, the check command, that one OpenMP runtime is mapped, that a start with
no compiler on PATH (and no cache of any earlier build) runs the native kernels, and (slow) that
setuptools' wheel and editable builds carry the library, and that a build without a compiler
still installs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.daemon import REPO

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")

from s2s_daemon.tts import isa  # noqa: E402 - after the importorskip
from s2s_daemon.tts.torch_qwen3 import native  # noqa: E402

TINY = REPO / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"


def _library_or_skip() -> None:
    reason = native.why_not_here()
    if reason is not None and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(f"native kernels not built (no C++ compiler here): {reason}")
    assert reason is None, reason


def _python(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's loaded library and kernels forgotten for the test (restored after it)."""
    monkeypatch.setattr(native, "_state", {})


def test_the_library_was_built_from_the_sources_beside_it() -> None:
    """setup.py compiles the digest of the sources into the library; the module computes it again
    (the two digest functions agree, or every library would read as stale)."""
    _library_or_skip()
    assert native.library().s2s_source_digest().decode() == native.source_digest()
    assert native.layout_key() == f"{native.PACK_LAYOUT}-{native.source_digest()[:16]}"


def test_a_library_built_from_other_sources_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An editable checkout whose kernels changed after the build: the library is not run (its
    packing and kernels may not be the sources'), and the reason says how to rebuild."""
    _library_or_skip()
    for source in native._FOLDER.iterdir():
        if source.suffix in native.SOURCE_SUFFIXES:
            shutil.copyfile(source, tmp_path / source.name)
    (tmp_path / "api.cpp").write_text((tmp_path / "api.cpp").read_text() + "\n// edited\n")
    monkeypatch.setattr(native, "_FOLDER", tmp_path)
    monkeypatch.setattr(native, "_state", {})  # a process that starts now
    assert native.load() is None
    reason = native.unavailable_reason()
    assert reason is not None and "other sources" in reason and "build_ext --inplace" in reason


def test_without_the_library_the_reason_says_to_install_with_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_state: None
) -> None:
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "_kernels.so")
    assert native.load() is None and native.why_not_here() is not None
    assert "not built at install" in (native.unavailable_reason() or "")
    from s2s_daemon.tts.torch_qwen3.formats import choose_format

    choice = choose_format("cpu", "auto", "auto", "auto", native.why_not_here)
    assert choice.quantization == "none" and "not built at install" in choice.reason


@pytest.mark.integration
def test_the_check_prints_the_library_its_paths_and_the_one_that_runs() -> None:
    _library_or_skip()
    done = _python("-m", "s2s_daemon.tts.torch_qwen3.native")
    assert done.returncode == 0, done.stderr
    carried = " ".join(native.carried_paths())
    kernels = native.load()
    assert kernels is not None
    assert done.stdout.splitlines() == [
        f"native kernels: {native.LIBRARY} (OpenMP threads)",
        f"paths: {carried} (this CPU runs: {' '.join(native.runnable_paths())})",
        f"runs: {kernels.isa} ({kernels.isa_reason})",
    ]
    capped = _python("-m", "s2s_daemon.tts.torch_qwen3.native", env={"S2S_TTS__TORCH__ISA": "generic"})
    assert capped.returncode == 0 and capped.stdout.splitlines()[-1] == "runs: generic (configured)"
    other = "neon" if isa.architecture() == "x86_64" else "avx2"
    refused = _python("-m", "s2s_daemon.tts.torch_qwen3.native", "--isa", other)
    assert refused.returncode == 1 and f"{other} is not a path of this" in refused.stderr


def test_the_library_and_python_agree_on_this_cpus_paths() -> None:
    _library_or_skip()
    assert native.runnable_paths() == isa.cpu_paths()


@pytest.mark.integration
def test_one_openmp_runtime_is_mapped_and_its_threads_are_torchs() -> None:
    """The library links libgomp.so.1 by soname: loaded after torch it is torch's own, one runtime
    and one pool of threads (a second runtime would spin its own threads beside torch's)."""
    _library_or_skip()
    code = """
import json, torch
from s2s_daemon.tts.torch_qwen3 import native
torch.set_num_threads(2)
kernels = native.load()
layer = native.PackedLinear(torch.nn.Linear(2048, 2048), "int8", kernels)
layer(torch.randn(1, 2048))
maps = open("/proc/self/maps").read().splitlines()
print(json.dumps(sorted({line.split()[-1] for line in maps if "libgomp" in line})))
"""
    done = _python("-c", code)
    assert done.returncode == 0, done.stderr
    mapped = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(mapped) == 1, mapped
    assert Path(mapped[0]).resolve().parent == (Path(torch.__file__).parent / "lib").resolve(), mapped


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_start_with_no_compiler_on_path_runs_the_native_kernels(tmp_path: Path) -> None:
    """``say`` on the tiny checkpoint as a fresh user: no compiler, ninja or anything else on PATH,
    empty caches (``TORCH_EXTENSIONS_DIR``: no build of the kernels that compiled them at first
    use, before the library, to fall back on), and the native kernels run."""
    _library_or_skip()
    empty = tmp_path / "bin"
    empty.mkdir()
    assert all(shutil.which(tool, path=str(empty)) is None for tool in ("c++", "g++", "gcc", "cc", "ninja"))
    done = _python(
        "-m",
        "s2s_daemon",
        "say",
        "Hello there.",
        "--model",
        str(TINY),
        "--out",
        str(tmp_path / "out.wav"),
        "--greedy",
        env={
            "PATH": str(empty),
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "HOME": str(tmp_path),
            "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
            "S2S_TTS__OPTIONS__MAX_FRAMES": "4",
            "S2S_TTS__TORCH__DEVICE": "cpu",
            "S2S_LOG__FORMAT": "json",
        },
        timeout=100,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    chosen = [e for e in events if e.get("event") == "engine_format"]
    assert len(chosen) == 1 and chosen[0]["kernels"] == "native", chosen
    widest = [p for p in isa.cpu_paths() if p in native.carried_paths()][-1]
    assert chosen[0]["isa"] == widest
    assert chosen[0]["isa_reason"].startswith("auto: ")


# ------------------------------------------------------------------ setuptools' builds (slow)


def _tree(tmp_path: Path) -> Path:
    """What a clone has of the package (no built library, no caches)."""
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copyfile(REPO / name, tree / name)
    shutil.copytree(REPO / "s2s_daemon", tree / "s2s_daemon", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tree


def _build(tree: Path, hook: str, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A PEP 517/660 hook of setuptools.build_meta, run in ``tree`` as pip runs it."""
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    base = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _loads(library: Path) -> str:
    """The paths a built library says it carries (ctypes in a fresh Python, torch loaded first)."""
    code = f"import ctypes, torch; lib = ctypes.CDLL({str(library)!r}); lib.s2s_paths.restype = ctypes.c_char_p; print(lib.s2s_paths().decode())"  # noqa: E501
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_builds_a_wheel_per_architecture_carrying_every_path(tmp_path: Path) -> None:
    _library_or_skip()
    tree, out = _tree(tmp_path), tmp_path / "dist"
    out.mkdir()
    done = _build(tree, "build_wheel", out)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    assert wheel.name.endswith(f"-py3-none-linux_{isa.architecture()}.whl"), wheel.name  # no Python ABI in it
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        member = "s2s_daemon/tts/torch_qwen3/native/_kernels.so"
        assert member in names and "s2s_daemon/tts/torch_qwen3/native/kernels.h" in names
        archive.extract(member, tmp_path / "unpacked")
    assert _loads(tmp_path / "unpacked" / member) == " ".join(native.carried_paths())


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_editable_install_builds_the_library_in_place(tmp_path: Path) -> None:
    """``pip install -e .`` (scripts/test, scripts/run): setuptools builds the extension in the
    source tree, where the package looks for it."""
    _library_or_skip()
    tree, out = _tree(tmp_path), tmp_path / "dist"
    out.mkdir()
    done = _build(tree, "build_editable", out)
    assert done.returncode == 0, done.stderr[-3000:]
    built = tree / "s2s_daemon" / "tts" / "torch_qwen3" / "native" / "_kernels.so"
    assert built.is_file()
    assert _loads(built) == " ".join(native.carried_paths())


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_install_without_a_compiler_still_succeeds_without_the_library(tmp_path: Path) -> None:
    tree, out = _tree(tmp_path), tmp_path / "dist"
    out.mkdir()
    done = _build(tree, "build_wheel", out, env={"CC": "/nonexistent/cc", "CXX": "/nonexistent/c++"})
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "s2s_daemon/tts/torch_qwen3/native/__init__.py" in names
    assert not any(name.endswith("_kernels.so") for name in names)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_library_built_before_from_the_same_sources_is_taken_and_another_refused(tmp_path: Path) -> None:
    """``S2S_KERNELS_LIBRARY`` (the container image's kernels layer): no compiler is run, the wheel
    carries that library; one built from other sources stops the build."""
    _library_or_skip()
    tree, out = _tree(tmp_path), tmp_path / "dist"
    out.mkdir()
    no_compiler = {"CC": "/nonexistent/cc", "CXX": "/nonexistent/c++"}
    built = REPO / "s2s_daemon" / "tts" / "torch_qwen3" / "native" / "_kernels.so"
    done = _build(tree, "build_wheel", out, env={**no_compiler, "S2S_KERNELS_LIBRARY": str(built)})
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    member = "s2s_daemon/tts/torch_qwen3/native/_kernels.so"
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(member) == built.read_bytes()
    (tree / "s2s_daemon" / "tts" / "torch_qwen3" / "native" / "kernels.h").write_text("// edited\n", "utf-8")
    shutil.rmtree(tree / "build", ignore_errors=True)
    refused = _build(tree, "build_wheel", tmp_path, env={**no_compiler, "S2S_KERNELS_LIBRARY": str(built)})
    assert refused.returncode != 0 and "was not built from" in refused.stderr, refused.stderr[-3000:]
