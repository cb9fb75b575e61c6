"""A cache built on demand is built by one process at a time, under a lock that ends with its
holder: a start killed mid-build leaves nothing that later starts wait on; a live builder is
waited for a bounded time, by name; a daemon waiting for it stops when asked (issue 41, item 2).

The native-kernel tests stand a real start in for the killed one: ``python -m
s2s_daemon.tts.torch_qwen3.native`` with a ``ninja`` that never ends (so torch's own ``lock`` file
is taken as in a real compile), in a build folder copied from this environment's build without its
``.so`` (so the start that follows links in a second instead of compiling for a minute).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from s2s_daemon import build_lock
from s2s_daemon.build_lock import BuildLockTimeout
from tests.support.broker import Mosquitto
from tests.support.daemon import REPO, DaemonProcess, write_config

TINY = REPO / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def _holder(lock: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(30)
def test_a_held_lock_is_waited_for_a_bounded_time_naming_its_holder(tmp_path: Path) -> None:
    lock = tmp_path / "cache" / "x.lock"
    lock.parent.mkdir()
    holder = _holder(lock)
    try:
        started = time.monotonic()
        with structlog.testing.capture_logs() as logs, pytest.raises(BuildLockTimeout) as caught:
            with build_lock.build_lock(lock, "the test cache", timeout_s=0.5):
                pytest.fail("the lock was taken while another process held it")
        assert 0.5 <= time.monotonic() - started < 10
        assert f"pid {holder.pid} (" in str(caught.value) and "-c" in str(caught.value)
        assert "the test cache" in str(caught.value)
        waiting = next(e for e in logs if e["event"] == "build_lock_waiting")
        assert waiting["holder"].startswith(f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(30)
def test_a_lock_whose_holder_was_killed_is_taken_at_once(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    holder = _holder(lock)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock.exists()  # the file stays; the lock went with its holder
    with build_lock.build_lock(lock, "the test cache", timeout_s=0.0) as waited:
        assert waited == 0.0


def test_the_wait_bound_is_no_configuration_key() -> None:
    from s2s_daemon.config import load_config

    assert load_config(None, {build_lock.WAIT_ENV: "5"}).site_id == "default"  # not "unknown key"


def test_the_wait_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build_lock.WAIT_ENV, "2.5")
    assert build_lock.wait_s() == 2.5
    monkeypatch.setenv(build_lock.WAIT_ENV, "soon")
    assert build_lock.wait_s() == build_lock.WAIT_S
    monkeypatch.delenv(build_lock.WAIT_ENV)
    assert build_lock.wait_s() == build_lock.WAIT_S


# --------------------------------------------------------------------------- the native kernels


@pytest.fixture
def seeded(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(TORCH_EXTENSIONS_DIR, build folder): this environment's build, copied without its ``.so``."""
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")
    built = native.build_folder()
    if not native.is_built(built):
        pytest.skip(f"no build in {built} yet (python -m s2s_daemon.tts.torch_qwen3.native makes it)")
    root = tmp_path / "extensions"
    folder = root / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("*.so", "lock", "*.lock"))
    yield root, folder


def _env(root: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(root),
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **extra,
    }


