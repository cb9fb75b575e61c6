"""One builder at a time for a cache built on demand (the native kernels, prepared weights, clone
prompts), with a lock that ends with its holder.

The lock is ``fcntl.flock`` on a file beside what is built: the kernel releases it when its holder
exits, however it exits (SIGKILL, a service manager's start timeout, a power cut), so a start
killed mid-build never leaves a lock behind that a later start waits on for ever (torch's own
``lock`` file does: ``native`` removes it under this lock). A start that finds the lock held waits
at most ``wait_s()`` seconds, saying who holds it (``holders.describe``), then goes on without the
cache (``BuildLockTimeout``); a start that is stopped meanwhile does not wait for the wait to end
(``app.Daemon`` stops while the engine loads).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from s2s_daemon.holders import describe, file_lock_holder
from s2s_daemon.progress import Progress

log = structlog.get_logger(__name__)

WAIT_S = 600.0
"""Seconds a start waits for another process's build (a first kernel build on a busy small machine
takes a few minutes); ``S2S_BUILD_LOCK_WAIT_S`` overrides it."""
WAIT_ENV = "S2S_BUILD_LOCK_WAIT_S"
POLL_S = 0.1
"""Seconds between two tries of a held lock."""


class BuildLockTimeout(Exception):
    """Another process held the lock for longer than the wait; the message names it."""

    def __init__(self, what: str, path: Path, holder: str | None, timeout_s: float) -> None:
        self.what = what
        self.path = path
        self.holder = holder
        self.timeout_s = timeout_s
        by = holder or "another process"
        super().__init__(f"{by} has been building {what} for more than {timeout_s:g} s (lock {path})")


def wait_s() -> float:
    """The bound of a wait: ``S2S_BUILD_LOCK_WAIT_S`` when set to a number, else ``WAIT_S``."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    try:
        return max(0.0, float(raw)) if raw else WAIT_S
    except ValueError:
        log.warning("build_lock_wait_ignored", variable=WAIT_ENV, value=raw, used_s=WAIT_S)
        return WAIT_S


def holder_of(path: Path) -> str | None:
    """Who holds the lock at ``path`` (``pid 1234 (s2s-daemon run ...)``), None when nobody we can see."""
    pid = file_lock_holder(path)
    return describe(pid) if pid is not None else None


@contextlib.contextmanager
def build_lock(path: Path, what: str, timeout_s: float | None = None) -> Iterator[float]:
    """Hold the lock at ``path`` while building ``what``; yields the seconds waited for it.

    Raises ``BuildLockTimeout`` after ``timeout_s`` (default ``wait_s()``) of another holder, and
    OSError when the lock file cannot be made (a read-only cache: the caller builds without it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        waited = 0.0 if _try(fd) else _wait(fd, path, what, wait_s() if timeout_s is None else timeout_s)
        yield waited
    finally:
        os.close(fd)  # releases the lock


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _wait(fd: int, path: Path, what: str, timeout_s: float) -> float:
    started = time.monotonic()
    holder = holder_of(path)
    log.info("build_lock_waiting", what=what, holder=holder, lock=str(path), wait_s=round(timeout_s, 1))
    with Progress("waiting_for_build", expected_s=timeout_s, started=None, done=None, what=what, holder=holder):
        while not _try(fd):
            waited = time.monotonic() - started
            if waited >= timeout_s:
                holder = holder_of(path) or holder
                log.warning("build_lock_timeout", what=what, holder=holder, lock=str(path), waited_s=round(waited, 1))
                raise BuildLockTimeout(what, path, holder, timeout_s)
            time.sleep(POLL_S)
    waited = time.monotonic() - started
    log.info("build_lock_taken", what=what, lock=str(path), waited_s=round(waited, 1))
    return waited
