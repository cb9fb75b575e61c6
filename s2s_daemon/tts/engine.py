"""The engine protocol every TTS backend implements.

An engine is driven from exactly one worker thread (see ``EngineWorker``): every
method here that ends in ``_blocking`` runs on that thread and nowhere else, so an
engine may keep thread-affine state (MLX streams, CUDA graphs) without locks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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
    "ModelUnavailableError",
    "Samples",
    "ShouldStop",
    "SynthesisRequest",
    "TtsEngine",
    "UnknownVoiceError",
    "UnsupportedLanguageError",
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
    (``tts/worker.py``'s ``LEAD_S``), so that they never make it stutter."""


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Engine construction options taken from the ``tts`` config section."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "6bit"
    """MLX: ``4bit``, ``6bit``, ``8bit`` or ``bf16``; torch: ``none``, ``int8`` or ``int4``."""
    kernels: str = "auto"
    """Torch on the CPU: ``auto``, ``native`` or ``torch`` linear kernels."""
    threads: int | None = None
    """Torch on the CPU: intra-op threads; None follows what the machine leaves free."""
    revision: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
    """Backend-specific knobs (test engines use this for speed)."""


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
    """A streaming text-to-speech backend. Constructors do no I/O."""

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
