"""A cache built on demand is built by one process at a time, under a lock that ends with its
holder: a start killed mid-build leaves nothing that later starts wait on; a live builder is
waited for a bounded time, by name; a daemon waiting for it stops when asked (issue 41, item 2).

The daemon tests stand a process holding the lock of the prepared weights' entry in for a start
stuck preparing them (the native kernels are built at install, never at run time).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
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


@pytest.mark.integration
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


@pytest.mark.integration
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


def _torch_daemon(tmp_path: Path, port: int, prepared: Path, drain_s: float = 2.0) -> DaemonProcess:
    config = write_config(
        tmp_path / "d.yaml",
        port,
        tts={
            "engine": "torch",
            "model": str(TINY),
            "torch": {"kernels": "native", "quantization": "int8"},
            "options": {"prepared_cache": str(prepared)},
        },
        shutdown={"drain_timeout_s": drain_s},
    )
    return DaemonProcess(config)


async def _wait_log(proc: DaemonProcess, text: str, timeout_s: float) -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while text not in proc.log():
        assert proc.proc is not None and proc.proc.poll() is None, proc.log()
        assert time.monotonic() < deadline, f"no {text!r} in:\n{proc.log()}"
        await asyncio.sleep(0.1)


def _held_entry(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """(a process holding the lock of the tiny model's prepared-weights entry, the cache root): a
    start stuck preparing them, as a killed or slow first start would be."""
    made = tmp_path / "made"
    _prepared_engine(made)
    (entry,) = [p for p in made.iterdir() if not p.name.startswith(".")]
    root = tmp_path / "prepared"
    root.mkdir()
    return _holder(root / f".lock-{entry.name}"), root


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("kernels", "torch_one_thread")
async def test_the_daemon_starts_after_a_preparer_was_killed(tmp_path: Path, mosquitto: Mosquitto) -> None:
    holder, root = _held_entry(tmp_path)
    holder.kill()  # SIGKILL mid-build: the kernel releases its lock with it
    holder.wait()
    proc = _torch_daemon(tmp_path, mosquitto.port, root)
    try:
        proc.start()
        await _wait_log(proc, '"event": "ready"', 150)
        assert "build_lock_waiting" not in proc.log()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(30) == 0, proc.log()
    finally:
        proc.cleanup()


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("kernels", "torch_one_thread")
async def test_sigterm_ends_a_daemon_waiting_for_a_build_within_its_drain_timeout(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    holder, root = _held_entry(tmp_path)
    proc = _torch_daemon(tmp_path, mosquitto.port, root, drain_s=2.0)
    try:
        proc.start()
        await _wait_log(proc, '"event": "build_lock_waiting"', 150)
        assert f"pid {holder.pid} (" in proc.log()
        sent = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(30) == 0, proc.log()
        assert time.monotonic() - sent < 2.0 + 5, proc.log()
        assert "load_abandoned" in proc.log()
    finally:
        proc.cleanup()
        holder.kill()
        holder.wait()


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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
