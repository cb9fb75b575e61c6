"""The speaker: a callback-driven PortAudio output stream fed through a lock-free ring buffer.

Threads: the event loop is the only writer (``play``), PortAudio's callback thread the
only reader. They share plain attributes, each written by one side only, and one
preallocated float32 ring; no lock is taken and the callback allocates no arrays, logs
nothing and never waits. The stream runs from ``open`` to ``close`` and plays silence
between utterances, so an utterance starts without reopening the device.

Per utterance: chunks (engine rate, 24 kHz) are scaled by the request's volume and
resampled by soxr to the device's default rate, then written into the ring. The
callback starts consuming once ``audio.latency_ms`` is buffered (or the utterance has
ended, for short ones), records the moment it hands the first sample to the device,
counts a run of callbacks that find the ring empty before the end as one underrun (and
plays silence, whose length it adds up), and records when the last sample will have left the device (its output
latency included). Cancelling ``play`` asks the callback to drop everything buffered;
it does so on its next period, and ``play`` waits for that before re-raising.

A device that fails to open, or stops calling back mid-utterance, raises
``AudioDeviceError`` (``audio_error`` on that request); the next ``play`` reopens it,
no sooner than an exponential backoff allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from s2s_daemon.audio.devices import DeviceInfo, portaudio, resolve_device
from s2s_daemon.audio.sink import AudioDeviceError, OnFirstSample
from s2s_daemon.config import AudioConfig
from s2s_daemon.pipeline.channel import ChannelClosed
from s2s_daemon.pipeline.messages import PlaybackReport, Utterance
from s2s_daemon.pipeline.output import apply_volume

log = structlog.get_logger(__name__)

DEFAULT_PERIOD_MS = 20.0
"""Callback period: stop and barge-in take effect within one."""
RING_S = 4.0
"""Seconds of device-rate audio the ring holds; a faster engine waits for room."""
STATS_SIZE = 4096
"""Callbacks whose duration and read position are kept for ``stats()`` (a ring)."""
STALL_S = 2.0
"""Seconds without a callback, while the stream should run, that count as a lost device."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


@dataclass(frozen=True, slots=True)
class SpeakerStats:
    """Counters of the open stream since ``open``."""

    device: str
    rate_hz: int
    """Device sample rate (hertz)."""
    period_ms: float
    """Frames per callback, in milliseconds."""
    output_latency_ms: float
    """PortAudio's output latency of the stream."""
    callbacks: int
    underruns: int
    """Times the ring ran dry mid-utterance (all utterances): a run of starved callbacks is one."""
    underrun_ms: float
    """Milliseconds of silence those underruns played (all utterances)."""
    xruns: int
    """Callbacks with PortAudio's output underflow flag set."""
    callback_p50_ms: float
    callback_p99_ms: float
    callback_max_ms: float


