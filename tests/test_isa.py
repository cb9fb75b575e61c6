"""``tts.torch.isa``: which instruction-set path runs on which CPU, and why (``s2s_daemon/tts/isa.py``).

The CPUs are other machines' ``/proc/cpuinfo`` flags; the refusal of a path this machine cannot
run is checked through ``preflight`` and ``check-config`` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from s2s_daemon import preflight
from s2s_daemon.config import load_config
from s2s_daemon.errors import EXIT_CONFIG
from s2s_daemon.tts import isa
from tests.support.daemon import REPO

pytestmark = pytest.mark.timeout(60)

N100 = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx f16c fma bmi1 avx2 bmi2 avx_vnni"
"""An Intel N100 (Alder Lake-N): AVX2 and FMA (and AVX-VNNI, 256-bit), no AVX-512."""
ZEN4 = "flags\t\t: sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"
OLD_XEON = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx"
"""Sandy Bridge: AVX without AVX2 or FMA."""
PI5 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
PI4 = "Features\t: fp asimd evtstrm crc32 cpuid"
GRAVITON3 = PI5 + " sve i8mm bf16"
X86_BUILD = ("generic", "avx2", "avx512", "amx")
ARM_BUILD = ("generic", "neon", "dotprod", "i8mm")
"""What this build carries on each architecture (``test_native_kernels.py`` checks the library)."""


@pytest.mark.parametrize(
    ("arch", "cpuinfo", "runnable", "auto", "why"),
    [
        ("x86_64", N100, ("generic", "avx2"), "avx2", "auto: cpu has avx2 and fma"),
        ("x86_64", ZEN4, ("generic", "avx2", "avx512"), "avx512", "auto: cpu has avx512_vnni"),
        ("x86_64", SAPPHIRE_RAPIDS, ("generic", "avx2", "avx512", "amx"), "amx", "auto: cpu has amx_bf16"),
        ("x86_64", OLD_XEON, ("generic",), "generic", "auto: portable C (the cpu has none of the wider paths)"),
        ("aarch64", PI4, ("generic", "neon"), "neon", "auto: cpu has asimd"),
        ("aarch64", PI5, ("generic", "neon", "dotprod"), "dotprod", "auto: cpu has asimddp"),
        ("aarch64", GRAVITON3, ("generic", "neon", "dotprod", "i8mm"), "i8mm", "auto: cpu has i8mm"),
    ],
    ids=["n100", "zen4", "sapphire-rapids", "sandy-bridge", "pi4", "pi5", "graviton3"],
)
def test_auto_runs_the_widest_path_the_cpu_has_and_the_build_carries(
    arch: str, cpuinfo: str, runnable: tuple[str, ...], auto: str, why: str
) -> None:
    assert isa.paths_for(arch, isa.cpu_flags(cpuinfo)) == runnable
    path, reason = isa.choose("auto", X86_BUILD if arch == "x86_64" else ARM_BUILD, runnable)
    assert path == auto and why in reason


def test_a_cap_runs_as_configured_and_amx_without_its_unit_runs_the_avx512_path() -> None:
    runnable = isa.paths_for("x86_64", isa.cpu_flags(SAPPHIRE_RAPIDS))
    assert isa.choose("avx2", X86_BUILD, runnable) == ("avx2", "configured")
    assert isa.choose("generic", X86_BUILD, runnable) == ("generic", "configured")
    assert isa.choose("amx", X86_BUILD, runnable) == ("amx", "configured")
    assert isa.choose("avx512", X86_BUILD, runnable) == ("avx512", "configured")
    # A build whose compiler had no AMX (GCC before 11) carries no amx path: auto and amx take avx512.
    older = ("generic", "avx2", "avx512")
    assert isa.choose("auto", older, runnable) == ("avx512", "auto: cpu has avx512_vnni")
    path, reason = isa.choose("amx", older, runnable)
    assert path == "avx512" and "carries no amx path" in reason


def test_a_path_the_cpu_or_the_build_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa, "architecture", lambda machine=None: "x86_64")
    runnable = isa.paths_for("x86_64", isa.cpu_flags(N100))
    with pytest.raises(ValueError, match="cannot run the avx512 path"):
        isa.choose("avx512", X86_BUILD, runnable)
    with pytest.raises(ValueError, match="amx"):  # no AMX on an N100
        isa.choose("amx", X86_BUILD, runnable)
    with pytest.raises(ValueError, match="not a path of this x86_64 CPU"):
        isa.choose("neon", X86_BUILD, runnable)
    with pytest.raises(ValueError, match="carries no avx2 path"):  # a build without it (an old compiler)
        isa.choose("avx2", ("generic",), runnable)


def test_this_machines_paths_are_its_architectures() -> None:
    here = isa.cpu_paths()
    assert here[0] == "generic" and set(here) <= set(isa.paths_of(isa.architecture()))
    assert isa.refusal("auto") is None and isa.refusal(here[-1]) is None


def _foreign_and_missing() -> list[str]:
    """A path of another architecture, and the paths of this one this CPU cannot run."""
    arch = isa.architecture()
    other = "neon" if arch == "x86_64" else "avx2"
    return [other, *(p for p in isa.paths_of(arch) if p not in isa.cpu_paths())]


def test_preflight_refuses_a_path_this_cpu_cannot_run() -> None:
    for path in _foreign_and_missing():
        config = load_config(None, {"S2S_TTS__TORCH__ISA": path})  # the schema takes every name
        found = [f for f in preflight.findings(config) if f.key == "tts.torch.isa"]
        assert len(found) == 1 and path in found[0].message and not found[0].unavailable
    for path in ("auto", *isa.cpu_paths()):
        config = load_config(None, {"S2S_TTS__TORCH__ISA": path})
        assert not [f for f in preflight.findings(config) if f.key == "tts.torch.isa"]
    mlx = load_config(None, {"S2S_TTS__TORCH__ISA": _foreign_and_missing()[0], "S2S_TTS__ENGINE": "mlx"})
    assert not [f for f in preflight.findings(mlx) if f.key == "tts.torch.isa"]  # a section not in use


@pytest.mark.integration
def test_check_config_exits_78_naming_the_key() -> None:
    path = _foreign_and_missing()[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    done = subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "check-config"],
        cwd=REPO,
        env={**env, "S2S_TTS__TORCH__ISA": path},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    assert f"tts.torch.isa: {path} is not a path of this" in done.stderr
