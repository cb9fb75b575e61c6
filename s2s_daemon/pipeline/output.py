"""A request's audio handed back to the caller that asked for it (Wyoming, HTTP), as it is made.

An intake that answers with audio instead of the speaker builds its request with
``output=CallerStream()``, submits it like any other, and reads ``stream.chunks(job.done)``.
The TTS stage writes the request's chunks straight into the stream (``tts/stage.py``): the engine
and the queue are shared with every other request, the ledger reports it like the rest, and the
speaker's playback never sees it. A caller that goes away calls ``abandon()`` and cancels its job.
A caller that asked for another ``speed`` gets the audio time-stretched as it comes
(``pipeline/stretch.py``, off the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np

from s2s_daemon.pipeline.channel import Channel, ChannelClosed, Overflow
from s2s_daemon.pipeline.stretch import ThreadedStretcher, needs_stretch
from s2s_daemon.pipeline.vocabulary import Samples

BUFFER_CHUNKS = 16
"""Chunks held for a slow reader before synthesis waits for it (back-pressure, as on the speaker)."""


def pcm16(samples: Samples) -> bytes:
    """Float samples in [-1, 1] as little-endian signed 16-bit PCM."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def apply_volume(samples: Samples, volume: float) -> Samples:
    """``samples`` times the linear gain ``volume``, clipped to [-1, 1]."""
    if volume == 1.0:
        return samples
    out: Samples = np.clip(samples * np.float32(volume), -1.0, 1.0).astype(np.float32, copy=False)
    return out


class CallerStream:
    """One request's audio on its way to the caller: the TTS stage writes (``open``, ``put``,
    ``finish``, ``close``), the intake reads (``chunks``, ``abandon``)."""

    name = "caller"

    def __init__(self, buffer_chunks: int = BUFFER_CHUNKS, speed: float = 1.0, whole: bool = False) -> None:
        self._chunks: Channel[Samples] = Channel(buffer_chunks, Overflow.BLOCK, "caller")
        self.sample_rate: int | None = None
        """Hertz of the chunks, known once synthesis began."""
        self.speed = speed
        """Playback speed the caller asked for (0.25..4.0; pitch kept): 1.0 is the model's own pace."""
        self.whole = whole
        """The caller gets the audio only once all of it is made (a file sent whole: the speech API's
        WAV and FLAC): its first sample goes out when the audio is complete (``complete``), not when
        the first chunk is made; one stopped or failed before then hands nothing on."""
        self.first_sample_at: float | None = None
        """Monotonic seconds when the first sample was handed on (whole: when the audio was complete)."""
        self.samples = 0
        """Samples handed on so far."""
        self._volume = 1.0
        self._stretcher: ThreadedStretcher | None = None

    # -- the TTS stage's side ----------------------------------------------------------

    def open(self, sample_rate: int, volume: float) -> None:
        """Synthesis begins: chunks of ``sample_rate`` Hertz follow, played at ``volume``."""
        self.sample_rate = sample_rate
        self._volume = volume
        if needs_stretch(self.speed):
            self._stretcher = ThreadedStretcher(self.speed, sample_rate)

    async def put(self, chunk: Samples) -> bool:
        """Hand ``chunk`` to the caller (stretched, at its volume), waiting while its buffer is
        full; False once the stream is closed (the caller is gone, or the request was stopped)."""
        if self._chunks.closed:
            return False
        if self._stretcher is not None and len(chunk):
            chunk = await self._stretcher.process(chunk)
        return await self._deliver(chunk)

    async def finish(self) -> bool:
        """The request's audio ended by itself: the stretcher's rest; False once the caller is gone."""
        if self._stretcher is None or self._chunks.closed:
            return not self._chunks.closed
        return await self._deliver(await self._stretcher.finish())

    def complete(self, at: float) -> float | None:
        """The request's audio is all made (not stopped, not failed): a whole file's first sample goes
        out ``at`` (monotonic seconds). The first sample's time, None when nothing was made."""
        if self.whole and self.samples and self.first_sample_at is None:
            self.first_sample_at = at
        return self.first_sample_at

    def close(self) -> None:
        """No more audio: the caller reads what is buffered, then the stream ends."""
        self._chunks.close()

    @property
    def closed(self) -> bool:
        return self._chunks.closed

    async def _deliver(self, chunk: Samples) -> bool:
        if not len(chunk):
            return True
        try:
            await self._chunks.put(apply_volume(chunk, self._volume))
        except ChannelClosed:  # abandoned or stopped
            return False
        if self.first_sample_at is None and not self.whole:
            self.first_sample_at = time.monotonic()
        self.samples += len(chunk)
        return True

    # -- the intake's side --------------------------------------------------------------

    async def chunks(self, done: asyncio.Event) -> AsyncIterator[Samples]:
        """The audio as it is made, until the stream ends or the request ends without more of it
        (``done`` is its job's: rejected, expired or cancelled before synthesis began)."""
        while True:
            try:
                yield self._chunks.get_nowait()
                continue
            except ChannelClosed:
                return
            except asyncio.QueueEmpty:
                pass
            if done.is_set():
                return
            readable = asyncio.ensure_future(self._chunks.wait_readable())
            ended = asyncio.ensure_future(done.wait())
            try:
                await asyncio.wait({readable, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in (readable, ended):
                    waiter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiter

    def abandon(self) -> None:
        """The caller is gone: drop what is buffered; synthesis ends at its next chunk."""
        self._chunks.clear()
        self._chunks.close()
