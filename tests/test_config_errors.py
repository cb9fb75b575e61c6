"""Configuration errors name their source (the file or the ``S2S_`` variable) and suggest near keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def error_lines(path: Path | None, environ: dict[str, str]) -> list[str]:
    """The lines of the ConfigError that loading raises, without the heading."""
    with pytest.raises(ConfigError) as info:
        load_config(path, environ)
    heading, *lines = str(info.value).splitlines()
    assert heading == "invalid configuration:"
    return [line.strip() for line in lines]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_bad_environment_value_names_the_variable_not_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "mqtt: {host: broker.lan}\nqueue: {max_pending: zero}\n")
    lines = error_lines(path, {"S2S_MQTT__PORT": "abc"})
    assert sorted(lines) == sorted(
        [
            "S2S_MQTT__PORT=abc (environment): mqtt.port: Input should be a valid integer, "
            "unable to parse string as an integer",
            f"{path}: queue.max_pending: Input should be a valid integer, unable to parse string as an integer",
        ]
    )


def test_an_unknown_key_from_the_environment_names_the_variable() -> None:
    assert error_lines(None, {"S2S_MQTT__PROT": "1"}) == [
        "S2S_MQTT__PROT=1 (environment): mqtt.prot: unknown key; did you mean mqtt.port?"
    ]


def test_a_mapping_value_blames_the_variable_only_for_its_own_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "mqtt: {tls: {insecur: true}}\n")
    lines = error_lines(path, {"S2S_MQTT__TLS": "{ca_fil: /ca.pem}"})
    assert sorted(lines) == sorted(
        [
            "S2S_MQTT__TLS={ca_fil: /ca.pem} (environment): mqtt.tls.ca_fil: unknown key; "
            "did you mean mqtt.tls.ca_file?",
            f"{path}: mqtt.tls.insecur: unknown key; did you mean mqtt.tls.insecure?",
        ]
    )


def test_a_section_error_names_the_file_and_the_variables_that_touched_the_section(tmp_path: Path) -> None:
    path = write(tmp_path, "mqtt: {host: broker.lan}\n")
    assert error_lines(path, {"S2S_MQTT__PASSWORD_FILE": "/x"}) == [
        f"{path} + S2S_MQTT__PASSWORD_FILE=/x (environment): mqtt: password_file needs username"
    ]
    assert error_lines(None, {"S2S_MQTT__PASSWORD_FILE": "/x"}) == [
        "S2S_MQTT__PASSWORD_FILE=/x (environment): mqtt: password_file needs username"
    ]


def test_unknown_file_keys_suggest_the_nearest_key_of_their_own_section(tmp_path: Path) -> None:
    path = write(tmp_path, "mqtt: {prot: 1883, tls: {insecur: true}}\nlogg: {}\ntts: {xyzzy: 1, torch: {dtyp: bf16}}\n")
    assert sorted(error_lines(path, {})) == sorted(
        f"{path}: {line}"
        for line in [
            "mqtt.prot: unknown key; did you mean mqtt.port?",
            "mqtt.tls.insecur: unknown key; did you mean mqtt.tls.insecure?",
            "logg: unknown key; did you mean log?",
            "tts.xyzzy: unknown key",
            "tts.torch.dtyp: unknown key; did you mean tts.torch.dtype?",
        ]
    )


def test_the_benchmark_reference_variable_is_not_a_configuration_key() -> None:
    """README: ``$S2S_BENCH_REFERENCE_PYTHON`` names the qwen-tts python; exporting it must not break the daemon."""
    assert load_config(None, {"S2S_BENCH_REFERENCE_PYTHON": "/usr/bin/python3"}).mqtt.port == 1883


@pytest.mark.integration
def test_check_config_exits_78_naming_the_variable_and_the_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "mqtt: {prot: 1883}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    env["S2S_MQTT__PORT"] = "abc"
    result = subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "check-config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 78, result.stderr
    assert "S2S_MQTT__PORT=abc (environment): mqtt.port: Input should be a valid integer" in result.stderr
    assert f"{path}: mqtt.prot: unknown key; did you mean mqtt.port?" in result.stderr


def test_variables_that_are_not_configuration_keys_are_left_alone() -> None:
    env = {"S2S_PREPARED_CACHE": "0", "S2S_GPU_DEVICE": "cpu", "S2S_BENCH_REFERENCE_PYTHON": "/x", "S2S_CONFIG": "/y"}
    assert load_config(None, env).mqtt.port == 1883
