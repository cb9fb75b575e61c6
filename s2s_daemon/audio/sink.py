"""The sink protocol and the two sinks that need no sound card."""

from __future__ import annotations

import asyncio
import time
import wave
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from s2s_daemon.pipeline.messages import OnFirstSample, PlaybackReport, Utterance
from s2s_daemon.pipeline.output import apply_volume
from s2s_daemon.pipeline.vocabulary import Samples

__all__ = ["AudioDeviceError", "AudioSink", "DiscardSink", "OnFirstSample", "WavSink", "write_wav"]


class AudioDeviceError(Exception):
    """The output device is missing, busy or failed; maps to ``audio_error``."""


@runtime_checkable
class AudioSink(Protocol):
    """Plays utterances one at a time.

    ``play`` consumes ``utterance.chunks`` until the channel closes and returns once the
    last sample has played. Cancelling ``play`` flushes what is buffered (stop, barge-in)
    and must take effect within one device period.
    """

    name: str
    realtime: bool
    """Plays at the pace of the audio, heard as it plays (the speaker): the only sink worth holding
    a first sample for, or keeping other requests out of the engine's steps for. A sink without
    this attribute counts as not real time."""

    async def open(self) -> None: ...

    async def play(self, utterance: Utterance, on_first_sample: OnFirstSample) -> PlaybackReport: ...

    async def close(self) -> None: ...


class DiscardSink:
    """Consumes audio as fast as it comes and drops it (``audio.sink: discard``)."""

    name = "discard"
    realtime = False

    async def open(self) -> None:
        return None

    async def play(self, utterance: Utterance, on_first_sample: OnFirstSample) -> PlaybackReport:
        first: float | None = None
        samples = 0
        async for chunk in utterance.chunks:
            if first is None and len(chunk):
                first = time.monotonic()
                on_first_sample(first)
            samples += len(chunk)
        end = time.monotonic() if first is not None else None
        return PlaybackReport(first, end, 1000.0 * samples / utterance.sample_rate)

    async def close(self) -> None:
        return None


def write_wav(path: Path, samples: Samples, sample_rate: int) -> None:
    """Write mono float samples as 16-bit PCM WAV."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())


class WavSink:
    """Writes one ``<id>.wav`` per utterance into a folder (``audio.sink: wav``), or every
    utterance to one fixed file (``s2s-daemon say --out``)."""

    name = "wav"
    realtime = False

    def __init__(self, folder: Path, filename: str | None = None) -> None:
        self.folder = folder
        self.filename = filename

    async def open(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AudioDeviceError(f"cannot create audio.wav_dir {self.folder}: {exc}") from exc

    async def play(self, utterance: Utterance, on_first_sample: OnFirstSample) -> PlaybackReport:
        """Collect the utterance, then write it; a stopped one (cancelled) writes what came first,
        when something did (``say --out`` stopped with Ctrl-C keeps what was made)."""
        parts: list[Samples] = []
        first: float | None = None
        try:
            async for chunk in utterance.chunks:
                if first is None and len(chunk):
                    first = time.monotonic()
                    on_first_sample(first)
                parts.append(apply_volume(chunk, utterance.request.volume))
        except asyncio.CancelledError:
            if parts:
                await asyncio.shield(self._write(utterance, parts))
            raise
        audio = await self._write(utterance, parts)
        end = time.monotonic() if first is not None else None
        return PlaybackReport(first, end, 1000.0 * len(audio) / utterance.sample_rate)

    async def _write(self, utterance: Utterance, parts: list[Samples]) -> Samples:
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in utterance.request.id)[:120] or "utterance"
        path = self.folder / (self.filename or f"{safe_id}.wav")
        try:
            await asyncio.to_thread(write_wav, path, audio, utterance.sample_rate)
        except OSError as exc:
            raise AudioDeviceError(f"cannot write {path}: {exc}") from exc
        return audio

    async def close(self) -> None:
        return None
