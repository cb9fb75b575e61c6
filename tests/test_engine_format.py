"""``tts.torch.quantization: auto`` / ``dtype: auto``: the format chosen per device and why, in the
log, in ``info`` and in ``check-config --print``; every explicit choice stays as configured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from structlog.testing import capture_logs

from s2s_daemon.cli import RESOLVED_MARKER
from s2s_daemon.config import load_config

# The torch engine's formats: its package imports torch (without the torch extra, nothing to choose).
pytest.importorskip("torch")

from s2s_daemon.tts.torch_qwen3.formats import choose_format
from s2s_daemon.tts.torch_qwen3.options import TorchSection

TINY = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"


def _never() -> str | None:
    raise AssertionError("the native kernels were asked about where they do not matter")


def test_the_default_configuration_asks_for_auto() -> None:
    torch = load_config(None, environ={}).tts.section("torch", TorchSection)
    assert (torch.dtype, torch.quantization, torch.threads) == ("auto", "auto", "auto")


def test_a_cpu_with_the_native_kernels_gets_int8() -> None:
    choice = choose_format("cpu", "auto", "auto", "auto", lambda: None)
    assert (choice.dtype, choice.quantization, choice.auto) == ("float32", "int8", True)
    assert "native kernels" in choice.reason and "int8" in choice.reason


def test_a_cpu_without_them_gets_float32_and_says_why() -> None:
    choice = choose_format("cpu", "auto", "auto", "auto", lambda: "this CPU lacks avx2")
    assert (choice.dtype, choice.quantization) == ("float32", "none")
    assert "this CPU lacks avx2" in choice.reason
    torch_kernels = choose_format("cpu", "auto", "auto", "torch", _never)
    assert (torch_kernels.dtype, torch_kernels.quantization) == ("float32", "none")


def test_cuda_gets_bfloat16_and_mps_float32() -> None:
    cuda = choose_format("cuda", "auto", "auto", "auto", _never)
    assert (cuda.dtype, cuda.quantization) == ("bfloat16", "none") and "CUDA" in cuda.reason
    mps = choose_format("mps", "auto", "auto", "auto", _never)
    assert (mps.dtype, mps.quantization) == ("float32", "none") and "not measured" in mps.reason


@pytest.mark.parametrize(
    ("dtype", "quantization", "expected"),
    [
        ("float32", "none", ("float32", "none", False)),
        ("auto", "none", ("float32", "none", True)),  # quantization none: the dtype's auto only
        ("auto", "int4", ("float32", "int4", True)),
        ("bf16", "auto", ("bf16", "none", True)),  # a dtype chosen: unquantized weights in it
        ("float32", "int8", ("float32", "int8", False)),
    ],
)
def test_explicit_choices_stay(dtype: str, quantization: str, expected: tuple[str, str, bool]) -> None:
    choice = choose_format("cpu", dtype, quantization, "auto", _never)
    assert (choice.dtype, choice.quantization, choice.auto) == expected


@pytest.mark.torch
def test_the_engine_logs_the_choice_once_and_reports_it_in_info() -> None:
    from s2s_daemon.tts.engine import EngineOptions
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, native

    engine = TorchQwen3Engine(EngineOptions(model=str(TINY), device="cpu", quantization="auto"))
    with capture_logs() as logs:
        info = engine.load_blocking()
    engine.close_blocking()
    chosen = [e for e in logs if e["event"] == "engine_format"]
    assert len(chosen) == 1 and chosen[0]["chosen"] == "auto"
    expected = "int8" if native.load() is not None else "float32"
    assert info.dtype == chosen[0]["weights"] == expected
    assert info.format_reason == chosen[0]["reason"] and info.format_reason


@pytest.mark.integration
def test_check_config_prints_the_resolved_choice(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("tts: {torch: {device: cpu, threads: 1}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "check-config", str(config), "--print"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    document = yaml.safe_load(done.stdout)  # the configuration as written, the resolution a comment
    block = done.stdout.split(RESOLVED_MARKER, 1)[1].split("\n", 1)[1]
    resolved = yaml.safe_load("\n".join(line.removeprefix("#   ") for line in block.splitlines()))["tts.torch"]
    assert resolved["device"] == "cpu" and resolved["chosen"] == "auto"
    assert resolved["quantization"] in ("int8", "none") and resolved["reason"]
    assert resolved["threads"]["chosen"] == "configured" and resolved["threads"]["at_most"] == 1
    assert document["tts"]["torch"]["quantization"] == "auto"  # the configuration as written


@pytest.mark.torch
def test_the_engine_says_which_native_path_runs_and_why_in_the_log_and_info() -> None:
    """``engine_format`` and ``info`` (and its MQTT payload) name the instruction-set path that runs
    and why: ``auto``'s choice, and a configured cap."""
    from s2s_daemon.events.publisher import MqttEvents
    from s2s_daemon.mqtt.topics import Topics
    from s2s_daemon.tts.engine import EngineOptions
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, native

    if native.why_not_here() is not None:
        pytest.skip(f"no native kernels here: {native.why_not_here()}")
    widest = [p for p in native.carried_paths() if p in native.runnable_paths()][-1]
    for isa, path, reason in (("auto", widest, "auto: cpu has "), ("generic", "generic", "configured")):
        engine = TorchQwen3Engine(EngineOptions(model=str(TINY), device="cpu", quantization="int8", isa=isa))
        with capture_logs() as logs:
            info = engine.load_blocking()
        engine.close_blocking()
        chosen = [e for e in logs if e["event"] == "engine_format"]
        assert len(chosen) == 1 and chosen[0]["isa"] == path and chosen[0]["isa_reason"].startswith(reason)
        assert info.isa == f"{path} ({chosen[0]['isa_reason']})"
        sent: list[object] = []
        events = MqttEvents(sent.append, Topics("s2s", "t"), info, 1, False, lambda: None)
        assert json.loads(events.info_message().payload)["isa"] == info.isa


@pytest.mark.torch
def test_an_isa_the_library_does_not_carry_fails_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A path this CPU runs but the installed library lacks (built by an old compiler, or an
    architecture whose wide paths are still hooks): the configured cap fails the load, saying so."""
    from s2s_daemon.tts.engine import EngineError, EngineOptions
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, native

    if native.why_not_here() is not None:
        pytest.skip(f"no native kernels here: {native.why_not_here()}")
    wide = native.runnable_paths()[-1]
    monkeypatch.setattr(native, "carried_paths", lambda: ("generic",))
    monkeypatch.setattr(native, "_state", {})
    engine = TorchQwen3Engine(EngineOptions(model=str(TINY), device="cpu", quantization="int8", isa=wide))
    with pytest.raises(EngineError, match=f"carries no {wide} path|avx512 path here, which this build does not carry"):
        engine.load_blocking()
    engine.close_blocking()


@pytest.mark.integration
def test_check_config_prints_the_native_path(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        pytest.skip(f"no native kernels here: {native.why_not_here()}")
    config = tmp_path / "c.yaml"
    config.write_text("tts: {torch: {device: cpu, threads: 1, isa: generic}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "check-config", str(config), "--print"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    block = done.stdout.split(RESOLVED_MARKER, 1)[1].split("\n", 1)[1]
    resolved = yaml.safe_load("\n".join(line.removeprefix("#   ") for line in block.splitlines()))["tts.torch"]
    assert resolved["native_kernels"]["isa"] == "generic" and resolved["native_kernels"]["reason"] == "configured"
    assert "generic" in resolved["native_kernels"]["paths"].split()
