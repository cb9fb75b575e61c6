"""What machine a benchmark ran on, for the benchmark scripts' output and the performance page.

The CPU's model and the instruction sets the kernels choose between at run time (so a figure from
an AVX2-only EPYC is not mistaken for one from a Xeon with AMX), the CPUs, the memory, the
1-minute load and the share of CPU time the hypervisor stole: a benchmark is only as quiet as its
machine. The parsers take text (``lscpu``, ``/proc/cpuinfo``, ``/proc/stat``, ``/proc/meminfo``)
so tests can hand them other machines'.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ISA_FEATURES: tuple[tuple[str, str], ...] = (
    # (shown as, the kernel's flag name in lscpu / /proc/cpuinfo)
    ("avx2", "avx2"),
    ("fma", "fma"),
    ("avx512f", "avx512f"),
    ("avx512_vnni", "avx512_vnni"),
    ("avx512_bf16", "avx512_bf16"),
    ("amx", "amx_tile"),
    ("asimd", "asimd"),
    ("asimddp", "asimddp"),
    ("i8mm", "i8mm"),
    ("bf16", "bf16"),
    ("sve", "sve"),
)
"""The instruction sets that decide which kernels run: the native kernels need AVX2 and FMA and
take a wider path with AVX-512 VNNI; oneDNN uses AVX-512 BF16 and AMX for bfloat16 and int8;
the ARM ones are what an ARM build would choose between."""

STEAL_SAMPLE_S = 0.25
"""How long ``machine_info`` samples ``/proc/stat`` when less than a second has passed since import."""


@dataclass(frozen=True, slots=True)
class CpuFacts:
    """The CPU as ``lscpu`` or ``/proc/cpuinfo`` tells it."""

    model: str
    flags: frozenset[str]
    hypervisor: str | None = None
    """``KVM``, ``Microsoft``...: the machine is a guest, so steal time matters."""

    @property
    def isa(self) -> list[str]:
        """The features of ``ISA_FEATURES`` this CPU has, in that order."""
        return [shown for shown, flag in ISA_FEATURES if flag in self.flags]


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The all-CPU line of ``/proc/stat``, in clock ticks since boot."""

    total: int
    steal: int


def _fields(text: str) -> list[tuple[str, str]]:
    """``key: value`` lines, keys stripped (``/proc/cpuinfo`` pads them with tabs)."""
    out = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.append((key.strip(), value.strip()))
    return out


def _with_family(model: str, family: str | None, number: str | None) -> str:
    """A model name without a number (``AMD EPYC`` under some hypervisors) gets family and model."""
    if re.search(r"\d", model) or not family:
        return model
    return f"{model} (family {family}, model {number or '?'})"


def cpu_from_lscpu(text: str) -> CpuFacts | None:
    """The CPU from ``lscpu``'s output (C locale); None when it names no model."""
    models: list[str] = []
    flags: set[str] = set()
    facts: dict[str, str] = {}
    for key, value in _fields(text):
        if key == "Model name" and value not in models:
            models.append(value)  # a big.LITTLE ARM lists each kind of core
        elif key == "Flags":
            flags.update(value.split())
        elif key in ("CPU family", "Model", "Hypervisor vendor", "Vendor ID"):
            facts.setdefault(key, value)
    if not models or models == ["-"]:
        return None
    model = " + ".join(models)
    if len(models) == 1:
        model = _with_family(model, facts.get("CPU family"), facts.get("Model"))
    vendor = facts.get("Vendor ID")
    if vendor and vendor not in ("GenuineIntel", "AuthenticAMD") and not model.startswith(vendor):
        model = f"{vendor} {model}"  # ARM's lscpu: Vendor ID "ARM", Model name "Neoverse-N1"
    return CpuFacts(model, frozenset(flags), facts.get("Hypervisor vendor"))


def cpu_from_cpuinfo(text: str) -> CpuFacts:
    """The CPU from ``/proc/cpuinfo`` (x86: ``model name`` and ``flags``; ARM: ``Features`` and the part)."""
    first: dict[str, str] = {}
    for key, value in _fields(text):
        first.setdefault(key, value)
    flags = frozenset((first.get("flags") or first.get("Features") or "").split())
    model = first.get("model name")
    if model:
        model = _with_family(model, first.get("cpu family"), first.get("model"))
    elif "CPU implementer" in first:
        model = f"ARM CPU (implementer {first['CPU implementer']}, part {first.get('CPU part', '?')})"
    else:
        model = first.get("Hardware") or first.get("Model") or platform.machine() or "unknown CPU"
    return CpuFacts(model, flags, "guest" if "hypervisor" in flags else None)


def cpu_times(stat_text: str) -> CpuTimes | None:
    """The all-CPU totals of ``/proc/stat`` (None without them)."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            ticks = [int(v) for v in parts[1:]]
            # user nice system idle iowait irq softirq steal guest guest_nice; guest time is inside user
            total = sum(ticks[:8])
            return CpuTimes(total, ticks[7] if len(ticks) > 7 else 0)
    return None


def steal_percent(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The share of CPU time stolen by the hypervisor between two readings, percent."""
    if before is None or after is None or after.total <= before.total:
        return None
    return 100.0 * (after.steal - before.steal) / (after.total - before.total)


