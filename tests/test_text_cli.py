"""``s2s-daemon text`` prints what would be spoken (an argument, or standard input as a stream), and
``check-config`` knows the ``text:`` section: the daemon's command line as a subprocess."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "s2s_daemon", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env=environ(),
        check=False,
    )


def test_text_prints_what_would_be_spoken_in_the_language_asked() -> None:
    answer = "## Preise\n\n- **Kaffee:** 3,50 € 🙂\n- Mehr unter https://www.example.de/x"
    result = cli("text", answer, "--language", "de")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Preise.\nKaffee: drei Euro und fünfzig Cent.\nMehr unter example Punkt de.\n"


def test_text_follows_the_configuration_file_and_its_language(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("tts: {language: English}\ntext: {emoji: name, code_blocks: drop}\n", encoding="utf-8")
    result = cli("text", "Done 👍\n\n```\nrm -rf /\n```", "-c", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Done thumbs up.\n"


def test_text_from_standard_input_is_spoken_as_it_comes() -> None:
    """A sentence is printed while the writer is still writing (standard input still open)."""
    with subprocess.Popen(
        [sys.executable, "-m", "s2s_daemon", "text", "-", "--language", "en"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environ(),
    ) as process:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(b"# Steps\n\n1. Open the **lid**\n")
        process.stdin.flush()
        seen = b""
        deadline = time.monotonic() + 30
        while b"Steps." not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([process.stdout], [], [], 1.0)
            if ready:
                seen += os.read(process.stdout.fileno(), 4096)
        assert b"Steps." in seen, "nothing printed before the text ended"
        assert process.poll() is None
        process.stdin.write(b"2. Pour 1,000 ml\n")
        process.stdin.close()
        rest = process.stdout.read()
        assert process.wait(timeout=30) == 0
    assert (seen + rest).decode() == "Steps.\nOpen the lid.\nPour one thousand ml.\n"


def test_check_config_accepts_the_text_section_and_refuses_a_bad_value_naming_the_key(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("text: {markdown: false, emoji: name, urls: false, numbers: all, code_blocks: read}\n")
    accepted = cli("check-config", str(good), "--schema-only")
    assert accepted.returncode == 0, accepted.stderr

    bad = tmp_path / "bad.yaml"
    bad.write_text("text: {emoji: shout, markdwn: true}\n")
    refused = cli("check-config", str(bad), "--schema-only")
    assert refused.returncode == 78
    assert f"{bad}: text.emoji: Input should be 'drop', 'name' or 'keep'" in refused.stderr
    assert f"{bad}: text.markdwn: unknown key; did you mean text.markdown?" in refused.stderr
