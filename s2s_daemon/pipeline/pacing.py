"""Gapless on slow hardware: when the engine makes audio slower than it plays, the speaker waits
before its first sample until the rest of the utterance will arrive in time.

With the engine making ``r`` seconds of audio per second (``r < 1``) and an utterance of ``T``
seconds, playback that starts with ``B`` seconds buffered never runs dry when ``B >= T (1 - r)``:
the buffer shrinks by ``1 - r`` per second played, for the ``(T - B) / r`` seconds synthesis
still takes. ``r`` is learned from the utterances synthesized so far (and, before there is one,
from the current utterance's chunks after its first); ``T`` from the text's length and the
seconds of audio per character learned the same way. An engine faster than real time keeps
the short start.

The wait is bounded (``Pacer.max_wait_s``, ``audio.prebuffer_max_s``): past it the speaker plays
what it has. So that the pauses a slow engine makes unavoidable fall between clauses rather than
inside words, the TTS stage then speaks each sentence clause by clause (``segment.split_clauses``)
and holds each later clause until it will play through. Only a sink heard as it plays (the
speaker) waits at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from s2s_daemon.pipeline.jobs import Timeline

REAL_TIME = 1.05
"""At or above this rate (audio seconds per second) nothing is waited for."""
SAFETY = 1.15
"""The buffer asked for is this much more than the formula's (rate and length are estimates)."""
SECONDS_PER_CHAR = 0.075
"""Audio per character before anything was learned (English at a natural pace)."""
LEARNING = 0.3
"""Weight of the newest utterance in the running estimates."""
MAX_WAIT_S = 0.8
"""``audio.prebuffer_max_s``'s default: with the speaker's own buffer and output latency after it, a
short sentence is heard within about a second of its request (``scripts/bench_shipped.py``
measures it); later clauses and sentences wait instead."""


@dataclass(slots=True)
class Pacer:
    rate: float | None = None
    """Audio seconds the engine makes per second of synthesis (prefill included)."""
    seconds_per_char: float = SECONDS_PER_CHAR
    enabled: bool = True
    """``audio.gapless`` on a real-time speaker: off (or a sink that is not heard as it plays),
    nothing is ever waited for."""
    max_wait_s: float = MAX_WAIT_S
    """``audio.prebuffer_max_s``: the longest a first sample is held, from the utterance's turn on the speaker."""

    def learn(self, timeline: Timeline, chars: int) -> None:
        """From an utterance synthesized to its end."""
        if timeline.synth_started is None or timeline.synth_done is None or timeline.audio_s <= 0:
            return
        took = timeline.synth_done - timeline.synth_started
        if took > 0:
            rate = timeline.audio_s / took
            self.rate = rate if self.rate is None else (1 - LEARNING) * self.rate + LEARNING * rate
        if chars > 0:
            per_char = timeline.audio_s / chars
            self.seconds_per_char = (1 - LEARNING) * self.seconds_per_char + LEARNING * per_char

    def needed_s(self, rate: float, chars: int) -> float:
        """Seconds to buffer before the first sample so that the utterance never runs dry."""
        if not self.enabled or rate >= REAL_TIME:
            return 0.0
        expected = chars * self.seconds_per_char
        return expected * (1.0 - max(rate, 0.0)) * SAFETY
