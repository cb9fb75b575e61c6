"""The engine protocol every TTS backend implements.

An engine is driven from exactly one worker thread (see ``EngineWorker``): every
method here that ends in ``_blocking`` runs on that thread and nowhere else, so an
engine may keep thread-affine state (MLX streams, CUDA graphs) without locks.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from s2s_daemon.engines import EngineSection
from s2s_daemon.errors import ConfigError
from s2s_daemon.pipeline.vocabulary import (
    DeviceMemory,
    EngineError,
    EngineInfo,
    Samples,
    UnknownVoiceError,
    UnsupportedLanguageError,
)

__all__ = [
    "BatchEngine",
    "BatchSynthesis",
    "CheckpointError",
    "DeviceMemory",
    "EngineError",
    "EngineInfo",
    "EngineOptions",
    "EngineTraits",
    "ModelUnavailableError",
    "OptionsSchema",
    "Samples",
    "ShouldStop",
    "SynthesisRequest",
    "TtsEngine",
    "UnknownVoiceError",
    "UnsupportedLanguageError",
    "engine_traits",
]

ShouldStop = Callable[[], bool]
"""Polled by the engine between frames; True means stop generating now."""


@dataclass(frozen=True, slots=True)
class SynthesisRequest:
    """One utterance for the engine; text and voice are already validated."""

    text: str
    voice: str | None
    """Preset speaker (canonical spelling from ``EngineInfo.voices``) or None."""
    language: str
    """Canonical language name from ``EngineInfo.languages``."""
    instruct: str | None = None
    chunk_frames: int = 4
    """Codec frames per yielded chunk (12.5 frames per second)."""
    seed: int | None = None
    greedy: bool = False
    ref_audio: str | None = None
    """Path of a reference recording for voice cloning (Base models)."""
    ref_text: str | None = None
    """Transcript of ``ref_audio``; None means speaker-embedding-only cloning."""
    paced: bool = False
    """Heard as it is made (the daemon's speaker): a batching engine's worker keeps other requests
    out of the steps while this one's audio is not far enough ahead of playing time
    (``tts/scheduler.py``'s ``LEAD_S``), so that they never make it stutter."""


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Engine construction options taken from the ``tts`` config section (``registry.engine_options``:
    the fields its block's ``engine_fields`` names come from that block)."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "6bit"
    """MLX: ``4bit``, ``6bit``, ``8bit`` or ``bf16``; torch: ``none``, ``int8`` or ``int4``."""
    kernels: str = "auto"
    """Torch on the CPU: ``auto``, ``native`` or ``torch`` linear kernels."""
    isa: str = "auto"
    """Torch on the CPU: the native kernels' instruction-set path (``tts.torch.isa``)."""
    threads: int | None = None
    """Torch on the CPU: intra-op threads; None follows what the machine leaves free."""
    revision: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
    """``tts.options``: backend-specific knobs as strings (the engine reads them with its ``OptionsSchema``)."""
    section: EngineSection | None = None
    """The engine's own ``tts.<name>`` block, validated (the ``EngineSection`` its spec declares);
    None for an engine without one, or options made outside a configuration."""


class OptionsSchema(BaseModel):
    """An engine's ``tts.options``, declared by the engine (the registry finds it): every key typed,
    an unknown one refused with the known ones listed. The values arrive as strings (the config
    keeps ``tts.options`` a mapping of strings); pydantic turns them into the fields' types.
    ``check-config`` and ``run`` check them before the model loads (``preflight``); the engine reads
    them with ``read``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, values: object) -> object:
        """An empty value (``S2S_TTS__OPTIONS__MAX_FRAMES=``) leaves the option at its default."""
        if isinstance(values, dict):
            return {k: v for k, v in values.items() if not (isinstance(v, str) and not v.strip())}
        return values

    @classmethod
    def problems(cls, values: Mapping[str, str]) -> list[tuple[str, str]]:
        """(``tts.options.<key>``, what is wrong) for each wrong value or unknown key; [] when none."""
        try:
            cls.model_validate(dict(values))
        except ValidationError as exc:
            known = sorted(cls.model_fields)
            found = []
            for err in exc.errors():
                key = ".".join(str(part) for part in err["loc"])
                if err["type"] == "extra_forbidden":
                    close = difflib.get_close_matches(key, known, n=1)
                    hint = f"; did you mean {close[0]}?" if close else ""
                    message = f"unknown option{hint} (known: {', '.join(known) or 'none'})"
                else:
                    message = f"{values.get(key)!r}: {err['msg'].removeprefix('Value error, ')}"
                found.append((f"tts.options.{key}", message))
            return found
        return []

    @classmethod
    def read(cls, values: Mapping[str, str]) -> Self:
        """The options, typed; ``ConfigError`` naming each wrong key."""
        found = cls.problems(values)
        if found:
            raise ConfigError("\n".join(f"{key}: {message}" for key, message in found))
        return cls.model_validate(dict(values))


class CheckpointError(EngineError):
    """A checkpoint is missing, partial, corrupt or of the wrong model type."""


class ModelUnavailableError(EngineError):
    """A hub model cannot be had now (no network, the hub down, offline mode without a cached copy).

    Unlike ``CheckpointError`` the same settings can work later: the daemon exits "unavailable" and
    the service manager retries. ``str()`` is the fact; the caller adds what to do about it.
    """

    code = "model_unavailable"

    def __init__(self, model: str, reason: str, *, offline: bool = False, cache: str | None = None) -> None:
        self.model = model
        """The hub id that was looked up (the MLX engine's mlx-community repo for a ``Qwen/`` id)."""
        self.reason = reason
        self.offline = offline
        """True when the hub's offline mode (``HF_HUB_OFFLINE``) kept the daemon from asking the hub."""
        self.cache = cache
        """The hub cache folder that was searched, when known."""
        where = f" {cache}" if cache else ""
        super().__init__(f"cannot download {model!r}: {reason}; the local cache{where} has no complete copy")


@runtime_checkable
class TtsEngine(Protocol):
    """A streaming text-to-speech backend. Constructors do no I/O.

    An engine may also declare the attributes of ``EngineTraits`` (``max_batch``,
    ``park_thread_on_close``, ``info``); one it leaves out takes the default given there.
    """

    def load_blocking(self) -> EngineInfo:
        """Load weights (downloading if allowed) and return what the model offers."""
        ...

    def warmup_blocking(self) -> None:
        """Run a short synthesis so the first real request pays no compile cost."""
        ...

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[Samples]:
        """Yield audio chunk by chunk; check ``should_stop`` between frames."""
        ...

    def memory_blocking(self) -> DeviceMemory:
        """Accelerator memory counters; ``DeviceMemory("none")`` on a plain CPU."""
        ...

    def close_blocking(self) -> None:
        """Release weights and device memory."""
        ...


@dataclass(frozen=True, slots=True)
class EngineTraits:
    """What the worker reads of an engine beyond ``TtsEngine``'s methods, each optional on it.

    They are not members of ``TtsEngine``: a Protocol cannot give a default to an engine that
    satisfies it structurally (PEP 544 has no optional members), so declaring them there would make
    every engine, a test's or a plugin's (``register_engine``), define all of them. ``engine_traits``
    reads them, in this one place, with these defaults.
    """

    max_batch: int = 1
    """Requests the engine decodes together a frame at a time (``BatchEngine``). 1: one at a time,
    requests taking turns a chunk each. Read after ``load_blocking``: it may depend on what loaded."""
    park_thread_on_close: bool = False
    """Keep the engine's idle thread until the process ends instead of ending it at close: MLX
    aborts the process at exit when the thread that ran it has ended."""
    sample_rate: int | None = None
    """Hertz of its chunks from its ``info`` (an ``EngineInfo``) when the engine was loaded before
    the worker was made around it; None otherwise (the worker learns it from ``load``)."""


def engine_traits(engine: object) -> EngineTraits:
    """The ``EngineTraits`` ``engine`` declares now (it may change at ``load_blocking``)."""
    max_batch = getattr(engine, "max_batch", 1)
    park = getattr(engine, "park_thread_on_close", False)
    info = getattr(engine, "info", None)
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        msg = f"{type(engine).__name__}.max_batch must be a positive int, not {max_batch!r}"
        raise TypeError(msg)
    if not isinstance(park, bool):
        msg = f"{type(engine).__name__}.park_thread_on_close must be a bool, not {park!r}"
        raise TypeError(msg)
    return EngineTraits(
        max_batch=max_batch,
        park_thread_on_close=park,
        sample_rate=info.sample_rate if isinstance(info, EngineInfo) else None,
    )


class BatchSynthesis(Protocol):
    """One request of a ``BatchEngine``, advanced by its ``step_blocking``."""

    done: bool
    """No more chunks will come (the end, or a stop)."""

    def take(self) -> list[Samples]:
        """The chunks completed since the last call."""
        ...

    def stop(self) -> None:
        """Make nothing more (the consumer left)."""
        ...


@runtime_checkable
class BatchEngine(Protocol):
    """An engine that decodes several requests together, a frame of each per step (optional).

    The worker uses it when ``max_batch`` > 1 (read after ``load_blocking``); else, and for
    warm-up, ``synthesize_blocking``.
    """

    @property
    def max_batch(self) -> int: ...

    def open_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> BatchSynthesis:
        """Validate and prefill ``request`` (raising what ``synthesize_blocking`` would)."""
        ...

    def step_blocking(self, batch: list[BatchSynthesis]) -> None:
        """One frame of each unfinished synthesis in ``batch``, together."""
        ...
