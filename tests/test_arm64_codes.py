"""The tiny checkpoint's greedy codes, and a whole ``say``, the same on every machine and path.

In the suite on x86-64 and, marked ``arm64``, on each CPU ``scripts/arm64_check.sh`` emulates
(cortex-a72: the neon path, neoverse-n1: dotprod, max: i8mm; the whole ``say`` on one of them),
the widest path the CPU runs:

- float32 weights: the official goldens' codes (made on x86-64, ``test_torch_parity.py``), exactly,
  spoken by a whole ``s2s-daemon say`` (a subprocess) whose WAV is the goldens' audio within the
  float32 codec decoder's 1e-4 and the WAV's 16-bit rounding; one other
  code would put whole frames tenths apart;
- int8 and int4 weights: the codes the portable path gives on x86-64 (``QUANTIZED_CODES``, written by
  ``python -m tests.test_arm64_codes``; the avx2 and avx512 paths give the same), at
  ``QUANTIZED_MIN_EQUAL`` of the (frame, codebook) positions at least. Each product's input is
  rounded to 8 bits per block of 32 (``native/kernels.h``): a path's other summation order can move
  a last bit of an activation across a rounding step, and on these random weights (flat logits) a
  near-tie can then flip, after which greedy decoding follows another path (none did: every code
  was equal on the three emulated CPUs); float32 has no such step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, native  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.arm64, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "qwen3_tiny"
CHECKPOINT = FIXTURES / "custom_voice"
GOLDEN = FIXTURES / "golden" / "cv_ryan_english"
QUANTIZED_CODES = FIXTURES / "quantized_codes.json"
QUANTIZED_MIN_EQUAL = 0.9
"""Share of the int8/int4 codes (frame, codebook) that must equal x86-64's portable path's."""
FRAMES = 24
"""The goldens' frames (random weights never end an utterance on their own)."""
WAV_ATOL = 1e-4 + 2**-15
"""The float32 codec decoder's tolerance (``test_torch_parity.py``) and the WAV's 16-bit rounding."""


def _golden() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = json.loads(GOLDEN.with_suffix(".json").read_text(encoding="utf-8"))
    with np.load(GOLDEN.with_suffix(".npz")) as npz:
        return meta, {name: npz[name] for name in ("codes", "wav")}


def _request(meta: dict[str, Any]) -> SynthesisRequest:
    kw = meta["kwargs"]
    return SynthesisRequest(
        text=kw["text"], voice=kw["speaker"], language=kw["language"].lower(), greedy=True, chunk_frames=4
    )


def codes(quantization: str, isa: str = "auto") -> np.ndarray:
    """Greedy codes [FRAMES, 16] of the goldens' request with ``quantization`` weights on ``isa``."""
    meta, _ = _golden()
    engine = TorchQwen3Engine(
        EngineOptions(
            model=str(CHECKPOINT),
            device="cpu",
            dtype="float32",
            quantization=quantization,
            isa=isa,
            extra={"threads": "1", "codec_dtype": "float32", "prepared_cache": "0"},
        )
    )
    engine.load_blocking()
    try:
        return engine.codes_blocking(_request(meta), max_frames=FRAMES).numpy()
    finally:
        engine.close_blocking()


def _native_or_skip() -> None:
    if native.load() is None:
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")


def test_float32_codes_are_the_official_ones() -> None:
    _, gold = _golden()
    got = codes("none")
    mismatch = np.argwhere(got != gold["codes"])
    assert mismatch.size == 0, f"codes differ first at (frame, group) {mismatch[0].tolist()}"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_codes_are_x86_64s(quantization: str) -> None:
    _native_or_skip()
    want = np.array(json.loads(QUANTIZED_CODES.read_text(encoding="utf-8"))[quantization])
    # The widest path whose prompts multiply integers: the amx path's run on bfloat16 tiles
    # (test_amx_codes_are_the_amx_paths), and where it is the widest, avx512 is checked here.
    loaded = native.load()
    got = codes(quantization, "avx512" if loaded is not None and loaded.isa == "amx" else "auto")
    equal = float((got == want).mean())
    assert got.shape == want.shape
    assert equal >= QUANTIZED_MIN_EQUAL, f"{quantization}: {equal:.1%} of the codes equal x86-64's"


