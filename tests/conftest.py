from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.support.broker import Mosquitto
from tests.support.tone_engine import register

# The torch engine's prepared weights (packed talkers) of the tests' throwaway checkpoints go to a
# folder of this run, not the user's cache (subprocess daemons inherit it).
_PREPARED = tempfile.TemporaryDirectory(prefix="s2s-prepared-")
os.environ.setdefault("S2S_PREPARED_CACHE", _PREPARED.name)
# Likewise the clone prompts of the reference recordings (the torch engine's voice cache).
_VOICES = tempfile.TemporaryDirectory(prefix="s2s-voice-cache-")
os.environ.setdefault("S2S_VOICE_CACHE", _VOICES.name)
# A benchmark run with --doc in a test writes a scratch page, never docs/performance.md.
os.environ.setdefault("S2S_BENCH_DOC", os.path.join(_PREPARED.name, "performance.md"))

register()


# MLX keeps a compile cache per thread. Tests drive the mlx engine from pytest's own thread (the
# daemon never does: its engine runs on a thread that is never ended), and that thread's cache is
# destroyed after the interpreter has finalized; destroying entries that hold Python functions then
# segfaults (exit 139 after every test passed: PyGILState_Ensure from CompileCache's destructor in
# __call_tls_dtors, seen with the mlx tests of one run). So the test process ends with the status
# pytest chose, once atexit's handlers registered after this one (MLX's among them) have run.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@atexit.register
def _exit_before_native_teardown() -> None:
    if not _EXIT_STATUS or "mlx.core" not in sys.modules:
        return
    _PREPARED.cleanup()
    _VOICES.cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """A test that runs the CLI in-process configures logging (``warning`` and up): later tests
    that capture ``info`` events would see nothing. Every test starts from structlog's defaults."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def persistent_mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path, persistence=True)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """One torch intra-op thread for a module (``pytest.mark.usefixtures``): the tiny fixtures'
    small products and convs run several times faster without a second thread spinning on a
    shared 2-core box. The setting before is restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the fast tier starts no process ----------------------------------------------------------------
# `scripts/test --fast` runs the tests without the marks below (docs/development.md, "Test tiers").
# A test that starts a process (the daemon, mosquitto, PulseAudio, chromium, a CLI, any tool) is
# marked `integration` (or `browser`, `container`); an unmarked one that starts one fails here, in
# every run, naming the mark. Setup and teardown count: a fixture's process is its test's.

PROCESS_MARKS = ("integration", "browser", "container")
PROBES = {("ninja", "--version"), ("ldconfig", "-p")}
"""What libraries run on their own to look around, allowed: torch's extension loader asks for ninja's
version each time it loads our native kernels (built or not), ``ctypes.util.find_library`` asks
ldconfig (PortAudio's, asound's)."""


def _refuse_processes(item: pytest.Item) -> Callable[[], None]:
    """Make starting a process fail ``item``; returns the undo."""

    def refuse(what: object) -> None:
        pytest.fail(
            f"{item.nodeid} starts a process ({what!r}) but is not marked integration (or browser, container): "
            "mark it, or keep it in the fast tier without the process (docs/development.md, Test tiers)"
        )

    def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(arg) for arg in args] if isinstance(args, list | tuple) else [str(args)]
        if (os.path.basename(argv[0]), *argv[1:]) in PROBES:
            popen_init(self, args, *rest, **kwargs)
            return
        refuse(args)

    def starter(name: str) -> Callable[..., Any]:
        def start(*args: Any, **kwargs: Any) -> Any:
            refuse(f"os.{name}{args[:2]!r}")

        return start

    popen_init = subprocess.Popen.__init__
    saved: list[tuple[object, str, object]] = [(subprocess.Popen, "__init__", popen_init)]
    subprocess.Popen.__init__ = popen  # type: ignore[method-assign]
    for name in ("fork", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            saved.append((os, name, getattr(os, name)))
            setattr(os, name, starter(name))

    def undo() -> None:
        for owner, name, original in saved:
            setattr(owner, name, original)

    return undo


def _guarded(item: pytest.Item) -> Generator[None, object, object]:
    if any(item.get_closest_marker(mark) for mark in PROCESS_MARKS):
        return (yield)
    undo = _refuse_processes(item)
    try:
        return (yield)
    finally:
        undo()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    return (yield from _guarded(item))
