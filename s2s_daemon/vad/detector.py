"""Speech start/stop decisions over webrtcvad frame flags, with hysteresis. Pure: no I/O, no clock.

webrtcvad's noise model needs about 100 ms of signal to settle: the first frames after
it starts are flagged voiced whatever they hold. After digital silence (a muted or idle
source) it is worse: a model that saw the step from silence into steady noise may flag
that noise as speech for seconds. So after ``RESTART_SILENT_MS`` of digital silence the
detector skips the frame that holds the step and restarts webrtcvad on the next one,
and frames within ``SETTLE_MS`` of a (re)start may extend a voiced run but never
complete one on their own.

webrtcvad also keeps flagging frames voiced for a hangover of up to 90-140 ms after
speech ends in noise. When speech stops, the detector moves the silence onset back
over the trailing voiced frames whose energy is already at the level of the silence
that followed (at most the hangover of the chosen aggressiveness).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE_HZ = 16_000
SETTLE_MS = 150.0
"""Signal after a (re)start of webrtcvad that cannot, by itself, start speech."""
RESTART_SILENT_MS = 10.0
"""Digital silence after which webrtcvad is restarted."""
SILENT_PEAK = 2
HANGOVER_FRAMES = {
    0: {10: 14, 20: 7, 30: 5},
    1: {10: 14, 20: 7, 30: 5},
    2: {10: 9, 20: 5, 30: 3},
    3: {10: 9, 20: 5, 30: 3},
}
"""webrtcvad's longest hangover (frames) by aggressiveness and frame length."""
NOISE_MARGIN_DB = 3.0
"""A trailing voiced frame within this many dB of the following silence counts as silence."""
"""A frame whose samples all lie within +-SILENT_PEAK (int16) is digital silence."""


@dataclass(frozen=True, slots=True)
class VadEvent:
    """Speech started (``speaking``) or stopped.

    ``at`` is when the triggering run began: the first voiced frame for a start, the
    first silent frame for a stop. The decision itself came ``signal_ms`` later.
    """

    speaking: bool
    at: float
    """Monotonic seconds (the caller's clock) at which the speech or silence began."""
    signal_ms: float
    """Milliseconds of speech (start) or silence (stop) that triggered the event."""


class SpeechDetector:
    """Feeds 10, 20 or 30 ms int16 mono 16 kHz frames to webrtcvad and decides start/stop."""

    def __init__(self, aggressiveness: int, frame_ms: int, start_ms: float, stop_ms: float) -> None:
        if frame_ms not in (10, 20, 30):
            raise ValueError("frame_ms must be 10, 20 or 30")
        if not 0 <= aggressiveness <= 3:
            raise ValueError("aggressiveness must be 0..3")
        self.aggressiveness = aggressiveness
        self.frame_ms = frame_ms
        self.frame_bytes = SAMPLE_RATE_HZ * frame_ms // 1000 * 2
        self.start_frames = max(1, round(start_ms / frame_ms))
        self.stop_frames = max(1, round(stop_ms / frame_ms))
        self.settle_frames = int(np.ceil(SETTLE_MS / frame_ms))
        self.restart_frames = int(np.ceil(RESTART_SILENT_MS / frame_ms))
        self._vad = self._new_vad()
        self.speaking = False
        self._since_start = 0
        """Signal frames since webrtcvad (re)started."""
        self._silent_run = 0
        """Consecutive digitally silent frames."""
        self._run = 0
        """Consecutive frames supporting a change (voiced while idle, unvoiced while speaking)."""
        self._run_counted = 0
        """Of those, frames that may complete a start (past the settling window)."""
        self._run_at = 0.0
        self._speech_at = 0.0
        """Where the current speech began."""
        self._hangover = HANGOVER_FRAMES[aggressiveness][frame_ms]
        self._recent: collections.deque[tuple[float, float, bool]] = collections.deque(
            maxlen=self.stop_frames + self._hangover + 1
        )
        """(frame start, energy dB, voiced) of the latest frames, for the hangover trim."""

    def _new_vad(self) -> object:
        import webrtcvad

        return webrtcvad.Vad(self.aggressiveness)

    def reset(self) -> None:
        """Forget everything: a fresh webrtcvad and no speech."""
        self._vad = self._new_vad()
        self.speaking = False
        self._since_start = 0
        self._silent_run = 0
        self._run = 0
        self._run_counted = 0
        self._recent.clear()

    def feed(self, frame: bytes, at: float) -> VadEvent | None:
        """One frame that began at ``at`` (seconds); an event when speech starts or stops."""
        if len(frame) != self.frame_bytes:
            raise ValueError(f"frame must be {self.frame_bytes} bytes, got {len(frame)}")
        pcm = np.frombuffer(frame, dtype="<i2")
        wide = pcm.astype(np.int32)
        silent = int(np.abs(wide).max()) <= SILENT_PEAK
        energy_db = 10.0 * float(np.log10(float(np.mean(wide * wide)) + 1.0))
        if silent or self._silent_run >= self.restart_frames:
            # Digital silence, or the first frame after a long one: that frame holds the
            # step from silence into signal, which webrtcvad mistakes for speech for
            # seconds. Restart webrtcvad so its first frame is wholly signal.
            if silent:
                self._silent_run += 1
            else:
                self._silent_run = 0
            if self._silent_run == self.restart_frames or not silent:
                self._vad = self._new_vad()
                self._since_start = 0
            voiced = False
            settling = False
        else:
            self._silent_run = 0
            settling = self._since_start < self.settle_frames
            self._since_start += 1
            voiced = bool(self._vad.is_speech(frame, SAMPLE_RATE_HZ))  # type: ignore[attr-defined]
        self._recent.append((at, energy_db, voiced))
        if voiced != self.speaking:
            if self._run == 0:
                self._run_at = at
            self._run += 1
            if not settling:
                self._run_counted += 1
        else:
            self._run = 0
            self._run_counted = 0
        if not self.speaking and self._run_counted >= self.start_frames:
            return self._flip(True)
        if self.speaking and self._run >= self.stop_frames:
            self._trim_hangover()
            return self._flip(False)
        return None

    def _trim_hangover(self) -> None:
        """Move the silence onset back over trailing voiced frames at the silence's energy."""
        frames = list(self._recent)
        silence = frames[len(frames) - self._run :]
        before = frames[: len(frames) - self._run]
        if not before:
            return
        floor_db = float(np.median([e for _, e, _ in silence]))
        moved = 0
        for at, energy_db, _ in reversed(before):
            if moved >= self._hangover or energy_db > floor_db + NOISE_MARGIN_DB or at <= self._speech_at:
                break
            self._run_at = at
            self._run += 1
            moved += 1

    def _flip(self, speaking: bool) -> VadEvent:
        if speaking:
            self._speech_at = self._run_at
        event = VadEvent(speaking, self._run_at, float(self._run * self.frame_ms))
        self.speaking = speaking
        self._run = 0
        self._run_counted = 0
        return event