@pytest.fixture
def stuck_build(tmp_path: Path, seeded: tuple[Path, Path]) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """(a start stuck in its kernel build, holding torch's lock as a real compile does, TORCH_EXTENSIONS_DIR,
    build folder); killed with its process group at the end."""
    root, folder = seeded
    real = shutil.which("ninja")
    if real is None:
        pytest.skip("ninja is not on PATH")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "compiling"
    ninja = bin_dir / "ninja"
    ninja.write_text(f'#!/bin/sh\ncase "$1" in --version) exec {real} "$@";; esac\ntouch {marker}\nexec sleep 600\n')
    ninja.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "s2s_daemon.tts.torch_qwen3.native"],
        cwd=REPO,
        env=_env(root, PATH=path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its ninja too, as a terminal's Ctrl-C or a service manager kills both
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "the stand-in build ended"
            assert time.monotonic() < deadline, "the stand-in build never reached its compile"
            time.sleep(0.05)
        assert (folder / "lock").exists()  # torch's FileBaton, as a killed build leaves it
        yield proc, root, folder
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _prebuild(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "s2s_daemon.tts.torch_qwen3.native"],
        cwd=REPO,
        env=_env(root, **env),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_a_start_after_one_killed_mid_build_builds(stuck_build: tuple[subprocess.Popen[bytes], Path, Path]) -> None:
    proc, root, folder = stuck_build
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (folder / "lock").exists()
    done = _prebuild(root)  # before the fix: torch waited on its lock file for ever (TimeoutExpired)
    assert done.returncode == 0, done.stderr
    assert str(folder / "s2s_qwen3_linear.so") in done.stdout


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_a_start_beside_a_live_build_waits_a_bounded_time_and_names_it(
    stuck_build: tuple[subprocess.Popen[bytes], Path, Path],
) -> None:
    proc, root, _ = stuck_build
    started = time.monotonic()
    done = _prebuild(root, S2S_BUILD_LOCK_WAIT_S="2")
    assert time.monotonic() - started < 60
    assert done.returncode == 1, done.stdout
    assert f"pid {proc.pid} (s2s_daemon.tts.torch_qwen3.native)" in done.stderr, done.stderr
    assert "has been building the native kernels for more than 2 s" in done.stderr
    assert proc.poll() is None  # the live build is left alone


def _torch_daemon(tmp_path: Path, port: int, root: Path, drain_s: float = 2.0) -> DaemonProcess:
    config = write_config(
        tmp_path / "d.yaml",
        port,
        tts={"engine": "torch", "model": str(TINY), "torch": {"kernels": "native"}, "options": {}},
        shutdown={"drain_timeout_s": drain_s},
    )
    return DaemonProcess(config, env={"TORCH_EXTENSIONS_DIR": str(root)})


async def _wait_log(proc: DaemonProcess, text: str, timeout_s: float) -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while text not in proc.log():
        assert proc.proc is not None and proc.proc.poll() is None, proc.log()
        assert time.monotonic() < deadline, f"no {text!r} in:\n{proc.log()}"
        await asyncio.sleep(0.1)


@pytest.mark.torch
@pytest.mark.timeout(240)
async def test_the_daemon_starts_after_a_start_killed_mid_build(
    tmp_path: Path, mosquitto: Mosquitto, stuck_build: tuple[subprocess.Popen[bytes], Path, Path]
) -> None:
    holder, root, _ = stuck_build
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    proc = _torch_daemon(tmp_path, mosquitto.port, root)
    try:
        proc.start()
        await _wait_log(proc, '"event": "ready"', 150)
        assert "native_kernels_stale_lock_removed" in proc.log()
        assert '"kernels": "native"' in proc.log()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(30) == 0, proc.log()
    finally:
        proc.cleanup()


@pytest.mark.torch
@pytest.mark.timeout(240)
async def test_sigterm_ends_a_daemon_waiting_for_a_build_within_its_drain_timeout(
    tmp_path: Path, mosquitto: Mosquitto, stuck_build: tuple[subprocess.Popen[bytes], Path, Path]
) -> None:
    holder, root, _ = stuck_build
    proc = _torch_daemon(tmp_path, mosquitto.port, root, drain_s=2.0)
    try:
        proc.start()
        await _wait_log(proc, '"event": "build_lock_waiting"', 150)
        assert f"pid {holder.pid} (s2s_daemon.tts.torch_qwen3.native)" in proc.log()
        sent = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(30) == 0, proc.log()
        assert time.monotonic() - sent < 2.0 + 5, proc.log()
        assert "load_abandoned" in proc.log()
    finally:
        proc.cleanup()


# --------------------------------------------------------------------------- prepared weights, clone prompts


def _prepared_engine(root: Path) -> object:
    from s2s_daemon.tts.engine import EngineOptions
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

    options = EngineOptions(model=str(TINY), device="cpu", dtype="float32", quantization="int8", kernels="native",
                            extra={"prepared_cache": str(root)})  # fmt: skip
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    engine.close_blocking()
    return engine


@pytest.fixture
def kernels() -> None:
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None or native.load() is None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here() or native.unavailable_reason()}")


