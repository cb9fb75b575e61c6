"""The shipped configuration runs every kind of checkpoint: its default voice (``tts.voice: auto``)
follows the model, and ``check-config`` says what ``run`` then does (issue 41, item 5: a Base or
VoiceDesign model loaded, then exited 78 on ``voice: Ryan``, while ``check-config`` said valid)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.broker import Mosquitto
from tests.support.daemon import REPO, DaemonProcess

pytestmark = [pytest.mark.torch]

FIXTURES = REPO / "tests" / "fixtures" / "qwen3_tiny"
DEFAULT_YAML = REPO / "configs" / "default.yaml"


def _env(tmp_path: Path, port: int, model: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_") or k in ("S2S_PREPARED_CACHE",)}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "XDG_DATA_HOME": str(tmp_path / "data"),  # an empty voice library
            "S2S_TTS__MODEL": str(model),
            "S2S_TTS__OPTIONS__MAX_FRAMES": "2",
            "S2S_MQTT__BROKER": "external",
            "S2S_MQTT__PORT": str(port),
            "S2S_AUDIO__SINK": "discard",
            "S2S_JOURNAL__PATH": str(tmp_path / "journal.sqlite3"),
            "S2S_LOG__FORMAT": "json",
            **extra,
        }
    )
    return env


def _check_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "check-config", str(DEFAULT_YAML)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["base", "voice_design"])
async def test_the_default_configuration_runs_a_base_and_a_voice_design_model(
    tmp_path: Path, mosquitto: Mosquitto, kind: str
) -> None:
    env = _env(tmp_path, mosquitto.port, FIXTURES / kind)
    checked = _check_config(env)
    assert checked.returncode == 0, checked.stderr
    assert "valid" in checked.stdout
    proc = DaemonProcess(DEFAULT_YAML, env=env, log_path=tmp_path / "daemon.log")
    proc.env = env
    try:
        proc.start("run", "-c", str(DEFAULT_YAML))
        deadline = time.monotonic() + 240
        while '"event": "ready"' not in proc.log():
            assert proc.proc is not None and proc.proc.poll() is None, proc.log()  # before: exit 78 after loading
            assert time.monotonic() < deadline, proc.log()
            await asyncio.sleep(0.2)
        if kind == "base":
            assert '"event": "no_default_voice"' in proc.log()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(60) == 0, proc.log()
    finally:
        proc.cleanup()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_voice_design_models_voice_may_be_a_design_voice_of_the_library(tmp_path: Path) -> None:
    voices = tmp_path / "data" / "s2s-daemon" / "voices" / "narrator"
    voices.mkdir(parents=True)
    (voices / "instruct.txt").write_text("A calm, low voice.\n")
    model = FIXTURES / "voice_design"
    assert _check_config(_env(tmp_path, 1883, model, S2S_TTS__VOICE="narrator")).returncode == 0
    wrong = _check_config(_env(tmp_path, 1883, model, S2S_TTS__VOICE="nobody"))
    assert wrong.returncode == 78, wrong.stderr
    assert "tts.voice: voice 'nobody' is not in the voice library" in wrong.stderr
    assert "its design voices: narrator" in wrong.stderr  # not "voices add --ref-audio" (a clone)
