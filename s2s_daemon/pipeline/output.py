"""A request's audio handed back to the caller that asked for it (Wyoming, HTTP), as it is made.

An intake that answers with audio instead of the speaker builds its request with
``output=CallerStream()``, submits it like any other, and reads ``stream.chunks(job.done)``:
the playback stage plays it as an ``AudioOutput`` beside the speaker, the engine and the queue
are shared with every other request, and the ledger (``Dispatcher``) reports it like the rest.
A caller that goes away calls ``abandon()`` and cancels its job. A caller that asked for another
``speed`` gets the audio time-stretched as it comes (``audio/stretch.py``, off the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np

from s2s_daemon.audio.sink import apply_volume
from s2s_daemon.audio.stretch import ThreadedStretcher, needs_stretch
from s2s_daemon.pipeline.channel import Channel, ChannelClosed, Overflow
from s2s_daemon.pipeline.messages import FirstSample, PlaybackReport, Utterance
from s2s_daemon.pipeline.vocabulary import Samples

BUFFER_CHUNKS = 16
"""Chunks held for a slow reader before synthesis waits for it (back-pressure, as on the speaker)."""


def pcm16(samples: Samples) -> bytes:
    """Float samples in [-1, 1] as little-endian signed 16-bit PCM."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class CallerStream:
    """An ``AudioOutput`` whose chunks the intake reads instead of a device playing them."""

    name = "caller"

    def __init__(self, buffer_chunks: int = BUFFER_CHUNKS, speed: float = 1.0) -> None:
        self._chunks: Channel[Samples] = Channel(buffer_chunks, Overflow.BLOCK, "caller")
        self.sample_rate: int | None = None
        """Hertz of the chunks, known once playback began."""
        self.speed = speed
        """Playback speed the caller asked for (0.25..4.0; pitch kept): 1.0 is the model's own pace."""

    async def play(self, utterance: Utterance, on_first_sample: FirstSample) -> PlaybackReport:
        self.sample_rate = utterance.sample_rate
        stretcher = ThreadedStretcher(self.speed, utterance.sample_rate) if needs_stretch(self.speed) else None
        first: float | None = None
        samples = 0

        async def deliver(chunk: Samples) -> bool:
            """Hand ``chunk`` to the caller; False once the caller is gone."""
            nonlocal first, samples
            if not len(chunk):
                return True
            try:
                await self._chunks.put(apply_volume(chunk, utterance.request.volume))
            except ChannelClosed:  # abandoned: the caller is gone
                return False
            if first is None:
                first = time.monotonic()
                on_first_sample(first)
            samples += len(chunk)
            return True

        try:
            async for chunk in utterance.chunks:
                if stretcher is not None and len(chunk):
                    chunk = await stretcher.process(chunk)
                if not await deliver(chunk):
                    break
            else:  # the utterance ended (not the caller): the stretcher's rest
                if stretcher is not None:
                    await deliver(await stretcher.finish())
        finally:
            self._chunks.close()
        end = time.monotonic() if first is not None else None
        return PlaybackReport(first, end, 1000.0 * samples / utterance.sample_rate)

    async def chunks(self, done: asyncio.Event) -> AsyncIterator[Samples]:
        """The audio as it is made, until the stream ends or the request ends without more of it
        (``done`` is its job's: rejected, expired or cancelled before playback began)."""
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
        """The caller is gone: drop what is buffered; playback ends at its next chunk."""
        self._chunks.clear()
        self._chunks.close()
