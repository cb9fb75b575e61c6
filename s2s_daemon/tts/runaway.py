"""A runaway utterance cut short: the engine missed its end of speech and makes noise, a loop or
silence until its budget (Qwen3-TTS does so on a few requests in a thousand, with real weights).

``RunawayWatch`` follows one piece of text (a sentence or clause, one engine call) as its audio
comes, engine by engine alike, and says when to cut it:

- ``length``: more audio than the text can take, ``piece_budget_s``: a speaking time per
  character by script (a Latin letter ``LATIN_S``, a CJK character ``CJK_S``, ...), times
  ``MARGIN``, plus ``BASE_S``; a bound on the text itself, not on a tokenizer's count of it;
- ``silence``: ``SILENCE_S`` of audio below ``SILENCE_DBFS``, where speech pauses far less;
- ``loop``: the last ``LOOP_S`` of the loudness envelope (``WINDOW_S`` windows, in dB) repeat
  themselves at a period of ``LOOP_MIN_PERIOD_S`` to ``LOOP_MAX_PERIOD_S`` within
  ``LOOP_TOLERANCE_DB`` on average: the same stretch said over and over (codes that loop make
  audio that loops: the codec decoder is deterministic).

The TTS stage stops the engine there, keeps what came before, goes on with the next piece and
ends the request ``completed`` with ``truncated: runaway`` (docs/engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BASE_S = 1.5
"""Seconds any piece may take beside its characters (its start and end)."""
MARGIN = 2.0
"""How many times the typical speaking time of its characters a piece may take (``tts.runaway_margin``)."""
LATIN_S = 0.075
"""Typical seconds per character of alphabetic text (about 13 a second, spaces and punctuation included)."""
DIGIT_S = 0.3
"""Per digit: ``1995`` is said as four words."""
CJK_S = 0.22
"""Per Chinese or Japanese character (about 4.5 a second)."""
HANGUL_S = 0.15
"""Per Hangul syllable."""
SILENCE_S = 3.0
"""Audio this long below ``SILENCE_DBFS``, inside one piece, is a runaway."""
SILENCE_DBFS = -50.0
WINDOW_S = 0.02
"""The loudness envelope's window."""
LOOP_S = 4.0
LOOP_MIN_PERIOD_S = 0.2
LOOP_MAX_PERIOD_S = 2.0
LOOP_TOLERANCE_DB = 1.5
"""Mean difference, in dB, between the envelope and itself one period earlier, under which it is a loop."""
LOOP_MIN_SPREAD_DB = 3.0
"""A loop is of something said: an envelope that spreads less (a steady tone, a hum) is left to
the length rule."""
FLOOR_DB = -90.0


def piece_budget_s(text: str, margin: float = MARGIN) -> float:
    """Seconds of audio a piece of ``text`` may take (see the module docstring)."""
    typical = 0.0
    for char in text:
        code = ord(char)
        if char.isdigit():
            typical += DIGIT_S
        elif 0x3040 <= code <= 0x30FF or 0x3400 <= code <= 0x9FFF or 0xF900 <= code <= 0xFAFF:
            typical += CJK_S  # kana, CJK ideographs
        elif 0xAC00 <= code <= 0xD7AF:
            typical += HANGUL_S
        else:
            typical += LATIN_S
    return BASE_S + margin * typical


@dataclass(frozen=True, slots=True)
class RunawayCut:
    cause: str
    """``length``, ``silence`` or ``loop``."""
    audio_s: float
    """Seconds of the piece's audio when it was cut."""
    budget_s: float


class RunawayWatch:
    """One piece's audio, chunk by chunk; ``add`` returns the cut once there is one."""

    def __init__(self, text: str, sample_rate: int, margin: float = MARGIN) -> None:
        self.budget_s = piece_budget_s(text, margin)
        self.sample_rate = sample_rate
        self._window = max(1, round(WINDOW_S * sample_rate))
        self._rest = np.zeros(0, np.float32)
        self._envelope: list[float] = []
        self._samples = 0
        self._quiet = 0
        """Windows in a row below ``SILENCE_DBFS`` at the end."""

    @property
    def audio_s(self) -> float:
        return self._samples / self.sample_rate

    def add(self, chunk: np.ndarray) -> RunawayCut | None:
        self._samples += len(chunk)
        audio = np.concatenate([self._rest, np.asarray(chunk, np.float32).reshape(-1)])
        whole = len(audio) // self._window * self._window
        self._rest = audio[whole:]
        if whole:
            frames = audio[:whole].reshape(-1, self._window)
            levels = 10.0 * np.log10(np.maximum(np.mean(frames * frames, axis=1), 1e-9))
            for level in np.maximum(levels, FLOOR_DB).tolist():
                self._envelope.append(level)
                self._quiet = self._quiet + 1 if level < SILENCE_DBFS else 0
        if self.audio_s > self.budget_s:
            return RunawayCut("length", self.audio_s, self.budget_s)
        if self._quiet * WINDOW_S >= SILENCE_S:
            return RunawayCut("silence", self.audio_s, self.budget_s)
        if self._loops():
            return RunawayCut("loop", self.audio_s, self.budget_s)
        return None

    def _loops(self) -> bool:
        span = round(LOOP_S / WINDOW_S)
        longest = round(LOOP_MAX_PERIOD_S / WINDOW_S)
        if len(self._envelope) < span + round(LOOP_MIN_PERIOD_S / WINDOW_S):
            return False
        env = np.asarray(self._envelope[-(span + longest) :], np.float64)
        self._envelope = self._envelope[-(span + longest) :]
        recent = env[-span:]
        if float(np.max(recent)) < SILENCE_DBFS or float(np.std(recent)) < LOOP_MIN_SPREAD_DB:
            return False  # silence is the silence rule's, a steady sound the length rule's
        for period in range(round(LOOP_MIN_PERIOD_S / WINDOW_S), longest + 1):
            if period + span > len(env):
                break
            earlier = env[-span - period : -period]
            if float(np.mean(np.abs(recent - earlier))) < LOOP_TOLERANCE_DB:
                return True
        return False
