"""``check-config`` checks what ``run`` needs beyond the schema (every file, folder and port the
configuration names), and ``run`` checks it before the model loads: "valid" then "exit 78" after
a minute of loading is what this prevents."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from s2s_daemon.config import load_config
from s2s_daemon.pipeline.journal import RequestJournal
from tests.support.broker import free_port
from tests.support.daemon import REPO, DaemonProcess, write_config
from tests.support.wait import until

pytestmark = pytest.mark.integration

BASE: dict[str, Any] = {"mqtt": {"broker": "external"}, "journal": {"enabled": False}, "audio": {"sink": "discard"}}


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def check_config(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "check-config", str(path), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=False,
    )


def config_file(tmp_path: Path, **sections: Any) -> Path:
    data: dict[str, Any] = {key: dict(value) for key, value in BASE.items()}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_files_and_folders_the_configuration_names_are_checked(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    not_a_checkpoint = tmp_path / "empty-model"
    not_a_checkpoint.mkdir()
    a_file = tmp_path / "voices"
    a_file.write_text("")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tts": {"model": "/nonexistent/dir"}}, "tts.model: /nonexistent/dir: no such folder"),
        ({"tts": {"model": str(not_a_checkpoint)}}, "not a checkpoint in the official layout (no config.json"),
        ({"tts": {"engine": "mlx", "model": "./nowhere"}}, "tts.model: ./nowhere: no such folder"),
        ({"mqtt": {"tls": {"ca_file": "/nope.pem"}}}, "mqtt.tls.ca_file: cannot read /nope.pem"),
        ({"mqtt": {"tls": {"ca_file": str(not_pem)}}}, f"mqtt.tls.ca_file: {not_pem}: not a PEM certificate bundle"),
        ({"mqtt": {"username": "u", "password_file": "/nope"}}, "mqtt.password_file: cannot read /nope"),
        ({"http": {"enabled": True, "port": free_port(), "api_key_file": "/nope"}}, "http.api_key_file: cannot read"),
        ({"tts": {"voices_dir": str(a_file)}}, f"tts.voices_dir: {a_file}: not a folder"),
    ]
    for sections, expected in cases:
        result = check_config(config_file(tmp_path, **sections))
        assert result.returncode == 78, (sections, result.stdout, result.stderr)
        assert expected in result.stderr, (sections, result.stderr)
        assert "valid" not in result.stdout


def test_ports_that_clash_or_are_taken_are_named(tmp_path: Path, listening: int) -> None:
    port = free_port()
    clash = check_config(
        config_file(tmp_path, http={"enabled": True, "port": port}, wyoming={"enabled": True, "port": port})
    )
    assert clash.returncode == 78
    assert f"wyoming.port: {port} is http.port too" in clash.stderr
    taken = check_config(config_file(tmp_path, http={"enabled": True, "port": listening}))
    assert taken.returncode == 69, taken.stderr
    assert f"http.port: cannot listen on 127.0.0.1:{listening}: the port is in use by pid {os.getpid()}" in (
        taken.stderr
    )
    embedded = check_config(config_file(tmp_path, mqtt={"broker": "embedded", "port": listening}))
    assert embedded.returncode == 69 and f"mqtt.port: cannot listen on 127.0.0.1:{listening}" in embedded.stderr


def test_a_journal_held_by_another_daemon_names_it(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = RequestJournal(path, 16)
    journal.open()
    try:
        result = check_config(config_file(tmp_path, journal={"enabled": True, "path": str(path)}))
    finally:
        journal.close()
    assert result.returncode == 69, result.stderr
    assert f"journal.path: {path} is held by another daemon (pid {os.getpid()}" in result.stderr
    assert "site_id" in result.stderr and "journal.path" in result.stderr


def test_print_writes_yaml_that_reads_back_as_the_same_configuration(tmp_path: Path) -> None:
    path = config_file(tmp_path, site_id="attic", tts={"voice": "Vivian", "options": {"max_frames": "40"}})
    result = check_config(path, "--print")
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stderr and "valid" not in result.stdout
    saved = tmp_path / "saved.yaml"
    saved.write_text(result.stdout)
    assert load_config(saved, environ={}) == load_config(path, environ={})


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"tts": {"engine": "torch", "model": "/nonexistent/dir"}}, "tts.model: /nonexistent/dir: no such folder"),
        ({"mqtt": {"tls": {"ca_file": "/nope.pem"}}}, "mqtt.tls.ca_file: cannot read /nope.pem"),
    ],
)
async def test_run_stops_at_a_wrong_path_before_the_model_loads(
    tmp_path: Path, sections: dict[str, Any], expected: str
) -> None:
    # The tone engine takes 120 s to load here: an exit 78 within the test's minute came before it.
    tts = sections.get("tts", {})
    slow = {"tts": tts if "engine" in tts else {"options": {"load_s": "120"}, **tts}}
    path = write_config(tmp_path / "daemon.yaml", free_port(), **{**sections, **slow})
    daemon = DaemonProcess(path)
    daemon.start()
    try:
        assert await daemon.wait(60) == 78
    finally:
        daemon.cleanup()
    assert expected in daemon.log()


async def test_a_second_daemon_names_the_first(tmp_path: Path, listening: int) -> None:
    """Two daemons on one site: the second stops before its model loads, naming the first's pid
    (the journal it holds), not "make its folder writable"."""
    path = write_config(tmp_path / "daemon.yaml", listening)  # the broker need not answer
    first = DaemonProcess(path, log_path=tmp_path / "first.log")
    second = DaemonProcess(path, log_path=tmp_path / "second.log")
    first.start()
    try:
        journal = path.with_suffix(".journal.sqlite3")
        await until(lambda: "journal_opened" in first.log(), 10, "the first daemon's journal opened")
        second.start()
        assert await second.wait(60) == 69
        assert first.proc is not None
        assert f"journal.path: {journal} is held by another daemon (pid {first.proc.pid}" in second.log()
        assert "folder writable" not in second.log()
    finally:
        second.cleanup()
        first.cleanup()


# ----------------------------------------------------------------- what run refuses, check-config refuses first
# (issue 41, item 9: these said "valid", then run failed: a traceback, exit 69, or an option ignored)

TINY = REPO / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"


def check_with_env(path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "check-config", str(path), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean_env(), **env},
        check=False,
    )


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("MAX_FRAMES", "abc", "tts.options.max_frames: 'abc': Input should be a valid integer"),
        ("MAX_FRAMES", "0", "tts.options.max_frames: '0': Input should be greater than or equal to 1"),
        ("MAX_BATCH", "0", "tts.options.max_batch: '0': Input should be greater than or equal to 1"),
        ("CODEC_DTYPE", "foo", "tts.options.codec_dtype: 'foo': Input should be 'auto', 'float32' or 'bfloat16'"),
        ("CODEC_OVERLAP", "maybe", "tts.options.codec_overlap: 'maybe': Input should be 'auto', 'on' or 'off'"),
        ("MAX_FRAME", "4", "tts.options.max_frame: unknown option; did you mean max_frames? (known: codec_dtype,"),
    ],
)
def test_the_engines_options_are_checked_against_the_schema_it_declares(
    tmp_path: Path, variable: str, value: str, expected: str
) -> None:
    path = config_file(tmp_path, tts={"engine": "torch", "model": str(TINY)})
    env = {f"S2S_TTS__OPTIONS__{variable}": value}
    for args in ((), ("--schema-only",)):
        result = check_with_env(path, env, *args)
        assert result.returncode == 78, (args, result.stderr)
        assert expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"tts": {"language": "klingon"}}, "tts.language: language 'klingon' is not supported; choose one of auto,"),
        ({"tts": {"voice": "bob"}}, "tts.voice: voice 'bob' is unknown; choose one of Serena, Vivian, Uncle_Fu, Ryan"),
    ],
)
async def test_a_language_or_voice_the_model_lacks_is_refused_by_check_config_and_by_run_before_it_loads(
    tmp_path: Path, sections: dict[str, Any], expected: str
) -> None:
    tts = {"engine": "torch", "model": str(TINY), "options": {}, **sections["tts"]}
    path = config_file(tmp_path, tts=tts)
    checked = check_config(path)
    assert checked.returncode == 78, checked.stderr
    assert expected in checked.stderr
    daemon = DaemonProcess(write_config(tmp_path / "daemon.yaml", free_port(), tts=tts))
    daemon.start()
    try:
        assert await daemon.wait(60) == 78
    finally:
        daemon.cleanup()
    assert expected in daemon.log() and "engine_loading" not in daemon.log()


def test_a_language_is_checked_without_the_model_at_hand(tmp_path: Path) -> None:
    result = check_config(config_file(tmp_path, tts={"model": "Someone/not-downloaded", "language": "klingon"}))
    assert result.returncode == 78 and "tts.language: language 'klingon' is not supported" in result.stderr
    fine = check_config(config_file(tmp_path, tts={"model": "Someone/not-downloaded", "language": "de"}))
    assert fine.returncode == 0, fine.stderr


def test_a_key_given_twice_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("mqtt: {broker: external}\ntts:\n  voice: Ryan\n  language: en\n  voice: Vivian\n")
    result = check_config(path)
    assert result.returncode == 78, result.stderr
    assert "tts.voice: the key is given twice (lines 3 and 5); keep one" in result.stderr


def test_a_missing_engine_extra_is_refused_by_check_config_as_by_run(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "mlx.py").write_text("raise ImportError('mlx hidden by the test')\n")
    result = check_with_env(
        config_file(tmp_path, tts={"engine": "mlx"}), {"PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}, "--schema-only"
    )
    assert result.returncode == 69, result.stderr
    assert "tts.engine: engine 'mlx' needs the 'mlx' package" in result.stderr and "s2s-daemon[mlx]" in result.stderr


def test_folders_that_cannot_be_made_are_refused_even_for_root(tmp_path: Path) -> None:
    """Permissions do not stop root: the folder is tried (``/proc`` takes no new folder)."""
    cases = [
        ({"audio": {"sink": "wav", "wav_dir": "/proc/s2s/wav"}}, "audio.wav_dir: /proc/s2s/wav: /proc/s2s/wav cannot"),
        ({"journal": {"enabled": True, "path": "/proc/s2s/j.sqlite3"}}, "journal.path: /proc/s2s/j.sqlite3: /proc/s2s"),
    ]
    for sections, expected in cases:
        result = check_config(config_file(tmp_path, **sections))
        assert result.returncode == 69, result.stderr
        assert expected in result.stderr


def test_vad_without_a_microphone_is_refused(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "PULSE_SERVER": "unix:/nonexistent", "HOME": str(tmp_path)}
    result = check_with_env(config_file(tmp_path, vad={"enabled": True}), env)
    if result.returncode == 0 and Path("/dev/snd").exists():
        pytest.skip("this machine has a sound card")
    assert result.returncode == 69, result.stderr
    assert "vad.enabled: no microphone: no sound input device found" in result.stderr
