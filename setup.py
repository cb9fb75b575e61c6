"""Builds the torch engine's native CPU kernels at install time (everything else is in pyproject.toml).

``s2s_daemon/tts/torch_qwen3/native/_kernels.so`` is a plain C library (no Python or torch headers,
loaded with ctypes) that carries every instruction-set path of the architecture it is built for and
picks one at run time, so it is compiled without ``-march=native`` and runs on any CPU of that
architecture. The extension is optional: without a C++ compiler the install still succeeds and the
engine uses torch's own kernels (it logs why). ``pip install -e .`` builds it in place; after
editing its sources, ``python setup.py build_ext --inplace`` rebuilds it (a library built from other
sources than the ones beside it is refused, not run).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

NATIVE = Path("s2s_daemon/tts/torch_qwen3/native")
SOURCES = ["api.cpp", "portable.cpp", "x86_avx2.cpp", "x86_avx512.cpp"]
"""Every architecture compiles all of them: each ISA unit is empty on the other architectures.
aarch64's neon/dotprod/i8mm units go here (and their -DS2S_HAVE_* below) when they exist."""
SOURCE_SUFFIXES = (".cpp", ".h", ".inc")


def source_digest(folder: Path) -> str:
    """sha256 over the kernels' source files (names and contents, sorted by name); the same
    function as ``native.source_digest`` (a test holds them equal)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in SOURCE_SUFFIXES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class BuildKernels(build_ext):
    """A plain shared library named ``_kernels.so`` (no Python ABI tag: nothing in it is Python)."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # no PyInit_ function: ctypes finds the s2s_* functions by name


class PlainLibraryWheel(bdist_wheel):
    """Tagged ``py3-none-<platform>``: one wheel per architecture serves every Python 3.11+."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


openmp = [] if sys.platform == "darwin" else ["-fopenmp"]  # Apple's clang has no OpenMP: serial there
kernels = Extension(
    "s2s_daemon.tts.torch_qwen3.native._kernels",
    sources=[str(NATIVE / name) for name in SOURCES],
    depends=[str(p) for p in sorted(NATIVE.iterdir()) if p.suffix in (".h", ".inc")],
    language="c++",
    extra_compile_args=[
        "-O3",
        "-g0",
        "-std=c++17",
        "-fvisibility=hidden",
        *openmp,
        f'-DS2S_SOURCE_DIGEST="{source_digest(NATIVE)}"',
    ],
    extra_link_args=openmp,
    optional=True,
)

setup(ext_modules=[kernels], cmdclass={"build_ext": BuildKernels, "bdist_wheel": PlainLibraryWheel})
