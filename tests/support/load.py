"""A shared machine for tests and benchmarks: busy neighbours, and a cgroup CPU quota.

``busy_neighbours(n)``: ``n`` processes that spin on a CPU each (``python -c 'while True: pass'``),
each in a session of its own (another program, for the scheduler's autogroups), ended on exit.
``CpuQuota(cpus)``: a cgroup with a CPU quota (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``,
what a systemd ``CPUQuota=`` or a container's ``--cpus`` sets) that a process is moved into;
``CpuQuota.unavailable()`` says why it cannot be made here (not root, no cpu controller).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes spinning on the CPU for as long as the block runs."""
    # A session of its own each: with the kernel's autogroup scheduling, a process in the caller's
    # session would share the caller's group's CPU time instead of competing as another program.
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(max(0, count))
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


class CpuQuota:
    """A cgroup of its own with ``cpus`` CPUs of quota; ``add(pid)`` moves a process into it."""

    def __init__(self, cpus: float, name: str | None = None) -> None:
        self.cpus = cpus
        self.name = name or f"s2s-quota-{os.getpid()}"
        self.folder: Path | None = None

    @staticmethod
    def _mount() -> tuple[str, Path] | None:
        """(``v2`` or ``v1``, the folder new cgroups with a cpu controller go in)."""
        v2 = CGROUP / "cgroup.controllers"
        if v2.is_file() and "cpu" in v2.read_text().split():
            return "v2", CGROUP
        for folder in (CGROUP / "cpu", CGROUP / "cpu,cpuacct"):
            if (folder / "cpu.cfs_quota_us").is_file():
                return "v1", folder
        return None

    @classmethod
    def unavailable(cls) -> str | None:
        """Why no quota can be set here, or None."""
        mount = cls._mount()
        if mount is None:
            return "no cgroup cpu controller is mounted"
        if not os.access(mount[1], os.W_OK):
            return f"{mount[1]} is not writable (run as root)"
        return None

    def __enter__(self) -> CpuQuota:
        mount = self._mount()
        if mount is None or self.unavailable() is not None:
            raise RuntimeError(f"cannot set a CPU quota: {self.unavailable()}")
        kind, root = mount
        folder = root / self.name
        folder.mkdir(exist_ok=True)
        period = 100_000
        if kind == "v2":
            subtree = root / "cgroup.subtree_control"
            if "cpu" not in subtree.read_text().split():
                subtree.write_text("+cpu")
            (folder / "cpu.max").write_text(f"{round(self.cpus * period)} {period}")
        else:
            (folder / "cpu.cfs_period_us").write_text(str(period))
            (folder / "cpu.cfs_quota_us").write_text(str(round(self.cpus * period)))
        self.folder = folder
        return self

    def add(self, pid: int) -> None:
        assert self.folder is not None
        (self.folder / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc: object) -> None:
        folder, self.folder = self.folder, None
        if folder is None:
            return
        parent = folder.parent / "cgroup.procs"
        with contextlib.suppress(OSError):
            for pid in (folder / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    parent.write_text(pid)
        with contextlib.suppress(OSError):
            folder.rmdir()
