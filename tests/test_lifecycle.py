"""The daemon as a real subprocess: signals, drain, Will, broker restarts, exit codes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import REPO, DaemonProcess, write_config
from tests.support.mqtt import Recorder, recorder
from tests.support.wait import until

pytestmark = pytest.mark.integration

SAY = "s2s/kitchen/tts/say"


async def online(rec: Recorder, timeout_s: float = 30) -> None:
    await rec.wait_for(lambda: rec.on("/status") and rec.on("/status")[-1].payload == b"online", timeout_s)


@pytest.mark.timeout(60)
async def test_sigterm_mid_utterance_drains_and_exits_zero(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={"options": {"speed": "1", "ms_per_char": "40"}},
        shutdown={"drain_timeout_s": 4},
    )
    proc = DaemonProcess(config)
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            ids = [f"t{i}" for i in range(6)]
            for i in ids:
                await rec.say(SAY, {"id": i, "text": "a sentence that takes about two seconds."})
            await rec.wait_for(lambda: rec.payloads("/tts/started"))
            sent = time.monotonic()
            proc.signal(signal.SIGTERM)
            code = await proc.wait(15)
            took = time.monotonic() - sent
            assert code == 0, proc.log()
            assert took < 4 + 3, took
            fin = await rec.wait_finished(ids)
            assert fin["t0"]["status"] == "completed"  # the current utterance was finished
            assert {fin[i]["status"] for i in ids[2:]} == {"cancelled"}
            await rec.wait_for(lambda: rec.on("/status")[-1].payload == b"offline")
    finally:
        proc.cleanup()


@pytest.mark.timeout(60)
async def test_drain_timeout_interrupts_a_long_utterance(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={"options": {"speed": "1", "ms_per_char": "200"}},
        shutdown={"drain_timeout_s": 1},
    )
    proc = DaemonProcess(config)
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            await rec.say(SAY, {"id": "long", "text": "this would take many seconds to say in full"})
            await rec.wait_for(lambda: rec.payloads("/tts/started"))
            sent = time.monotonic()
            proc.signal(signal.SIGTERM)
            assert await proc.wait(15) == 0
            assert time.monotonic() - sent < 1 + 3
            fin = await rec.wait_finished(["long"])
            assert fin["long"]["status"] == "interrupted"
    finally:
        proc.cleanup()


@pytest.mark.timeout(60)
async def test_second_sigint_forces_exit(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={"options": {"speed": "1", "ms_per_char": "400"}},
        shutdown={"drain_timeout_s": 30},
    )
    proc = DaemonProcess(config)
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            await rec.say(SAY, {"id": "long", "text": "a very long utterance indeed"})
            await rec.wait_for(lambda: rec.payloads("/tts/started"))
            proc.signal(signal.SIGINT)
            await until(lambda: '"draining"' in proc.log(), 10, "the drain begun")
            assert proc.proc is not None and proc.proc.poll() is None  # still draining
            proc.signal(signal.SIGINT)
            assert await proc.wait(5) == 1
    finally:
        proc.cleanup()


@pytest.mark.timeout(60)
async def test_will_after_kill_9(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = write_config(tmp_path / "d.yaml", mosquitto.port, mqtt={"keepalive_s": 5})
    proc = DaemonProcess(config)
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            proc.signal(signal.SIGKILL)
            await proc.wait(5)
            await rec.wait_for(lambda: rec.on("/status")[-1].payload == b"offline", 20)
        async with recorder(mosquitto.port) as late:  # the retained value is offline too
            await late.wait_for(lambda: late.on("/status"))
            assert late.on("/status")[-1].payload == b"offline"
    finally:
        proc.cleanup()


@pytest.mark.timeout(90)
async def test_broker_restart_mid_burst_loses_nothing(tmp_path: Path, persistent_mosquitto: Mosquitto) -> None:
    broker = persistent_mosquitto
    config = write_config(
        tmp_path / "d.yaml",
        broker.port,
        tts={"options": {"speed": "8"}},
        queue={"max_pending": 500},
        mqtt={"reconnect_max_s": 1},
    )
    proc = DaemonProcess(config)
    accepted: list[str] = []
    try:
        proc.start()
        async with recorder(broker.port, identifier="watcher", persistent=True) as rec:
            await online(rec)
        async with recorder(broker.port, subscribe=(), identifier="producer") as pub:
            for i in range(40):
                await pub.say(SAY, {"id": f"b{i}", "text": "burst"})
                accepted.append(f"b{i}")  # publish() returned: the broker acknowledged (QoS 1)
        await asyncio.to_thread(broker.restart, 1.0)
        async with recorder(broker.port, subscribe=(), identifier="producer") as pub:
            for i in range(40, 80):
                await pub.say(SAY, {"id": f"b{i}", "text": "burst"})
                accepted.append(f"b{i}")
        async with recorder(broker.port, identifier="watcher", persistent=True) as rec:
            fin = await rec.wait_finished(accepted, timeout_s=60)
        statuses = {fin[i]["status"] for i in accepted}
        assert statuses == {"completed"}, statuses
        assert "mqtt_disconnected" in proc.log()
    finally:
        proc.cleanup()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.tone_daemon", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    ("yaml_text", "key"),
    [
        ("mqtt: {port: 99999}\n", "mqtt.port"),
        ("mqtt: {prot: 1883}\n", "mqtt.prot"),
        ("tts: {engine: espeak}\n", "tts.engine"),
        ("tts: {torch: {kernels: fast}}\n", "tts.torch.kernels"),
        ("tts: {torch: {quantization: int3}}\n", "tts.torch.quantization"),
        ("tts: {max_streams: 0}\n", "tts.max_streams"),
        ("tts: {max_streams: 9}\n", "tts.max_streams"),
        ("audio: {sink: wav}\n", "audio"),
        ("queue: {max_pending: zero}\n", "queue.max_pending"),
        ("vad: {frame_ms: 25}\n", "vad.frame_ms"),
        ("- just\n- a list\n", "top level"),
        ("site_id: [unclosed\n", "not valid YAML"),
    ],
)
def test_invalid_config_exits_78_and_names_the_key(tmp_path: Path, yaml_text: str, key: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    for command in (["check-config", str(path)], ["run", "-c", str(path)]):
        result = run_cli(*command)
        assert result.returncode == 78, result.stderr
        assert key in result.stderr, result.stderr


def test_env_override_is_validated(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "S2S_MQTT__PORT": "-1"}
    result = run_cli("check-config", env=env)
    assert result.returncode == 78 and "mqtt.port" in result.stderr


def test_check_config_accepts_the_shipped_configs() -> None:
    """Their keys and values; the files they name are another machine's (``--schema-only``)."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        result = subprocess.run(
            [sys.executable, "-m", "s2s_daemon", "check-config", "--schema-only", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert result.returncode == 0, (path, result.stderr)
        assert "not checked (--schema-only)" in result.stdout
    if not Path("/etc/s2s-daemon/mqtt-password").exists():  # without it, the files are checked too
        result = subprocess.run(
            [sys.executable, "-m", "s2s_daemon", "check-config", str(REPO / "configs" / "linux-cuda.yaml")],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert result.returncode == 78 and "mqtt.password_file: cannot read /etc/s2s-daemon/mqtt-password" in (
            result.stderr
        )


def test_missing_engine_extra_names_the_extra(tmp_path: Path) -> None:
    """With mlx hidden, choosing the mlx engine is a clear error (exit 69) naming the extra."""
    import os

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "mlx.py").write_text("raise ImportError('mlx hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}
    path = tmp_path / "c.yaml"
    path.write_text(f"tts: {{engine: mlx}}\nmqtt: {{port: {free_port()}}}\naudio: {{sink: discard}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "run", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 69, result.stderr
    assert "s2s-daemon[mlx]" in result.stderr
