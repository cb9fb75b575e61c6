"""Engines as an extension point: each registers through the ``s2s_daemon.engines`` entry points
(ours in pyproject.toml, a third party's in its own distribution), brings its own ``tts.<name>``
block and ``tts.options``, and ``tts.engine`` is checked against what is registered; a third engine
is one module and one entry point (``tests/support/chime_engine.py``, installed into a temporary
site folder as its own distribution), end to end through ``check-config`` and a daemon."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tomllib
import wave
from collections.abc import Iterator
from importlib.metadata import EntryPoints, entry_points
from pathlib import Path

import numpy as np
import pytest
import yaml

from s2s_daemon import engines
from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError, UnavailableError
from s2s_daemon.tts.mlx_qwen3 import MlxOptions, MlxSection
from s2s_daemon.tts.registry import create_engine, engine_options
from s2s_daemon.tts.torch_qwen3.options import TorchOptions, TorchSection
from tests.support import chime_dist
from tests.support.broker import Mosquitto
from tests.support.mqtt import recorder

REPO = Path(__file__).resolve().parents[1]
WITH_GPU = {"chime": "s2s_chime_engine:ENGINE", "chime_gpu": "s2s_chime_engine:GPU_ENGINE"}


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Path]:
    """The chime distribution (and its ``chime_gpu`` engine, whose extra is missing) on ``sys.path``."""
    with chime_dist.on_path(chime_dist.install(tmp_path / "site", WITH_GPU)) as folder:
        yield folder


def write(path: Path, tts: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump({"tts": tts, "audio": {"sink": "discard"}, "mqtt": {"broker": "external"}}))
    return path


def cli(*args: str, site: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m s2s_daemon ARGS`` as users run it (no engine registered in-process), ``site`` on
    its path."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    path = os.pathsep.join([*([str(site)] if site else []), str(REPO)])
    return subprocess.run(
        [sys.executable, "-m", "s2s_daemon", *args],
        cwd=REPO,
        env={**base, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- ours, declared as any other -------------------------------------------------------------------


def test_torch_and_mlx_are_entry_points_of_our_distribution_and_nothing_else_registers_them() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][engines.GROUP]
    assert set(declared) == {"torch", "mlx"}
    installed = {p.name: p for p in entry_points(group=engines.GROUP) if p.dist and p.dist.name == "s2s-daemon"}
    # The installed metadata says what pyproject.toml says (else: reinstall, pip install -e .).
    assert {name: point.value for name, point in installed.items()} == declared
    torch, mlx = engines.engine_spec("torch"), engines.engine_spec("mlx")
    assert torch is not None and (torch.section, torch.options) == (TorchSection, TorchOptions)
    assert mlx is not None and (mlx.section, mlx.options) == (MlxSection, MlxOptions)
    assert (torch.install, mlx.install) == ("s2s-daemon[torch]", "s2s-daemon[mlx]")
    assert not {"torch", "mlx"} & set(engines._IN_PROCESS)  # found through the metadata alone


@pytest.mark.integration
def test_the_tests_tone_engine_is_no_entry_point_and_no_configuration_reaches_it(tmp_path: Path) -> None:
    assert "tone" not in {point.name for point in entry_points(group=engines.GROUP)}
    done = cli("check-config", "--schema-only", str(write(tmp_path / "tone.yaml", {"engine": "tone"})))
    assert done.returncode == 78, done.stderr
    assert "tts.engine: 'tone' is not a registered engine (registered: mlx, torch)" in done.stderr


@pytest.mark.integration
def test_the_configuration_imports_no_engine() -> None:
    """Reading the registry and checking every engine's block imports none of their packages."""
    script = (
        "import sys\n"
        "from s2s_daemon.config import load_config\n"
        "for engine in ('torch', 'mlx'):\n"
        "    load_config(None, {'S2S_TTS__ENGINE': engine, 'S2S_TTS__TORCH__THREADS': '2'})\n"
        "print(sorted(m for m in ('torch', 'mlx', 'mlx_audio', 'safetensors', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_a_stale_installation_says_to_reinstall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "entry_points", lambda **_: EntryPoints(()))
    engines._declared.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"tts\.engine: 'torch' is not a registered engine .*reinstall"):
            load_config(None, {})
    finally:
        engines._declared.cache_clear()


# -- a third engine ------------------------------------------------------------------------------


def test_a_third_engine_brings_its_own_block_and_options(site: Path, tmp_path: Path) -> None:
    config = write(tmp_path / "chime.yaml", {"engine": "chime", "model": str(tmp_path), "chime": {"pitch_hz": 220}})
    options = engine_options(load_config(config, {}).tts)
    assert type(options.section).__name__ == "ChimeSection" and options.section.pitch_hz == 220  # type: ignore[union-attr]
    assert engine_options(load_config(config, {"S2S_TTS__CHIME__PITCH_HZ": "330"}).tts).section.pitch_hz == 330  # type: ignore[union-attr]
    # Every registered engine's block is part of the configuration, its defaults when not written.
    assert load_config(None, {}).model_dump()["tts"]["chime"] == {"pitch_hz": 880.0}
    with pytest.raises(ConfigError) as typo:
        load_config(write(tmp_path / "typo.yaml", {"chime": {"pich_hz": 220}}), {})
    assert "tts.chime.pich_hz: unknown key; did you mean tts.chime.pitch_hz?" in str(typo.value)
    with pytest.raises(ConfigError) as low:
        load_config(None, {"S2S_TTS__CHIME__PITCH_HZ": "9"})
    assert "S2S_TTS__CHIME__PITCH_HZ=9 (environment): tts.chime.pitch_hz: Input should be greater" in str(low.value)


