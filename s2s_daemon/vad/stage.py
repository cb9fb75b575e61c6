"""The VAD stage: microphone frames -> speech detector -> ``on_event`` on the event loop.

``open`` finds and opens the input device (``UnavailableError``, exit 69, when there is
none); ``run`` is the long-lived task ``s2s.vad``: every frame period it drains the
capture ring, feeds the detector and calls ``on_event`` for each start/stop. A device
that stops delivering is reopened with an exponential backoff; the stage never crashes
the daemon for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from s2s_daemon.audio.sink import AudioDeviceError
from s2s_daemon.config import VadConfig
from s2s_daemon.errors import UnavailableError
from s2s_daemon.vad.capture import MicrophoneCapture
from s2s_daemon.vad.detector import SpeechDetector, VadEvent

__all__ = ["VadEvent", "VadStage"]

log = structlog.get_logger(__name__)

STALL_S = 2.0
"""No frame for this long, with the stream supposedly running, means the device is gone."""
STARTUP_S = 5.0
"""The same before the first frame: some hosts (ALSA's pulse plugin) take a second to start."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class VadStage:
    """Publishes speech started/stopped from the microphone: an intake (``intake/door.py``) that
    admits no request, only the barge-in that stops what plays."""

    name = "vad"
    origins: frozenset[str] = frozenset()

    def __init__(self, config: VadConfig, on_event: Callable[[VadEvent], None]) -> None:
        self.config = config
        self.on_event = on_event
        self.capture = MicrophoneCapture(config.device, config.frame_ms)
        self.detector = SpeechDetector(config.aggressiveness, config.frame_ms, config.start_ms, config.stop_ms)
        self.frames = 0
        """Frames fed to the detector."""
        self._closing = False

    @property
    def speaking(self) -> bool:
        """Whether speech is going on now (between a start and its stop)."""
        return self.detector.speaking

    @property
    def dropped(self) -> int:
        """Frames dropped because the stage fell behind the microphone."""
        return self.capture.dropped

    async def open(self) -> None:
        try:
            await asyncio.to_thread(self.capture.open_blocking)
        except AudioDeviceError as exc:
            raise UnavailableError(f"vad.enabled is true but no microphone is usable: {exc}") from exc

    def drain(self) -> None:
        """Nothing to stop: a barge-in still stops what plays while the daemon drains."""

    async def close(self) -> None:
        """Release the microphone; ``run`` returns at its next frame period."""
        self._closing = True
        await asyncio.to_thread(self.capture.close_blocking)

    async def run(self) -> None:
        period_s = self.config.frame_ms / 1000.0
        last_frame_at = time.monotonic()
        backoff_s = 0.0
        started = False
        while not self._closing:
            await asyncio.sleep(period_s)
            if self._closing:
                return
            frames = self.capture.drain()
            now = time.monotonic()
            if frames:
                last_frame_at = now
                backoff_s = 0.0
                started = True
            for frame, at in frames:
                self.frames += 1
                event = self.detector.feed(frame, at)
                if event is not None:
                    log.debug("vad_event", speaking=event.speaking, signal_ms=event.signal_ms)
                    self.on_event(event)
            if self.capture.active and now - last_frame_at < (STALL_S if started else STARTUP_S):
                continue
            # The input stopped: end any speech in progress, then reopen with backoff.
            log.warning("microphone_lost", device=self.capture.device.name if self.capture.device else None)
            if self.detector.speaking:
                self.on_event(VadEvent(False, now, 0.0))
            self.detector.reset()
            await asyncio.to_thread(self.capture.close_blocking)
            while not self._closing:
                backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2.0 * backoff_s))
                await asyncio.sleep(backoff_s)
                if self._closing:
                    return
                try:
                    await asyncio.to_thread(self.capture.open_blocking)
                except AudioDeviceError as exc:
                    log.warning("microphone_reopen_failed", error=str(exc), retry_in_s=backoff_s)
                    continue
                break
            last_frame_at = time.monotonic()
            started = False
