"""The CPU engine's threads on a shared machine: how they wait, and how many run.

torch's operators, oneDNN, MKL and our native kernels all run on one GNU libgomp thread pool,
whose threads spin before they sleep at the end of a parallel region. Beside another busy
process a long spin burns the time slice its partner needs, and decoding (a few hundred short
regions a frame) collapses; sleeping at once (a passive wait) pays a wake-up in every region
and costs a quiet machine much of its second thread. ``prepare_openmp`` asks for a short spin
before torch is first imported (``scripts/bench_threads.py`` measures the waits side by side).
``CpuWatch`` measures what this process may use of the machine (affinity, cgroup quota, others'
and the hypervisor's CPU time): at once when others take more, by a running average when they
take less; ``choose_threads`` turns that into an intra-op thread count, applied between frames
on the engine thread, so that beside a busy process the engine soon runs one thread, which
nothing waits on.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SPIN_COUNT = "3000"
"""``GOMP_SPINCOUNT`` that ``prepare_openmp`` sets: a waiting thread spins about 30 µs (libgomp
reckons 100,000 rounds a millisecond; its own count is 300,000), then sleeps;
``scripts/bench_threads.py`` compares it with the default spin and the passive wait."""
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Set by the user: their choice is kept (``KMP_BLOCKTIME``, LLVM's and Intel's, is not libgomp's:
beside it ``GOMP_SPINCOUNT`` is still set, which only libgomp reads)."""
SAMPLE_S = 1.0
"""Seconds between two readings of the machine's CPU time."""
SMOOTHING = 0.5
"""Weight of the newest reading in the running estimate of what others take, when it is lower
than the estimate (a higher reading is taken at once: yield fast, take back slowly)."""
RAISE_MARGIN = 0.3
"""One more thread once at least ``n + 1 - RAISE_MARGIN`` CPUs are free."""
LOWER_MARGIN = 0.5
"""One fewer once fewer than ``n - LOWER_MARGIN`` CPUs are free (between the two: unchanged)."""

_wait_state: dict[str, str] = {}


def prepare_openmp(environ: MutableMapping[str, str] | None = None, imported: bool | None = None) -> str:
    """Ask OpenMP for a short spin before torch (and so libgomp) is loaded; what happened:
    ``set``, ``kept`` (the user set a wait variable) or ``late`` (torch was imported already: the
    runtime read its settings then)."""
    real = environ is None
    environ = os.environ if environ is None else environ
    imported = "torch" in sys.modules if imported is None else imported
    if any(name in environ for name in WAIT_VARIABLES):
        outcome = "kept"
    elif imported:
        outcome = "late"
    else:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        outcome = "set"
    if real:
        _wait_state.setdefault("outcome", outcome)
    return outcome


def wait_policy() -> str:
    """The wait as the OpenMP runtime read it, for the log: ``GOMP_SPINCOUNT=...``,
    ``OMP_WAIT_POLICY=PASSIVE``, ``default spin (torch was imported before ...)``..."""
    for name in (*WAIT_VARIABLES, "KMP_BLOCKTIME"):
        if name in os.environ:
            return f"{name}={os.environ[name]}"
    if _wait_state.get("outcome") == "late":
        return "default spin (torch was imported before GOMP_SPINCOUNT could be set)"
    return "default spin"


# --------------------------------------------------------------------------- what is there


