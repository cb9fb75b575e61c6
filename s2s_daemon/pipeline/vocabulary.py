"""The vocabulary every stage speaks, below all of them: audio samples, what an engine can do
(its voices and languages), device memory, and how a request's voice and language are matched.

It imports no stage. Engines, intakes, the ledger and the events all import it; the engine
protocol (``tts/engine.py``) re-exports it for the engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

Samples = npt.NDArray[np.float32]
"""Mono float32 PCM in [-1, 1]."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a loaded engine can do; published on ``<p>/<site>/info``."""

    engine: str
    """Its registry name, the one ``tts.engine`` gives: ``torch``, ``mlx``, a third party's."""
    model: str
    """Hub id or local folder the weights came from, as the engine loaded them; the daemon names
    it with ``model_name`` once loaded (``EngineWorker.load``): a local folder by its name."""
    device: str
    """Where inference runs: ``cuda:0``, ``cpu``, ``mps``, ``metal``..."""
    sample_rate: int
    """Hertz of the samples the engine yields."""
    voices: tuple[str, ...] = ()
    """Preset speakers; empty when the model has none (VoiceDesign, Base)."""
    languages: tuple[str, ...] = ("auto",)
    """Canonical language names the model accepts (``auto`` first)."""
    dtype: str = ""
    """Weight format actually used: ``float32``, ``bfloat16``, ``int8``, ``4bit``..."""
    mode: str = "custom_voice"
    """``custom_voice``, ``voice_design`` or ``base`` (voice clone)."""
    format_reason: str = ""
    """Why ``dtype``: what ``auto`` chose for this device and why, or ``configured``; empty when the
    engine does not say."""
    isa: str = ""
    """The torch engine's native CPU kernels: the instruction-set path that runs and why
    (``avx512 (auto: cpu has avx512_vnni)``); empty without them."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Accelerator memory as the framework counts it."""

    kind: str
    """``cuda``, ``mps``, ``mlx`` or ``none``."""
    allocated_mib: float = 0.0
    """Currently held, mebibytes."""
    peak_mib: float = 0.0
    """High-water mark since start, mebibytes."""


class EngineError(Exception):
    """A failure inside the engine; ``code`` is the MQTT error code."""

    code = "engine_error"


class UnknownVoiceError(EngineError):
    code = "unknown_voice"


class UnsupportedLanguageError(EngineError):
    code = "unsupported_language"


LANGUAGE_ALIASES: dict[str, str] = {
    "auto": "auto",
    "zh": "chinese", "zh-cn": "chinese", "zh-hans": "chinese", "cmn": "chinese", "mandarin": "chinese",
    "en": "english", "en-us": "english", "en-gb": "english",
    "ja": "japanese", "ja-jp": "japanese", "jp": "japanese",
    "ko": "korean", "ko-kr": "korean",
    "de": "german", "de-de": "german",
    "fr": "french", "fr-fr": "french",
    "ru": "russian", "ru-ru": "russian",
    "pt": "portuguese", "pt-br": "portuguese", "pt-pt": "portuguese",
    "es": "spanish", "es-es": "spanish", "es-mx": "spanish",
    "it": "italian", "it-it": "italian",
}  # fmt: skip


def normalize_language(value: str | None, supported: tuple[str, ...]) -> str:
    """Map ``en``, ``zh-CN``, ``English``... onto a canonical name the engine supports."""
    if value is None or not value.strip():
        return "auto"
    key = value.strip().lower().replace("_", "-")
    canonical = LANGUAGE_ALIASES.get(key, key)
    lowered = {lang.lower(): lang for lang in supported}
    if canonical in lowered:
        return lowered[canonical]
    raise UnsupportedLanguageError(f"language {value!r} is not supported; choose one of {', '.join(supported)}")


def match_voice(value: str | None, voices: tuple[str, ...], default: str | None) -> str | None:
    """Case-insensitive match against the engine's preset voices; None picks the default."""
    wanted = value if value is not None and value.strip() else default
    if not voices:
        if value is not None and value.strip():
            raise UnknownVoiceError(f"voice {value!r}: this model has no preset voices")
        return None
    if wanted is None:
        return voices[0]
    lowered = {v.lower(): v for v in voices}
    found = lowered.get(wanted.strip().lower())
    if found is None:
        raise UnknownVoiceError(f"voice {wanted!r} is unknown; choose one of {', '.join(voices)}")
    return found


def model_name(model: str) -> str:
    """``tts.model`` as others may see it: a hub id as is, a local folder by its name (a path says
    where the files are on this machine, and whose home they are in; ``/v1/models``, Home Assistant's
    device), a hub cache snapshot by the id it was downloaded as."""
    if not model.startswith(("/", ".", "~")) and "/" in model and not Path(model).expanduser().exists():
        return model
    path = Path(model).expanduser()
    for part in reversed(path.parts):
        if part.startswith("models--"):  # .../hub/models--Qwen--Qwen3-TTS-12Hz-0.6B-Base/snapshots/<hash>
            return part[len("models--") :].replace("--", "/", 1)
    return path.resolve().name or model
