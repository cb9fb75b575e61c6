"""``s2s-daemon say`` as a user runs it, on a fine-tuned CustomVoice checkpoint whose speakers
are not the built-in default voice (``Ryan``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from s2s_daemon.errors import EXIT_CONFIG, EXIT_OK
from tests.support.daemon import REPO

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.timeout(90)]

TINY = REPO / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ft") / "model"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    talker = config["talker_config"]
    talker["spk_id"] = {"kitchen_anna": 1146, "hall_bob": 1145}
    talker["spk_is_dialect"] = {"kitchen_anna": False, "hall_bob": False}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def say(model: Path, out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "s2s_daemon", "say", "Hello there.", "--model", str(model)]
    command += ["--out", str(out), "--greedy", *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    environ.update({"S2S_TTS__OPTIONS__MAX_FRAMES": "4", **(env or {})})
    return subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=80)


@pytest.mark.parametrize("args", [("--voice", "hall_bob"), ()], ids=["voice-given", "no-voice"])
def test_say_speaks_a_fine_tuned_models_voice(fine_tuned: Path, tmp_path: Path, args: tuple[str, ...]) -> None:
    out = tmp_path / "out.wav"
    done = say(fine_tuned, out, *args)
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    with wave.open(str(out)) as wav:
        assert wav.getnframes() > 0
    if not args:  # the built-in default is not this model's: its first speaker, said in the log
        assert '"voice_default"' in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "env", "key"),
    [(("--voice", "Ryan"), {}, "--voice"), ((), {"S2S_TTS__VOICE": "Ryan"}, "tts.voice")],
    ids=["cli", "configured"],
)
def test_say_names_the_unknown_voice_and_its_source(
    fine_tuned: Path, tmp_path: Path, args: tuple[str, ...], env: dict[str, str], key: str
) -> None:
    done = say(fine_tuned, tmp_path / "out.wav", *args, env=env)
    assert done.returncode == EXIT_CONFIG
    assert f"{key}: voice 'Ryan' is unknown; choose one of Kitchen_Anna, Hall_Bob" in done.stderr


def _say(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    environ.update({"S2S_TTS__OPTIONS__MAX_FRAMES": "4", "S2S_LOG__LEVEL": "warning", **(env or {})})
    command = [sys.executable, "-m", "s2s_daemon", "say", *args]
    return subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=80)


def test_a_base_model_without_a_voice_says_which_flag_to_use(tmp_path: Path) -> None:
    base = REPO / "tests" / "fixtures" / "qwen3_tiny" / "base"
    done = _say("Hello there.", "--model", str(base), "--out", str(tmp_path / "x.wav"),
                env={"XDG_DATA_HOME": str(tmp_path / "data")})  # fmt: skip
    assert done.returncode == 64, done.stderr  # before: exit 1 and JSON lines only
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("s2s-daemon:")]
    assert "has no default voice" in line and "use --voice NAME" in line and "--ref-audio FILE.wav" in line
    assert not (tmp_path / "x.wav").exists()


def test_say_without_a_sound_device_says_the_audio_was_discarded(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "PULSE_SERVER": "unix:/nonexistent", "HOME": str(tmp_path)}
    done = _say("Hello there.", "--model", str(TINY), "--greedy", env=env)
    if "audio_sink_selected" not in done.stderr and Path("/dev/snd").exists():
        pytest.skip("this machine has a sound card")
    assert done.returncode == 0, done.stderr
    assert "s2s-daemon: no sound device:" in done.stderr and "discarded" in done.stderr and "--out" in done.stderr