def memory_gib(meminfo_text: str) -> float | None:
    """``MemTotal`` of ``/proc/meminfo``, GiB."""
    for key, value in _fields(meminfo_text):
        if key == "MemTotal":
            return round(int(value.split()[0]) / 1024**2, 1)
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _command(*argv: str) -> str:
    if shutil.which(argv[0]) is None:
        return ""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=10, check=False, env={**os.environ, "LC_ALL": "C"}
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


@functools.cache
def this_cpu() -> CpuFacts:
    """This machine's CPU: ``lscpu``, else ``/proc/cpuinfo``, else (macOS) ``sysctl``, else ``platform``."""
    found = cpu_from_lscpu(_command("lscpu"))
    if found is not None:
        return found
    cpuinfo = _read("/proc/cpuinfo")
    if cpuinfo:
        return cpu_from_cpuinfo(cpuinfo)
    brand = _command("sysctl", "-n", "machdep.cpu.brand_string").strip()
    return CpuFacts(brand or platform.processor() or platform.machine() or "unknown CPU", frozenset())


def _memory_gib() -> float | None:
    found = memory_gib(_read("/proc/meminfo"))
    if found is None and (size := _command("sysctl", "-n", "hw.memsize").strip()).isdigit():
        found = round(int(size) / 1024**3, 1)
    return found


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the OS has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _load1() -> float | None:
    load = load_average()
    return load[0] if load else None


@dataclass(frozen=True, slots=True)
class _Reading:
    monotonic: float
    load1: float | None
    times: CpuTimes | None


def _reading() -> _Reading:
    return _Reading(time.monotonic(), _load1(), cpu_times(_read("/proc/stat")))


START = _reading()
"""When this module was imported (a benchmark script's start): the load then, and the CPU times
the steal share over the run is counted from."""


def read_bandwidth_gbs(threads: int) -> float:
    """Memory read bandwidth now, GB/s: the best of five sums of a 256 MiB float32 tensor on ``threads``
    intra-op threads (torch). On a shared host it moves with what the neighbours read: a figure
    bound by memory traffic is worth its bandwidth beside it."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(64 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - started)
    return x.numel() * 4 / best / 1e9


def machine_info() -> dict[str, Any]:
    """This machine: OS, CPU (model, instruction sets, hypervisor), CPUs, memory, load now and at the
    start, and the steal share since the start (over a short sample when the start was just now)."""
    cpu = this_cpu()
    since = START
    if time.monotonic() - since.monotonic < 1.0:
        since = _reading()
        time.sleep(STEAL_SAMPLE_S)
    load = load_average()
    steal = steal_percent(since.times, cpu_times(_read("/proc/stat")))
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu.model,
        "isa": cpu.isa,
        "hypervisor": cpu.hypervisor,
        "logical_cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "load_average": load,
        "load_at_start": START.load1,
        "steal_pct": round(steal, 2) if steal is not None else None,
    }


def machine_record() -> dict[str, Any]:
    """The machine as a script's JSON report keeps it: CPU, instruction sets, cores, local date and time,
    1-minute load, steal share, Python."""
    info = machine_info()
    load = info["load_average"]
    return {
        "cpu": info["cpu"],
        "isa": info["isa"],
        "cores": info["logical_cores"],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load1": round(load[0], 2) if load else None,
        "steal_pct": info["steal_pct"],
        "python": info["python"],
    }


def _cpu_with_isa(info: dict[str, Any]) -> str:
    return f"{info['cpu']} with {' '.join(info['isa'])}" if info.get("isa") else str(info["cpu"])


def describe(info: dict[str, Any]) -> str:
    """The machine in one sentence, for the performance page: the CPU with its instruction sets, the
    hypervisor, CPUs, memory, the load at the start and now, and the steal share."""
    parts = [_cpu_with_isa(info)]
    if info.get("hypervisor"):
        parts.append(f"{info['hypervisor']} guest" if info["hypervisor"] != "guest" else "a virtual machine")
    parts.append(f"{info['logical_cores']} CPUs")
    if info.get("memory_gib"):
        parts.append(f"{info['memory_gib']:g} GiB RAM")
    load = info.get("load_average")
    if load:
        start = info.get("load_at_start")
        at_start = f"{start:.2f} at the start, " if start is not None else ""
        parts.append(f"load {at_start}{load[0]:.2f} at the end")
    if info.get("steal_pct") is not None:
        parts.append(f"steal {info['steal_pct']:.1f}% of CPU time")
    return ", ".join(parts)


def machine_line(*details: str, info: dict[str, Any] | None = None) -> str:
    """One line for a benchmark script's output: the minute, the CPU and its instruction sets, CPUs,
    memory, load and steal, then ``details`` (threads, format, rounds...)."""
    info = info if info is not None else machine_info()
    head = [f"{datetime.datetime.now().isoformat(timespec='minutes')} {_cpu_with_isa(info)}"]
    head.append(f"{info['logical_cores']} cores")
    if info.get("memory_gib"):
        head.append(f"{info['memory_gib']:g} GiB")
    load = info.get("load_average")
    head.append(f"load {load[0]:.2f}" if load else "load -")
    if info.get("steal_pct") is not None:
        head.append(f"steal {info['steal_pct']:.1f}%")
    return ", ".join([*head, *details])
