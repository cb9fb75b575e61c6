"""``s2s-daemon say -``: standard input spoken as it is written, sentence by sentence."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest
import yaml

from tests.support.daemon import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def start(tmp_path: Path, out: Path) -> subprocess.Popen[bytes]:
    config = tmp_path / "say.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tts": {"engine": "tone", "options": {"speed": "0", "ms_per_char": "80"}, "warmup": False},
                "log": {"format": "json", "level": "debug"},
                "journal": {"enabled": False},
            }
        )
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    environ["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "tests.support.tone_daemon", "say", "-", "-c", str(config), "--out", str(out)]
    return subprocess.Popen(
        command, cwd=REPO, env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def wav_ms(path: Path) -> float:
    with wave.open(str(path)) as wav:
        return 1000.0 * wav.getnframes() / wav.getframerate()


def test_say_dash_speaks_each_sentence_before_its_input_ends(tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    proc = start(tmp_path, out)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("你好。再".encode())
    proc.stdin.flush()
    lines: list[bytes] = []
    deadline = time.monotonic() + 30
    while not any(b"segment_synthesized" in line for line in lines):  # the first sentence, spoken
        assert time.monotonic() < deadline and proc.poll() is None, b"".join(lines).decode(errors="replace")
        lines.append(proc.stdout.readline())
    proc.stdin.write("见".encode()[:2])  # a character split across two reads
    proc.stdin.flush()
    time.sleep(0.2)  # the scenario: a pause, so that the character's two halves come in two reads
    proc.stdin.write("见".encode()[2:] + "。".encode())
    proc.stdin.close()
    rest = proc.stdout.read()
    proc.stdout.close()
    proc.wait(30)
    log = b"".join(lines).decode() + rest.decode()
    assert proc.returncode == 0, log
    assert log.count("segment_synthesized") == 2
    assert "\ufffd" not in log
    # 3 + 3 characters of 80 ms each, and the pause between the two sentences
    assert wav_ms(out) == pytest.approx(6 * 80 + 150, abs=1)


def test_say_dash_with_empty_input_fails(tmp_path: Path) -> None:
    proc = start(tmp_path, tmp_path / "out.wav")
    output, _ = proc.communicate(b"", timeout=30)
    assert proc.returncode == 1, output.decode()
    assert b"empty_text" in output