class SpeakerSink:
    """Plays utterances on a PortAudio output device (``audio.sink: speaker``)."""

    name = "speaker"
    realtime = True

    def __init__(self, config: AudioConfig, period_ms: float = DEFAULT_PERIOD_MS) -> None:
        self.config = config
        self.period_ms = period_ms
        self.device: DeviceInfo | None = None
        self.rate_hz = 0
        self.channels = 1
        self._stream: Any = None
        self._sd: Any = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._out_latency_s = 0.0
        # Shared with the callback. Written by the event loop only:
        self._ring: npt.NDArray[np.float32] = np.zeros(1, np.float32)
        self._cap = 1
        self._wpos = 0
        """Frames ever written."""
        self._start_pos = 0
        """Playback of the armed utterance starts once ``_wpos`` reaches this."""
        self._end_pos = -1
        """``_wpos`` at the end of the armed utterance; -1 while it is still streaming."""
        self._armed = False
        self._seq = 0
        self._flush_req = 0
        # Written by the callback only:
        self._rpos = 0
        self._playing = False
        self._first_at = 0.0
        self._last_at = 0.0
        self._done_seq = 0
        self._flush_ack = 0
        self._flush_at = 0.0
        """Monotonic seconds of the last flush the callback carried out."""
        self._underruns = 0
        """Runs of callbacks that found the ring empty mid-utterance."""
        self._underrun_frames = 0
        """Frames of silence played in those runs."""
        self._starved = False
        """The last callback found the ring empty mid-utterance (the next one continues that run)."""
        self._xruns = 0
        self._callbacks = 0
        self._cb_start = np.zeros(STATS_SIZE, np.float64)
        self._cb_dur = np.zeros(STATS_SIZE, np.float64)
        self._cb_rpos = np.zeros(STATS_SIZE, np.int64)

    # --- lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        """Open and start the output stream; ``AudioDeviceError`` names what is wrong."""
        await asyncio.to_thread(self._open_blocking)

    def _open_blocking(self) -> None:
        sd = portaudio()
        self._sd = sd
        device = resolve_device(self.config.device, "output")
        rate = round(device.default_rate_hz)
        block = max(1, round(rate * self.period_ms / 1000.0))
        # Fresh shared state: nothing of a previous stream survives a reopen.
        self._cap = max(round(rate * RING_S), 2 * round(rate * self.config.latency_ms / 1000.0))
        self._ring = np.zeros(self._cap, np.float32)
        self._wpos = self._rpos = 0
        self._armed = self._playing = False
        self._end_pos = -1
        self._flush_ack = self._flush_req
        last_error: Exception | None = None
        for channels in (1, 2):
            if channels > device.max_output_channels:
                break
            # The callback reads these as soon as the stream starts.
            self.rate_hz = rate
            self.channels = channels
            try:
                stream = sd.RawOutputStream(
                    samplerate=rate,
                    blocksize=block,
                    device=device.index,
                    channels=channels,
                    dtype="float32",
                    latency=max(2.0 * self.period_ms, 40.0) / 1000.0,
                    callback=self._callback,
                )
            except (sd.PortAudioError, ValueError) as exc:
                last_error = exc
                continue
            try:
                stream.start()
            except sd.PortAudioError as exc:
                stream.close(ignore_errors=True)
                raise AudioDeviceError(f"cannot start output device {device.name!r}: {exc}") from exc
            self._stream = stream
            self._settle_blocking(block / rate)
            self.device = device
            self._out_latency_s = float(stream.latency)
            log.info(
                "speaker_opened",
                device=device.name,
                index=device.index,
                rate_hz=rate,
                channels=channels,
                period_ms=self.period_ms,
                output_latency_ms=round(1000.0 * self._out_latency_s, 1),
                prebuffer_ms=self.config.latency_ms,
            )
            return
        raise AudioDeviceError(f"cannot open output device {device.name!r}: {last_error}")

    def _settle_blocking(self, period_s: float, timeout_s: float = 1.5) -> None:
        """Wait until callbacks come steadily: some hosts (ALSA's pulse plugin) prefill,
        then pause for a few hundred ms before the clock runs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            count = self._callbacks
            if count >= 8:
                last = self._cb_start[(count - 1) % STATS_SIZE]
                before = self._cb_start[(count - 4) % STATS_SIZE]
                if last - before < 6 * period_s and time.monotonic() - last < 3 * period_s:
                    return
            time.sleep(period_s / 2)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await asyncio.to_thread(self._close_stream_blocking, stream)

    def _close_stream_blocking(self, stream: Any) -> None:
        try:
            stream.abort(ignore_errors=True)
        finally:
            stream.close(ignore_errors=True)

    # --- the audio thread -------------------------------------------------------------

    def _callback(self, outdata: Any, frames: int, time_info: Any, status: Any) -> None:
        now = time.monotonic()
        out = np.frombuffer(outdata, dtype=np.float32)
        if self.channels != 1:
            out = out.reshape(frames, self.channels)
        if status.output_underflow:
            self._xruns += 1
        n = 0
        if self._flush_req != self._flush_ack:
            self._rpos = self._wpos
            self._playing = False
            self._flush_ack = self._flush_req
            self._flush_at = now
        elif not self._playing and self._armed and (self._wpos >= self._start_pos or self._end_pos >= 0):
            self._playing = True
            self._starved = False
        if self._playing:
            rpos = self._rpos
            n = min(self._wpos - rpos, frames)
            if n > 0:
                cap = self._cap
                start = rpos % cap
                first = min(n, cap - start)
                if self.channels == 1:
                    np.copyto(out[:first], self._ring[start : start + first])
                    if first < n:
                        np.copyto(out[first:n], self._ring[: n - first])
                else:
                    np.copyto(out[:first], self._ring[start : start + first, np.newaxis])
                    if first < n:
                        np.copyto(out[first:n], self._ring[: n - first, np.newaxis])
                if self._first_at == 0.0:
                    self._first_at = now
                rpos += n
                self._rpos = rpos
            end = self._end_pos
            if end >= 0 and rpos >= end:
                dac = time_info.outputBufferDacTime
                delay = dac - time_info.currentTime if dac > 0.0 else self._out_latency_s
                self._last_at = now + max(delay, 0.0) + n / self.rate_hz
                self._playing = False
                self._armed = False
                self._done_seq = self._seq
            elif n < frames:
                if not self._starved:  # a new run: one underrun however many periods it lasts
                    self._underruns += 1
                    self._starved = True
                self._underrun_frames += frames - n
            else:
                self._starved = False
        if n < frames:
            out[n:] = 0.0
        i = self._callbacks % STATS_SIZE
        self._cb_start[i] = now
        self._cb_rpos[i] = self._rpos
        self._callbacks += 1
        self._cb_dur[i] = time.monotonic() - now

    # --- the event loop side ----------------------------------------------------------

    @property
    def period_s(self) -> float:
        return self.period_ms / 1000.0

    def _fresh(self) -> bool:
        """Whether the stream runs and called back lately (a stalled one is reopened)."""
        if self._stream is None or not self._stream.active:
            return False
        count = self._callbacks
        if count == 0:
            return True
        last = float(self._cb_start[(count - 1) % STATS_SIZE])
        return time.monotonic() - last < max(STALL_S, 10 * self.period_s)

    async def _ensure_open(self) -> None:
        if self._fresh():
            return
        now = time.monotonic()
        if now < self._retry_at:
            raise AudioDeviceError(f"output device unavailable; next reopen in {self._retry_at - now:.1f} s")
        if self._stream is not None:
            await self.close()
        try:
            await self.open()
        except AudioDeviceError as exc:
            self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2.0 * self._backoff_s))
            self._retry_at = time.monotonic() + self._backoff_s
            log.warning("speaker_reopen_failed", error=str(exc), retry_in_s=self._backoff_s)
            raise
        self._backoff_s = 0.0

    async def _device_lost(self, reason: str) -> AudioDeviceError:
        log.warning("speaker_lost", device=self.device.name if self.device else None, reason=reason)
        await self.close()
        self._backoff_s = BACKOFF_FIRST_S
        self._retry_at = time.monotonic() + self._backoff_s
        return AudioDeviceError(f"output device {self.device.name if self.device else '?'} failed: {reason}")

    def _healthy(self, seen_callbacks: int, seen_at: float) -> tuple[int, float, str | None]:
        """Track callback progress; a reason when the stream died or stalled."""
        stream = self._stream
        if stream is None or not stream.active:
            return seen_callbacks, seen_at, "the stream stopped"
        now = time.monotonic()
        if self._callbacks != seen_callbacks:
            return self._callbacks, now, None
        if now - seen_at > max(STALL_S, 10 * self.period_s):
            return seen_callbacks, seen_at, f"no callback for {now - seen_at:.2f} s"
        return seen_callbacks, seen_at, None

    def _request_flush(self) -> None:
        """Ask the callback to drop everything buffered on its next period."""
        self._armed = False
        self._flush_req += 1

    async def _flush(self) -> None:
        """Wait until the requested flush is done (or do it here if no callback will come)."""
        deadline = time.monotonic() + 3 * self.period_s + 0.1
        while self._flush_ack != self._flush_req:
            if self._stream is None or not self._stream.active or time.monotonic() > deadline:
                # No callback will come: nothing can be playing, so flush from here.
                self._playing = False
                self._rpos = self._wpos
                self._flush_ack = self._flush_req
                return
            await asyncio.sleep(self.period_s / 4)

    async def play(self, utterance: Utterance, on_first_sample: OnFirstSample) -> PlaybackReport:
        await self._ensure_open()
        run = _Playing(self, utterance, on_first_sample)
        underruns_before = self._underruns
        underrun_frames_before = self._underrun_frames
        xruns_before = self._xruns
        finished = False
        try:
            await run.feed()
            if not run.written:
                # Nothing to play: the callback cannot have started (nothing reached _start_pos).
                self._armed = False
                finished = True
                return PlaybackReport(None, None, 0.0)
            await run.until_played()
            finished = True
        finally:
            if not finished:
                self._request_flush()  # first: the callback may act before we run again
            await run.cancel_pending()
            if not finished:
                await self._flush()
        underruns = self._underruns - underruns_before
        underrun_ms = 1000.0 * (self._underrun_frames - underrun_frames_before) / self.rate_hz
        xruns = self._xruns - xruns_before
        if underruns or xruns:
            log.info(
                "speaker_underruns",
                id=utterance.request.id,
                underruns=underruns,
                underrun_ms=round(underrun_ms, 1),
                xruns=xruns,
            )
        first_at = self._first_at if run.written else None
        return PlaybackReport(
            first_sample_at=first_at or None,
            last_sample_at=self._last_at if first_at else None,
            audio_ms=1000.0 * run.written / self.rate_hz,
            underruns=underruns,
            underrun_ms=underrun_ms,
        )

    # --- figures ----------------------------------------------------------------------

    def callback_trace(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """The last callbacks, oldest first: monotonic start (s), read position after (frames), duration (s)."""
        count = min(self._callbacks, STATS_SIZE)
        order = (np.arange(self._callbacks - count, self._callbacks) % STATS_SIZE).astype(np.int64)
        return self._cb_start[order].copy(), self._cb_rpos[order].copy(), self._cb_dur[order].copy()

    def stats(self) -> SpeakerStats:
        _, _, dur = self.callback_trace()
        ms = dur * 1000.0 if len(dur) else np.zeros(1)
        return SpeakerStats(
            device=self.device.name if self.device else "",
            rate_hz=self.rate_hz,
            period_ms=self.period_ms,
            output_latency_ms=1000.0 * self._out_latency_s,
            callbacks=self._callbacks,
            underruns=self._underruns,
            underrun_ms=1000.0 * self._underrun_frames / self.rate_hz if self.rate_hz else 0.0,
            xruns=self._xruns,
            callback_p50_ms=float(np.percentile(ms, 50)),
            callback_p99_ms=float(np.percentile(ms, 99)),
            callback_max_ms=float(ms.max()),
        )


class _Playing:
    """One utterance on its way into the speaker's ring: armed on creation, fed from the chunk
    channel, then waited for until the callback has played its last sample."""

    def __init__(self, sink: SpeakerSink, utterance: Utterance, on_first_sample: OnFirstSample) -> None:
        import soxr

        self.sink = sink
        self.utterance = utterance
        self.on_first_sample = on_first_sample
        rate = sink.rate_hz
        self.resampler = (
            soxr.ResampleStream(utterance.sample_rate, rate, 1, dtype="float32", quality="HQ")
            if utterance.sample_rate != rate
            else None
        )
        self.volume = utterance.request.volume
        self.reported = False
        self.written = 0
        """Samples (at the device's rate) put into the ring."""
        self.pending: asyncio.Task[Any] | None = None
        self.seen = (sink._callbacks, time.monotonic())
        # Arm: the callback is idle (previous utterance done or flushed).
        sink._first_at = 0.0
        sink._last_at = 0.0
        sink._end_pos = -1
        sink._start_pos = sink._wpos + max(1, round(rate * sink.config.latency_ms / 1000.0))
        sink._seq += 1
        self.seq = sink._seq
        sink._armed = True

    def report_first(self) -> None:
        if not self.reported and self.sink._first_at != 0.0:
            self.reported = True
            self.on_first_sample(self.sink._first_at)

    async def check(self) -> None:
        """Raise AudioDeviceError when the device stopped calling back."""
        callbacks, at, reason = self.sink._healthy(*self.seen)
        self.seen = (callbacks, at)
        if reason is not None:
            raise await self.sink._device_lost(reason)

    async def write(self, samples: npt.NDArray[np.float32]) -> None:
        sink = self.sink
        done = 0
        total = len(samples)
        while done < total:
            room = sink._cap - (sink._wpos - sink._rpos)
            if room <= 0:
                self.report_first()
                await self.check()
                await asyncio.sleep(sink.period_s / 2)
                continue
            n = min(room, total - done)
            start = sink._wpos % sink._cap
            first = min(n, sink._cap - start)
            sink._ring[start : start + first] = samples[done : done + first]
            if first < n:
                sink._ring[: n - first] = samples[done + first : done + n]
            sink._wpos += n
            done += n
        self.written += total

    async def feed(self) -> None:
        """Every chunk into the ring until the channel closes (the resampler's tail included)."""
        chunks = self.utterance.chunks
        while True:
            if self.pending is None:
                self.pending = asyncio.ensure_future(chunks.get())
            await asyncio.wait((self.pending,), timeout=self.sink.period_s)
            self.report_first()
            await self.check()
            if not self.pending.done():
                continue
            task, self.pending = self.pending, None
            try:
                chunk = task.result()
            except ChannelClosed:
                break
            if not len(chunk):
                continue
            chunk = apply_volume(chunk, self.volume)
            out = self.resampler.resample_chunk(chunk) if self.resampler is not None else chunk
            await self.write(np.asarray(out, np.float32))
        if self.resampler is not None and self.written:
            tail = self.resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            await self.write(np.asarray(tail, np.float32))

    async def until_played(self) -> None:
        sink = self.sink
        sink._end_pos = sink._wpos
        while sink._done_seq != self.seq:
            self.report_first()
            await self.check()
            await asyncio.sleep(sink.period_s / 2)
        self.report_first()
        delay = sink._last_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def cancel_pending(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, ChannelClosed):
                await self.pending
