"""``s2s-daemon say -``: standard input spoken as it is written, sentence by sentence."""

from __future__ import annotations

import os
import signal
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
    assert proc.returncode == 64, output.decode()
    assert b"s2s-daemon: say: the stream closed without text (use the text to speak, or - for standard input)" in output


def _wait_for(proc: subprocess.Popen[bytes], text: bytes, lines: list[bytes]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while not any(text in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, b"".join(lines).decode(errors="replace")
        lines.append(proc.stdout.readline())


def test_ctrl_c_on_say_dash_with_its_input_open_writes_what_was_made_and_exits_130(tmp_path: Path) -> None:
    """``llm | s2s-daemon say -`` stopped with Ctrl-C while the writer is still at it: before,
    the interpreter aborted (SIGABRT, ``Fatal Python error: _enter_buffered_busy``), no WAV."""
    out = tmp_path / "out.wav"
    proc = start(tmp_path, out)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"The first sentence is here. And a second one is com")
    proc.stdin.flush()
    lines: list[bytes] = []
    _wait_for(proc, b"segment_synthesized", lines)
    proc.send_signal(signal.SIGINT)  # the input stays open
    rest = proc.stdout.read()
    proc.wait(30)
    proc.stdin.close()
    proc.stdout.close()
    log = (b"".join(lines) + rest).decode(errors="replace")
    assert proc.returncode == 130, log
    assert "Fatal Python error" not in log and "Traceback" not in log
    assert f"s2s-daemon: interrupted: wrote {out} (" in log
    assert wav_ms(out) == pytest.approx(len("The first sentence is here.") * 80, abs=1)


def test_ctrl_c_on_say_text_stops_and_exits_130(tmp_path: Path) -> None:
    config = tmp_path / "say.yaml"
    tts = {"engine": "tone", "options": {"speed": "1"}, "warmup": False}
    config.write_text(yaml.safe_dump({"tts": tts, "log": {"format": "json", "level": "debug"}}))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    environ["PYTHONPATH"] = str(REPO)
    out = tmp_path / "long.wav"
    text = "A sentence that takes a few seconds to say in real time. " * 3
    command = [sys.executable, "-m", "tests.support.tone_daemon", "say", text, "-c", str(config), "--out", str(out)]
    proc = subprocess.Popen(command, cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[bytes] = []
    _wait_for(proc, b"synthesis_started", lines)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout is not None
    rest = proc.stdout.read()
    proc.stdout.close()
    proc.wait(30)
    log = (b"".join(lines) + rest).decode(errors="replace")
    assert proc.returncode == 130, log  # before: 1, and nothing said
    assert "s2s-daemon: interrupted" in log


def test_say_refuses_what_it_cannot_do_before_loading_in_one_plain_line(tmp_path: Path) -> None:
    config = tmp_path / "say.yaml"
    config.write_text(yaml.safe_dump({"tts": {"engine": "tone", "options": {"load_s": "60"}}}))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    environ["PYTHONPATH"] = str(REPO)
    for args, code, line in [
        (["", "--out", str(tmp_path / "x.wav")], 64, "s2s-daemon: say: the text is empty: give the text to speak"),
        (["Hello.", "--out", "/proc/x.wav"], 73, "s2s-daemon: --out /proc/x.wav: cannot write it ("),
    ]:  # fmt: skip
        command = [sys.executable, "-m", "tests.support.tone_daemon", "say", *args, "-c", str(config)]
        done = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=30)
        assert done.returncode == code, done.stderr  # the engine takes 60 s to load: refused before it
        assert done.stderr.strip().splitlines() == [line + done.stderr.strip().partition(line)[2]], done.stderr
        assert line in done.stderr and "Traceback" not in done.stderr
