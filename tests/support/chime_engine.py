"""A third engine, shipped as another distribution would ship one: this module and one entry point.

The tests install it into a temporary site folder (``tests/support/chime_dist.py``) as the module
``s2s_chime_engine`` of the distribution ``s2s-chime-engine``, whose ``entry_points.txt`` declares
``chime = s2s_chime_engine:ENGINE`` in the group ``s2s_daemon.engines``; nothing else registers it.
It imports only what an engine outside this repository would: ``s2s_daemon.engines`` and the
protocol (``s2s_daemon.tts.engine``). The engine conformance suite and a daemon run on it.

It chimes instead of speaking: a sine at ``tts.chime.pitch_hz`` (its own block), as long as the
text at ``tts.options.ms_per_char`` (its options), a frame of 80 ms at a time. The model is a folder
that must exist (it reads nothing from it); its two voices are ``Bell`` and ``Gong`` (an octave lower).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from pydantic import Field

from s2s_daemon.engines import EngineSection, EngineSpec
from s2s_daemon.tts.engine import (
    CheckpointError,
    DeviceMemory,
    EngineInfo,
    EngineOptions,
    OptionsSchema,
    Samples,
    ShouldStop,
    SynthesisRequest,
    UnknownVoiceError,
    UnsupportedLanguageError,
)

NAME = "chime"
"""Its entry point's name, which its ``EngineInfo`` carries."""
SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1920
"""80 ms: the protocol's frame (``SynthesisRequest.chunk_frames``)."""
VOICES = {"Bell": 1.0, "Gong": 0.5}
"""Each voice and its pitch as a share of ``pitch_hz``."""
LANGUAGES = ("auto", "english", "german")


class ChimeSection(EngineSection):
    """``tts.chime``."""

    pitch_hz: float = Field(880.0, ge=50, le=8000)


class ChimeOptions(OptionsSchema):
    """``tts.options`` of the chime engine."""

    ms_per_char: int = Field(20, ge=1, le=1000)
    """Audio per character of the text."""
    max_frames: int | None = Field(None, ge=1)


class ChimeEngine:
    """Deterministic: the same request gives the same samples."""

    park_thread_on_close = False

    def __init__(self, options: EngineOptions) -> None:
        self.folder = Path(options.model)
        self.section = options.section if isinstance(options.section, ChimeSection) else ChimeSection()
        self.options = ChimeOptions.read(options.extra)
        self.info: EngineInfo | None = None
        self.closed = False

    def load_blocking(self) -> EngineInfo:
        if not self.folder.is_dir():
            raise CheckpointError(f"model folder {str(self.folder)!r} does not exist or is not a folder")
        self.info = EngineInfo(
            engine=NAME,
            model=str(self.folder),
            device="cpu",
            sample_rate=SAMPLE_RATE,
            voices=tuple(VOICES),
            languages=LANGUAGES,
            dtype="float32",
        )
        return self.info

    def warmup_blocking(self) -> None:
        for _ in self.synthesize_blocking(SynthesisRequest("Warm up.", None, "auto"), lambda: False):
            pass

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[Samples]:
        """Checks the voice and language at the call (as the mlx engine does), then chimes."""
        voice = request.voice or next(iter(VOICES))
        if voice not in VOICES:
            raise UnknownVoiceError(f"unknown voice {voice!r}; choose one of {', '.join(VOICES)}")
        if request.language not in LANGUAGES:
            raise UnsupportedLanguageError(f"unsupported language {request.language!r}")
        frames = max(1, math.ceil(len(request.text) * self.options.ms_per_char / 80))
        if self.options.max_frames is not None:
            frames = min(frames, self.options.max_frames)
        return self._chime(self.section.pitch_hz * VOICES[voice], frames, max(1, request.chunk_frames), should_stop)

    def _chime(self, pitch_hz: float, frames: int, chunk_frames: int, should_stop: ShouldStop) -> Iterator[Samples]:
        done = 0
        while done < frames and not should_stop():
            n = min(chunk_frames, frames - done)
            t = np.arange(done * FRAME_SAMPLES, (done + n) * FRAME_SAMPLES) / SAMPLE_RATE
            done += n
            yield (0.3 * np.sin(2 * np.pi * pitch_hz * t)).astype(np.float32)

    def memory_blocking(self) -> DeviceMemory:
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        self.closed = True


ENGINE = EngineSpec(
    engine="s2s_chime_engine:ChimeEngine",
    install="s2s-chime-engine",
    requires=("numpy",),
    section=ChimeSection,
    options=ChimeOptions,
)
GPU_ENGINE = EngineSpec(
    engine="s2s_chime_gpu:GpuChimeEngine",  # no such module: importing it would be a different error
    install="s2s-chime-engine[gpu]",
    requires=("s2s_chime_accelerator",),
)
"""An engine whose extra is not installed (the tests declare it as ``chime_gpu`` where they need it)."""
