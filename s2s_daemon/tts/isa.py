"""The instruction-set paths of the native CPU kernels (``tts.torch.isa``), without torch.

One build of the kernels carries every path of its architecture and runs the widest this CPU has
(``torch_qwen3/native``): on x86-64 ``generic`` (portable C), ``avx2`` (AVX2 and FMA), ``avx512``
(AVX-512 with VNNI) and ``amx`` (the avx512 path with a prompt's int8 and 4-bit products on AMX's
tiles; a build whose compiler had no AMX runs the avx512 path for it). On aarch64 ``generic``,
``neon`` (Armv8.0's Advanced SIMD), ``dotprod`` (Armv8.2's SDOT) and ``i8mm`` (the int8 matrix
multiply, SMMLA). ``tts.torch.isa`` caps the path for tests and benchmarks; ``check-config`` and
``run`` refuse a path this CPU cannot run before anything loads (``preflight``: exit 78 naming the
key). This module reads the CPU as the operating system reports it (``/proc/cpuinfo``, macOS's
``sysctl``) and needs no torch; the library checks again with cpuid or the kernel's HWCAPs before it
runs a path.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

X86_PATHS = ("generic", "avx2", "avx512", "amx")
"""x86-64's names, narrowest first."""
ARM_PATHS = ("generic", "neon", "dotprod", "i8mm")
"""aarch64's names, narrowest first."""
CHOICES = ("auto", "generic", "avx2", "avx512", "amx", "neon", "dotprod", "i8mm")
"""What ``tts.torch.isa`` accepts."""

_X86_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "amx": (
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_vnni",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
    ),
}
"""The ``/proc/cpuinfo`` flags each x86-64 path needs (``api.cpp``'s ``cpu_has`` checks the same bits)."""
_ARM_NEEDS = {"neon": ("asimd",), "dotprod": ("asimd", "asimddp"), "i8mm": ("asimd", "asimddp", "i8mm")}
"""The ``Features`` of aarch64's ``/proc/cpuinfo`` each path needs."""
_MAC_KEYS = {"dotprod": "hw.optional.arm.FEAT_DotProd", "i8mm": "hw.optional.arm.FEAT_I8MM"}
_WHY = {
    "amx": "amx_bf16",
    "avx512": "avx512_vnni",
    "avx2": "avx2 and fma",
    "neon": "asimd",
    "dotprod": "asimddp",
    "i8mm": "i8mm",
}
"""How a reason names what the CPU has for a path."""


def architecture(machine: str | None = None) -> str:
    """``x86_64``, ``aarch64`` or the machine's own name (``platform.machine()`` by default)."""
    name = (machine if machine is not None else platform.machine()).lower()
    if name in ("x86_64", "amd64"):
        return "x86_64"
    if name in ("aarch64", "arm64"):
        return "aarch64"
    return name


def paths_of(arch: str) -> tuple[str, ...]:
    """The path names of an architecture (``generic`` alone for another one)."""
    return X86_PATHS if arch == "x86_64" else ARM_PATHS if arch == "aarch64" else ("generic",)


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU in a ``/proc/cpuinfo`` text (x86 ``flags``, ARM ``Features``)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def paths_for(arch: str, flags: Iterable[str]) -> tuple[str, ...]:
    """The paths a CPU of ``arch`` with ``flags`` can run, narrowest first."""
    have = set(flags)
    needs = _X86_NEEDS if arch == "x86_64" else _ARM_NEEDS if arch == "aarch64" else {}
    return ("generic", *(name for name in paths_of(arch)[1:] if set(needs[name]) <= have))


@functools.cache
def this_cpu_flags() -> frozenset[str]:
    """This CPU's flags as Linux's ``/proc/cpuinfo`` lists them (empty elsewhere)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace"))
    except OSError:
        return frozenset()


@functools.cache
def cpu_paths() -> tuple[str, ...]:
    """The paths this CPU can run, narrowest first (cached: the CPU does not change)."""
    arch = architecture()
    if platform.system() == "Darwin" and arch == "aarch64":
        found = ["generic", "neon"]
        for name, key in _MAC_KEYS.items():
            try:
                done = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False)
            except (OSError, subprocess.TimeoutExpired):
                break
            if done.stdout.strip() != "1":
                break
            found.append(name)
        return tuple(found)
    return paths_for(arch, this_cpu_flags())


def refusal(requested: str, arch: str | None = None, runnable: tuple[str, ...] | None = None) -> str | None:
    """Why ``tts.torch.isa: requested`` cannot run here, or None when it can (``auto`` always can)."""
    arch = architecture() if arch is None else arch
    runnable = cpu_paths() if runnable is None else runnable
    if requested == "auto" or requested in runnable:
        return None
    if requested not in paths_of(arch):
        return f"{requested} is not a path of this {arch} CPU (its paths: {', '.join(paths_of(arch))})"
    return f"this CPU cannot run the {requested} path (it can run: {', '.join(runnable)})"


def choose(requested: str, carried: tuple[str, ...], runnable: tuple[str, ...]) -> tuple[str, str]:
    """(path, reason): the path to run for ``tts.torch.isa: requested``, given the paths the library
    ``carried`` and the ones this CPU can run (``runnable``, narrowest first). ValueError when a
    configured path cannot run: the CPU lacks it, or the library does not carry it."""
    if requested == "auto":
        usable = [name for name in carried if name in runnable]
        best = usable[-1] if usable else "generic"
        if best != "generic":
            return best, f"auto: cpu has {_WHY[best]}"
        missing = [name for name in runnable if name not in carried and name not in ("generic", "amx")]
        if missing:
            return best, f"auto: portable C (this build carries no {' or '.join(missing)} path)"
        return best, "auto: portable C (the cpu has none of the wider paths)"
    why = refusal(requested, runnable=runnable)
    if why is not None:
        raise ValueError(f"tts.torch.isa: {why}")
    if requested == "amx" and requested not in carried:
        if "avx512" not in carried:
            raise ValueError("tts.torch.isa: amx runs the avx512 path here, which this build does not carry")
        return "avx512", "configured amx: this build carries no amx path (no AMX in its compiler), avx512 runs"
    if requested not in carried:
        raise ValueError(f"tts.torch.isa: this build carries no {requested} path (it carries: {', '.join(carried)})")
    return requested, "configured"
