"""Which process holds a file lock or listens on a TCP port, so that an error can name it.

Linux only, from ``/proc`` (``/proc/locks``, ``/proc/net/tcp*``, ``/proc/<pid>/fd``); elsewhere, or
when ``/proc`` does not tell (another user's process), the answer is None and the caller says less.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"
"""``st`` of a listening socket in ``/proc/net/tcp``."""


def describe(pid: int) -> str:
    """``pid 1234 (s2s-daemon run -c kitchen.yaml)``; the pid alone when its command line is hidden."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return f"pid {pid}"
    words = [Path(w).name if i == 0 else w for i, w in enumerate(raw.decode(errors="replace").split("\0")) if w]
    if len(words) > 1 and words[0].startswith("python"):  # what a user recognizes: the module or script
        if words[1] == "-m":
            words = words[2:]
        elif not words[1].startswith("-"):
            words = [Path(words[1]).name, *words[2:]]
    command = " ".join(" ".join(words).split())
    if len(command) > 120:
        command = command[:117] + "..."
    return f"pid {pid} ({command})" if command else f"pid {pid}"


def file_lock_holder(path: Path) -> int | None:
    """The pid of another process holding a POSIX or flock lock on ``path`` (SQLite's locks)."""
    try:
        st = path.stat()
        text = (PROC / "locks").read_text()
    except OSError:
        return None
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in text.splitlines():
        fields = line.split()
        # "1: POSIX  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a "->" marks a waiter: skipped)
        if len(fields) < 6 or "->" in fields[1]:
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            found = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if found == wanted and pid != os.getpid():
            return pid
    return None


def port_holder(port: int) -> int | None:
    """The pid of a process listening on TCP ``port`` (any address) that this user may look into."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
            except (IndexError, ValueError):
                continue
    if not inodes:
        return None
    links = {f"socket:[{inode}]" for inode in inodes}
    try:
        pids = [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            fds = list((PROC / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in links:
                    return pid
            except OSError:
                continue
    return None
