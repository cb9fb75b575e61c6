"""Builds the torch engine's native CPU kernels at install time (everything else is in pyproject.toml).

``s2s_daemon/tts/torch_qwen3/native/_kernels.so`` is a plain C library (no Python or torch headers,
loaded with ctypes) that carries every instruction-set path of the architecture it is built for and
picks one at run time, so it is compiled without ``-march=native`` and runs on any CPU of that
architecture. The extension is optional: without a C++ compiler the install still succeeds and the
engine uses torch's own kernels (it logs why). ``pip install -e .`` builds it in place; after
editing its sources, ``python setup.py build_ext --inplace`` rebuilds it (a library built from other
sources than the ones beside it is refused, not run).

``S2S_KERNELS_LIBRARY=/path/_kernels.so`` takes a library built before from these same sources (its
compiled-in digest is checked; another one stops the build) in place of compiling them: the container
image builds the kernels in a layer of their own, which a change to the Python code leaves cached.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

NATIVE = Path("s2s_daemon/tts/torch_qwen3/native")
SOURCES = [
    "api.cpp",
    "portable.cpp",
    "x86_avx2.cpp",
    "x86_avx512.cpp",
    "x86_amx.cpp",
    "arm_neon.cpp",
    "arm_dotprod.cpp",
    "arm_i8mm.cpp",
]
"""Every architecture compiles all of them: each ISA unit is empty on the other architectures."""
ISA_FLAGS = {"arm_dotprod.cpp": ["-march=armv8.2-a+dotprod"], "arm_i8mm.cpp": ["-march=armv8.2-a+dotprod+i8mm"]}
"""aarch64's units beyond the baseline, each compiled alone with its own flags (x86-64's units set
their target with a pragma instead): the other units never hold a newer instruction, and these
export nothing another unit could take at link time (kernels.h; scripts/arm64_check.sh checks)."""
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

    def build_extension(self, ext: Extension) -> None:
        """``S2S_KERNELS_LIBRARY``'s library, if set; else on aarch64, ``ISA_FLAGS``' units compiled one
        by one with their flags, then the rest."""
        built = os.environ.get("S2S_KERNELS_LIBRARY")
        if built:
            digest = source_digest(NATIVE)
            if digest.encode() not in Path(built).read_bytes():
                raise SystemExit(f"S2S_KERNELS_LIBRARY={built} was not built from {NATIVE} (digest {digest[:16]})")
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built, target)
            return
        flags = isa_flags(getattr(self.compiler, "compiler_so", []))
        units = [src for src in ext.sources if Path(src).name in flags]
        if not units:
            super().build_extension(ext)
            return
        objects = []
        for src in units:
            objects += self.compiler.compile(
                [src],
                output_dir=self.build_temp,
                macros=ext.define_macros,
                include_dirs=ext.include_dirs,
                extra_postargs=[*ext.extra_compile_args, *flags[Path(src).name]],
                depends=ext.depends,
            )
        kept = ext.sources, ext.extra_objects, ext.depends
        ext.sources = [src for src in ext.sources if src not in units]
        ext.extra_objects = [*ext.extra_objects, *objects]
        ext.depends = [*ext.depends, *units]  # an edited unit relinks the library
        try:
            super().build_extension(ext)
        finally:
            ext.sources, ext.extra_objects, ext.depends = kept


def isa_flags(compiler: list[str]) -> dict[str, list[str]]:
    """``ISA_FLAGS`` where the library is built for aarch64 (this machine, or a compiler named for
    it); on macOS behind ``-Xarch_arm64``, for the arm64 half of a universal build. None elsewhere."""
    if sys.platform == "darwin":
        return {name: [f for flag in flags for f in ("-Xarch_arm64", flag)] for name, flags in ISA_FLAGS.items()}
    if platform.machine().lower() in ("aarch64", "arm64") or "aarch64" in " ".join(compiler):
        return ISA_FLAGS
    return {}


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