def _amx_or_skip() -> None:
    _native_or_skip()
    if "amx" not in native.carried_paths() or "amx" not in native.runnable_paths():
        pytest.skip("no amx path here (an x86-64 CPU with AMX and a build whose compiler has it)")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_amx_codes_are_the_amx_paths(quantization: str) -> None:
    """The amx path multiplies a prompt's integer weights on bfloat16 tiles, its input rounded to
    bfloat16 rather than to int8 per block: nearer float32's product, and on these random weights
    (flat logits) its greedy codes part from the integer paths' at a near tie (int4's even reach
    an end of speech). They are held to the codes this path gave when the fixture was written
    (``QUANTIZED_CODES``' ``<format>@amx``, by ``python -m tests.test_arm64_codes`` on a CPU with
    AMX), at the same share as the integer paths'."""
    _amx_or_skip()
    data = json.loads(QUANTIZED_CODES.read_text(encoding="utf-8"))
    assert f"{quantization}@amx" in data, "the fixture has no amx codes: run python -m tests.test_arm64_codes"
    want = np.array(data[f"{quantization}@amx"])
    got = codes(quantization, "amx")
    assert got.shape == want.shape
    equal = float((got == want).mean())
    assert equal >= QUANTIZED_MIN_EQUAL, f"{quantization}: {equal:.1%} of the codes equal the amx path's"


@pytest.mark.integration
def test_a_whole_say_speaks_the_official_audio(tmp_path: Path) -> None:
    """``s2s-daemon say`` as a user runs it (float32 weights, greedy, the goldens' frames): its WAV
    is the golden audio, so its codes are the goldens'."""
    meta, gold = _golden()
    config = tmp_path / "say.yaml"
    config.write_text(
        f'tts:\n  options: {{max_frames: "{FRAMES}", codec_dtype: "float32", prepared_cache: "0"}}\n', encoding="utf-8"
    )
    out = tmp_path / "say.wav"
    kw = meta["kwargs"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    done = subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "say", kw["text"], "-c", str(config), "--model", str(CHECKPOINT),
         "--voice", kw["speaker"], "--language", kw["language"], "--greedy", "--dtype", "float32",
         "--quantization", "none", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with wave.open(str(out), "rb") as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
        audio = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float32) / 32768
    assert audio.shape == gold["wav"].shape
    err = float(np.abs(audio - gold["wav"]).max())
    assert err <= WAV_ATOL, f"the WAV is {err:.3g} from the golden audio"


def main() -> None:
    """Write ``QUANTIZED_CODES`` from the portable path on this (x86-64) machine."""
    data = {
        "made_by": "python -m tests.test_arm64_codes: the portable path (isa generic), x86-64, greedy, one thread",
        "frames": FRAMES,
        **{q: codes(q, "generic").tolist() for q in ("int8", "int4")},
    }
    if "amx" in native.carried_paths() and "amx" in native.runnable_paths():
        data["made_by"] += "; <format>@amx: the amx path on this CPU"
        data.update({f"{q}@amx": codes(q, "amx").tolist() for q in ("int8", "int4")})
    else:  # kept from the last machine that had AMX
        old = json.loads(QUANTIZED_CODES.read_text(encoding="utf-8"))
        data.update({k: v for k, v in old.items() if k.endswith("@amx")})
    QUANTIZED_CODES.write_text(json.dumps(data) + "\n", encoding="utf-8")
    print(f"wrote {QUANTIZED_CODES}")


if __name__ == "__main__":
    main()