def cgroup_quota(proc: Path = Path("/proc"), root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroups, in CPUs (a systemd ``CPUQuota=150%``: 1.5; a
    container's ``--cpus``); the smallest along the path to the root; None when there is none."""
    try:
        lines = (proc / "self" / "cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # cgroup v2
            quotas += _walk(root / "unified", path, _v2_quota) if (root / "unified").is_dir() else []
            quotas += _walk(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    quotas += _walk(mount, path, _v1_quota)
                    break
    return min(quotas) if quotas else None


def _walk(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """``read`` of the cgroup at ``path`` under ``mount`` and of each of its parents."""
    found: list[float] = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        value = read(mount.joinpath(*parts[:depth]))
        if value is not None:
            found.append(value)
    return found


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="ascii").split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="ascii"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def affinity_cpus() -> int:
    """CPUs this process may run on (``taskset``, a cpuset), else every CPU."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class CpuShare:
    """What the machine leaves this process, in CPUs."""

    cpus: int
    """CPUs it may run on (affinity)."""
    quota: float | None = None
    """Its cgroup's CPU quota (CPUs), None when there is none."""
    others: float = 0.0
    """CPUs busy with other processes (the watch's estimate: a rise at once, a fall by a running average)."""
    steal: float = 0.0
    """CPUs the hypervisor gave to other machines (steal time, estimated alike)."""

    @property
    def usable(self) -> float:
        """CPUs it may use at most: affinity, then quota."""
        return min(float(self.cpus), self.quota) if self.quota is not None else float(self.cpus)

    @property
    def free(self) -> float:
        """CPUs free for it now: usable, less what others and the hypervisor take."""
        return max(0.0, min(self.usable, self.cpus - self.others - self.steal))


def reserved_cpus(share: CpuShare) -> int:
    """CPUs left to the rest of the process (the event loop, the audio callback, the journal): one
    where more than two may be used, none on a machine of two (two threads beat one there on a
    quiet box: ``scripts/bench_torch.py --threads 2`` against ``--threads 1``)."""
    return 1 if math.floor(share.usable + 1e-9) > 2 else 0


def ceiling_threads(share: CpuShare, default: int) -> int:
    """The most threads: every usable CPU (affinity, then the cgroup quota's whole CPUs) but the
    reserved one; at least one, never more than ``default`` (torch's own, ``OMP_NUM_THREADS`` when set)."""
    usable = math.floor(share.usable + 1e-9)
    return max(1, min(usable - reserved_cpus(share), default))


def choose_threads(share: CpuShare, ceiling: int, current: int | None = None) -> tuple[int, str]:
    """Threads for what is free now, and why (``ceiling``: as many as may run; ``load``: other
    processes take CPUs; ``steal``: the hypervisor does). Whole free CPUs (less the reserved one),
    one thread each, at least one: a thread whose partner waits for a CPU holds every parallel
    region up. Between the raise and the lower margins the current count stays (no flapping)."""
    free = share.free - reserved_cpus(share)
    if current is None:
        wanted = math.floor(free + 0.5)
    elif free >= current + 1 - RAISE_MARGIN:
        wanted = math.floor(free + RAISE_MARGIN)
    elif free < current - LOWER_MARGIN:
        wanted = math.floor(free + LOWER_MARGIN)
    else:
        wanted = current
    threads = max(1, min(ceiling, wanted))
    if threads >= ceiling:
        reason = "ceiling"
    elif share.steal > share.others:
        reason = "steal"
    else:
        reason = "load"
    return threads, reason


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """One reading: the machine's busy and stolen CPU seconds, this process's CPU seconds, when."""

    busy_s: float
    steal_s: float
    own_s: float
    at: float


def read_times(proc: Path = Path("/proc")) -> CpuTimes | None:
    """From ``/proc/stat`` (Linux) and this process's CPU clock; None where there is none."""
    try:
        first = (proc / "stat").read_text(encoding="ascii").split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 8:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    ticks = [int(v) for v in first[1:]]
    # user nice system idle iowait irq softirq steal (guest time is counted in user already)
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]
    steal = ticks[7] if len(ticks) > 7 else 0
    return CpuTimes(busy / hz, steal / hz, time.process_time(), time.monotonic())


def _follow(estimate: float, reading: float) -> float:
    """The next estimate of a CPU count others take: a higher reading at once, a lower one by the
    running average (a neighbour that comes is yielded to within a reading; one that goes is
    believed gone after a few)."""
    return reading if reading >= estimate else (1 - SMOOTHING) * estimate + SMOOTHING * reading


class CpuWatch:
    """Reads the machine every ``SAMPLE_S`` on a thread of its own (``s2s.cpu_watch``) and keeps a
    running estimate of what the others take; ``share()`` is the latest (any thread)."""

    def __init__(
        self,
        read: Callable[[], CpuTimes | None] = read_times,
        quota: Callable[[], float | None] = cgroup_quota,
        cpus: Callable[[], int] = affinity_cpus,
        interval_s: float = SAMPLE_S,
    ) -> None:
        self._read = read
        self._quota = quota
        self._cpus = cpus
        self.interval_s = interval_s
        self._last: CpuTimes | None = None
        self._share = CpuShare(cpus(), quota())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.readings = 0
        """Readings taken so far (each after the first one updates the estimate)."""

    def share(self) -> CpuShare:
        with self._lock:
            return self._share

    def sample(self) -> CpuShare:
        """Take a reading now and fold it into the estimate (the watch thread, or a test)."""
        now = self._read()
        with self._lock:
            last, self._last = self._last, now
            share = self._share
            share = CpuShare(self._cpus(), self._quota(), share.others, share.steal)
            if now is not None and last is not None and now.at > last.at:
                wall = now.at - last.at
                others = max(0.0, (now.busy_s - last.busy_s) - (now.own_s - last.own_s)) / wall
                steal = max(0.0, now.steal_s - last.steal_s) / wall
                first = self.readings <= 1
                share = CpuShare(
                    share.cpus,
                    share.quota,
                    others if first else _follow(share.others, others),
                    steal if first else _follow(share.steal, steal),
                )
            self._share = share
            self.readings += 1
            return share

    def start(self) -> None:
        """Begin reading on the watch thread (a daemon thread; ``stop`` ends it)."""
        if self._thread is not None:
            return
        self.sample()
        self._thread = threading.Thread(target=self._run, name="s2s.cpu_watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.interval_s + 1.0)


# --------------------------------------------------------------------------- the engine's


class ThreadPolicy:
    """The CPU engine's intra-op threads: ``fixed``, or (None) following ``CpuWatch``.

    ``start`` and ``adjust`` run on the engine thread: ``set_threads`` (``torch.set_num_threads``)
    changes the OpenMP team of the thread that calls it, between two parallel regions.
    """

    def __init__(
        self,
        fixed: int | None,
        default: int,
        set_threads: Callable[[int], None],
        watch: CpuWatch | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fixed = fixed
        self.default = default
        """torch's own count (``OMP_NUM_THREADS`` when set): never more."""
        self._set = set_threads
        self.watch = watch if watch is not None or fixed is not None else CpuWatch()
        self._clock = clock
        self.threads = fixed or 1
        """The count in force."""
        self._checked_at = float("-inf")

    def start(self) -> int:
        """Set the first count and log it with what it rests on; starts the watch (auto)."""
        if self.fixed is not None:
            self._set(self.fixed)
            log.info("engine_threads", threads=self.fixed, chosen="configured", wait=wait_policy())
            return self.fixed
        assert self.watch is not None
        self.watch.start()
        share = self.watch.share()
        ceiling = ceiling_threads(share, self.default)
        self.threads, _ = choose_threads(share, ceiling)
        self._set(self.threads)
        self._checked_at = self._clock()
        log.info(
            "engine_threads",
            threads=self.threads,
            chosen="auto",
            ceiling=ceiling,
            cpus=share.cpus,
            cpu_quota=share.quota,
            wait=wait_policy(),
            recheck_s=self.watch.interval_s,
        )
        return self.threads

    def adjust(self) -> int:
        """(Engine thread, between frames) follow the watch's latest estimate, at most once per
        reading; returns the count in force."""
        watch = self.watch
        if self.fixed is not None or watch is None:
            return self.threads
        now = self._clock()
        if now - self._checked_at < watch.interval_s:
            return self.threads
        self._checked_at = now
        share = watch.share()
        ceiling = ceiling_threads(share, self.default)
        threads, reason = choose_threads(share, ceiling, self.threads)
        if threads != self.threads:
            log.info(
                "engine_threads_changed",
                threads=threads,
                was=self.threads,
                reason=reason,
                free_cpus=round(share.free, 2),
                others_cpus=round(share.others, 2),
                steal_cpus=round(share.steal, 2),
                cpu_quota=share.quota,
            )
            self._set(threads)
            self.threads = threads
        return self.threads

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