@pytest.mark.torch
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("kernels", "torch_one_thread")
def test_a_start_waits_for_the_process_preparing_its_weights_and_maps_them(tmp_path: Path) -> None:
    """A second start of the same model while the first prepares its weights: it waits (naming
    the first), then maps what the first wrote; it neither prepares them again nor waits for ever."""
    import concurrent.futures

    made = tmp_path / "made"
    _prepared_engine(made)  # what the first start will have written
    (entry,) = [p for p in made.iterdir() if not p.name.startswith(".")]
    root = tmp_path / "prepared"
    root.mkdir()
    holder = _holder(root / f".lock-{entry.name}")
    try:
        with structlog.testing.capture_logs() as logs, concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(_prepared_engine, root)
            deadline = time.monotonic() + 120
            while not any(e["event"] == "build_lock_waiting" for e in logs):
                assert not second.done(), second.exception() or logs
                assert time.monotonic() < deadline
                time.sleep(0.05)
            shutil.copytree(entry, root / entry.name)  # the first start's rename
            holder.kill()
            holder.wait()
            second.result(timeout=120)
        waiting = next(e for e in logs if e["event"] == "build_lock_waiting")
        assert waiting["holder"].startswith(f"pid {holder.pid}") and waiting["what"] == "the prepared weights"
        ready = next(e for e in logs if e["event"] == "talker_weights_ready")
        assert ready["source"] == "mapped"
        assert not any(e.get("step") == "preparing_weights" for e in logs)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.torch
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("kernels", "torch_one_thread")
def test_a_start_stops_waiting_for_a_stuck_preparer_and_keeps_its_weights_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = tmp_path / "made"
    _prepared_engine(made)
    (entry,) = [p for p in made.iterdir() if not p.name.startswith(".")]
    root = tmp_path / "prepared"
    root.mkdir()
    holder = _holder(root / f".lock-{entry.name}")
    monkeypatch.setenv(build_lock.WAIT_ENV, "0.5")
    try:
        with structlog.testing.capture_logs() as logs:
            _prepared_engine(root)
        warning = next(e for e in logs if e["event"] == "prepared_cache_not_written")
        assert f"pid {holder.pid} (" in warning["reason"] and "more than 0.5 s" in warning["reason"]
        assert next(e for e in logs if e["event"] == "talker_weights_ready")["source"] == "memory"
        assert not (root / entry.name).exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_a_clone_prompt_another_process_computes_is_computed_here_after_a_bounded_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import clone_cache

    recording = tmp_path / "ref.wav"
    recording.write_bytes(b"RIFF....WAVEfmt not really audio")
    cache = clone_cache.ClonePromptCache("model|cpu|float32", tmp_path / "voices", torch.device("cpu"))
    key = cache.key(str(recording), False)
    (tmp_path / "voices").mkdir()
    holder = _holder(tmp_path / "voices" / f".{key}.lock")
    monkeypatch.setattr(clone_cache, "LOCK_WAIT_S", 0.3)
    calls: list[str] = []

    def compute(path: str, with_codes: bool) -> clone_cache.ClonePrompt:
        calls.append(path)
        return clone_cache.ClonePrompt(torch.ones(4), None)

    try:
        with structlog.testing.capture_logs() as logs:
            prompt = cache.get(str(recording), False, compute)
        assert calls == [str(recording)] and torch.equal(prompt.speaker, torch.ones(4))
        unlocked = next(e for e in logs if e["event"] == "clone_prompt_unlocked")
        assert f"pid {holder.pid} (" in unlocked["reason"]
    finally:
        holder.kill()
        holder.wait()
    fresh = clone_cache.ClonePromptCache("model|cpu|float32", tmp_path / "voices", torch.device("cpu"))
    assert torch.equal(fresh.get(str(recording), False, compute).speaker, torch.ones(4)) and len(calls) == 1