def test_without_its_distribution_its_block_is_an_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as unknown:
        load_config(write(tmp_path / "chime.yaml", {"chime": {"pitch_hz": 220}}), {})
    assert "tts.chime: unknown key" in str(unknown.value)


@pytest.mark.integration
def test_a_missing_extra_is_named_before_the_engine_is_imported(site: Path, tmp_path: Path) -> None:
    options = engine_options(load_config(None, {"S2S_TTS__ENGINE": "chime_gpu"}).tts)
    with pytest.raises(UnavailableError) as missing:
        create_engine("chime_gpu", options)
    wanted = "engine 'chime_gpu' needs the 's2s_chime_accelerator' package, which is not installed: "
    assert str(missing.value).startswith(wanted + "pip install 's2s-chime-engine[gpu]'")
    assert "s2s_chime_gpu" not in sys.modules
    done = cli("check-config", "--schema-only", str(write(tmp_path / "gpu.yaml", {"engine": "chime_gpu"})), site=site)
    assert done.returncode == 69, done.stderr
    assert f"tts.engine: {wanted}" in done.stderr


@pytest.mark.parametrize(
    ("tts", "env", "code", "said"),
    [
        ({"engine": "chime", "chime": {"pitch_hz": 440}}, {}, 0, "valid (engine chime"),
        ({"engine": "chime"}, {"S2S_TTS__CHIME__PITCH_HZ": "9"}, 78, "tts.chime.pitch_hz: Input should be"),
        ({"engine": "chime", "options": {"ms_per_char": 0}}, {}, 78, "tts.options.ms_per_char: '0'"),
        ({"engine": "chime", "options": {"speed": 1}}, {}, 78, "tts.options.speed: unknown option"),
        ({"engine": "espeak"}, {}, 78, "tts.engine: 'espeak' is not a registered engine (registered: chime, "),
    ],
)
@pytest.mark.integration
def test_check_config_checks_a_third_engine_as_its_own(
    site: Path, tmp_path: Path, tts: dict[str, object], env: dict[str, str], code: int, said: str
) -> None:
    done = cli("check-config", str(write(tmp_path / "c.yaml", {"model": str(tmp_path), **tts})), site=site, env=env)
    assert done.returncode == code, done.stderr
    assert said in done.stdout + done.stderr


def test_a_broken_entry_point_is_named_where_it_is_chosen_and_harms_no_other(tmp_path: Path) -> None:
    points = {"broken": "s2s_no_such_module:ENGINE", "wrong": "s2s_chime_engine:ChimeEngine", "chime": "x:Y"}
    with (
        chime_dist.on_path(chime_dist.install(tmp_path / "a")),
        chime_dist.on_path(chime_dist.install(tmp_path / "b", points, "s2s-broken-engine")),
    ):
        assert load_config(None, {}).tts.engine == "torch"
        found = {}
        for name in points:
            with pytest.raises(ConfigError) as refused:
                load_config(None, {"S2S_TTS__ENGINE": name})
            found[name] = str(refused.value)
    assert (
        "engine 'broken' (distribution 's2s-broken-engine': s2s_no_such_module:ENGINE) cannot be loaded"
        in (found["broken"])
    )
    assert "names a type, not an EngineSpec" in found["wrong"]
    assert "engine 'chime' is declared by more than one distribution" in found["chime"]


def start_daemon(config: Path, site: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """``s2s-daemon run`` as users start it, ``site`` on its path."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    env = {**base, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    with log_path.open("wb") as log:
        command = [sys.executable, "-m", "s2s_daemon", "run", "-c", str(config)]
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_daemon_speaks_with_a_third_engine(site: Path, tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = tmp_path / "d.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "site_id": "kitchen",
                "mqtt": {"broker": "external", "port": mosquitto.port},
                "tts": {"engine": "chime", "model": str(tmp_path), "chime": {"pitch_hz": 440}},
                "audio": {"sink": "wav", "wav_dir": str(tmp_path / "wav")},
                "journal": {"path": str(tmp_path / "journal.sqlite3")},
                "log": {"format": "json"},
            }
        )
    )
    proc = start_daemon(config, site, tmp_path / "daemon.log")
    try:
        async with recorder(mosquitto.port) as rec:
            await rec.wait_for(lambda: rec.on("/info") and any(m.payload == b"online" for m in rec.on("/status")), 60)
            assert rec.payloads("/info")[-1]["engine"] == "chime"
            await rec.say("s2s/kitchen/tts/say", {"id": "gong", "text": "A chime for the kitchen.", "voice": "Gong"})
            finished = await rec.wait_finished(["gong"], timeout_s=30)
        assert finished["gong"]["status"] == "completed", finished
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with wave.open(str(tmp_path / "wav" / "gong.wav")) as wav:
        rate, pcm = wav.getframerate(), np.frombuffer(wav.readframes(wav.getnframes()), np.int16)
    crossings = int(np.count_nonzero(np.diff(np.signbit(pcm))))
    assert crossings / 2 / (len(pcm) / rate) == pytest.approx(220, rel=0.02)  # Gong: an octave below tts.chime
