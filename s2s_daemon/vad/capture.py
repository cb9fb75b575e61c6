"""Microphone capture: a PortAudio input callback fills a preallocated ring of frames.

The callback (PortAudio's thread) copies 16 kHz mono int16 samples into the ring and
stamps each completed frame with the monotonic time its first sample was captured; it
allocates no arrays, logs nothing and takes no lock. The reader (the event loop)
drains whole frames. When the reader falls more than the ring behind, the oldest frames
are dropped and counted in ``dropped``; a frame the callback overwrote while it was
being read is dropped too (checked after the copy).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from s2s_daemon.audio.devices import DeviceInfo, portaudio, resolve_device
from s2s_daemon.audio.sink import AudioDeviceError

log = structlog.get_logger(__name__)

SAMPLE_RATE_HZ = 16_000
QUEUE_FRAMES = 100
"""Frames the ring holds (2 s at 20 ms); older ones are dropped."""


class MicrophoneCapture:
    """Captures frames of ``frame_ms`` from an input device."""

    def __init__(self, device: str | int | None, frame_ms: int, queue_frames: int = QUEUE_FRAMES) -> None:
        self.device_spec = device
        self.frame_ms = frame_ms
        self.frame_samples = SAMPLE_RATE_HZ * frame_ms // 1000
        self.capacity = queue_frames
        self.device: DeviceInfo | None = None
        self.dropped = 0
        """Frames lost because the reader fell behind (oldest first)."""
        self.overflows = 0
        """Callbacks with PortAudio's input overflow flag set."""
        self._stream: Any = None
        self._frames: npt.NDArray[np.int16] = np.zeros((queue_frames, self.frame_samples), np.int16)
        self._stamps: npt.NDArray[np.float64] = np.zeros(queue_frames, np.float64)
        self._written = 0
        """Frames completed by the callback (it is the only writer)."""
        self._fill = 0
        """Samples already in the frame being filled."""
        self._read = 0
        """Frames consumed by the reader (it is the only writer)."""
        self._latency_s = 0.0

    @property
    def active(self) -> bool:
        return self._stream is not None and bool(self._stream.active)

    def open_blocking(self) -> None:
        """Open and start the input stream; ``AudioDeviceError`` when there is no usable device."""
        sd = portaudio()
        device = resolve_device(self.device_spec, "input")
        self._written = self._read = self._fill = 0
        try:
            stream = sd.RawInputStream(
                samplerate=SAMPLE_RATE_HZ,
                blocksize=self.frame_samples,
                device=device.index,
                channels=1,
                dtype="int16",
                latency="low",
                callback=self._callback,
            )
            stream.start()
        except (sd.PortAudioError, ValueError) as exc:
            raise AudioDeviceError(f"cannot open input device {device.name!r} at 16 kHz mono: {exc}") from exc
        self._stream = stream
        self.device = device
        self._latency_s = float(stream.latency)
        log.info(
            "microphone_opened",
            device=device.name,
            index=device.index,
            frame_ms=self.frame_ms,
            input_latency_ms=round(1000.0 * self._latency_s, 1),
        )

    def close_blocking(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.abort(ignore_errors=True)
            finally:
                stream.close(ignore_errors=True)

    def _callback(self, indata: Any, frames: int, time_info: Any, status: Any) -> None:
        now = time.monotonic()
        if status.input_overflow:
            self.overflows += 1
        pcm = np.frombuffer(indata, dtype=np.int16)
        adc = time_info.inputBufferAdcTime
        # Monotonic time of the first sample in this buffer.
        captured = now - (time_info.currentTime - adc if adc > 0.0 else self._latency_s) - frames / SAMPLE_RATE_HZ
        size = self.frame_samples
        done = 0
        while done < frames:
            slot = self._written % self.capacity
            n = min(size - self._fill, frames - done)
            np.copyto(self._frames[slot, self._fill : self._fill + n], pcm[done : done + n])
            if self._fill == 0:
                self._stamps[slot] = captured + done / SAMPLE_RATE_HZ
            self._fill += n
            done += n
            if self._fill == size:
                self._fill = 0
                self._written += 1

    def drain(self) -> list[tuple[bytes, float]]:
        """Every complete frame not read yet, oldest first: (int16 bytes, monotonic capture time)."""
        written = self._written
        keep = self.capacity - 1  # the slot being filled is never read
        if written - self._read > keep:
            self.dropped += written - self._read - keep
            self._read = written - keep
        out: list[tuple[bytes, float]] = []
        for index in range(self._read, written):
            slot = index % self.capacity
            frame = self._frames[slot].tobytes()
            stamp = float(self._stamps[slot])
            if self._written - index > keep:  # overwritten while we copied it
                self.dropped += 1
                continue
            out.append((frame, stamp))
        self._read = written
        return out
