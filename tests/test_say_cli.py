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
