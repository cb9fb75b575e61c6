"""Time-stretch that keeps the pitch, one chunk at a time: the speech API's ``speed``.

Rubber Band's real-time stretcher (its R3 "finer" engine) through pylibrb, the ``speed`` extra:
it takes the chunks as the engine makes them and hands back what it can so far, so a stretched
response streams like any other. Rubber Band is what the offline tools use too (pyrubberband,
pedalboard), but they take a whole buffer; stretching chunk by chunk through them clicks at every
chunk. The start is padded and its delay trimmed as Rubber Band asks, and the output is cut to
``input / speed`` at the end, so the duration scales exactly. Its cost per second of audio:
``scripts/bench_stretch.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import numpy as np

from s2s_daemon.pipeline.vocabulary import Samples

SPEED_RANGE = (0.25, 4.0)
"""OpenAI's range for ``speed``."""
UNSTRETCHED = 1e-6
"""A speed this close to 1.0 is played as made."""
BLOCK = 2048
"""Samples per call into the stretcher (its declared largest block)."""
EXTRA = "speed"


class StretchUnavailableError(Exception):
    """The ``speed`` extra is not installed."""


def stretch_available() -> bool:
    return importlib.util.find_spec("pylibrb") is not None


def require_stretch() -> None:
    if not stretch_available():
        raise StretchUnavailableError(
            f"a speed other than 1.0 needs the {EXTRA} extra (Rubber Band through pylibrb):"
            f" pip install 's2s-daemon[{EXTRA}]'"
        )


def needs_stretch(speed: float) -> bool:
    return abs(speed - 1.0) > UNSTRETCHED


class TimeStretcher:
    """One utterance: ``process`` each chunk as it comes, then ``finish`` once. Blocking calls
    (milliseconds per chunk): run them off the event loop, one at a time."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        import pylibrb

        low, high = SPEED_RANGE
        if not low <= speed <= high:
            raise ValueError(f"speed {speed} is outside {low}..{high}")
        self.speed = speed
        options = pylibrb.Option.PROCESS_REALTIME | pylibrb.Option.ENGINE_FINER
        self._rb: Any = pylibrb.RubberBandStretcher(
            sample_rate=sample_rate, channels=1, options=options, initial_time_ratio=1.0 / speed
        )
        self._rb.set_max_process_size(BLOCK)
        self._trim = int(self._rb.get_start_delay())
        """Output samples still to drop: the stretcher's delay after the padding."""
        self._fed = 0
        self._sent = 0
        self._held: Samples = np.zeros(0, np.float32)
        pad = int(self._rb.get_preferred_start_pad())
        if pad:
            self._rb.process(np.zeros((1, pad), np.float32))

    def process(self, samples: Samples) -> Samples:
        """What can be handed on after ``samples`` (maybe nothing yet)."""
        data = np.ascontiguousarray(samples, dtype=np.float32)
        out = []
        for start in range(0, len(data), BLOCK):
            self._rb.process(data[None, start : start + BLOCK])
            out.append(self._take())
        self._fed += len(data)
        return self._limit(out, final=False)

    def finish(self) -> Samples:
        """The rest, cut so that the whole is ``input / speed`` long."""
        self._rb.process(np.zeros((1, 0), np.float32), final=True)
        out = []
        while not self._rb.is_done():
            got = self._take()
            if not len(got) and not self._rb.available():
                break
            out.append(got)
        return self._limit(out, final=True)

    def _take(self) -> Samples:
        got: Samples = self._rb.retrieve_available()[0]
        if self._trim:
            dropped = min(self._trim, len(got))
            self._trim -= dropped
            got = got[dropped:]
        return got

    def _limit(self, pieces: list[Samples], final: bool) -> Samples:
        """Never more than ``input / speed`` so far: what runs ahead waits for more input, and at
        the end what runs over is dropped (the stretcher's tail is a little long)."""
        out = np.concatenate([self._held, *pieces]).astype(np.float32, copy=False)
        allowed = round(self._fed / self.speed) if final else int(self._fed / self.speed)
        room = max(0, allowed - self._sent)
        out, self._held = out[:room], out[room:] if not final else out[:0]
        self._sent += len(out)
        return out


class ThreadedStretcher:
    """A ``TimeStretcher`` driven from the event loop: made on first use, every call on a worker
    thread, one at a time (the caller awaits each)."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        self.speed = speed
        self.sample_rate = sample_rate
        self._stretcher: TimeStretcher | None = None

    def _get(self) -> TimeStretcher:
        if self._stretcher is None:
            self._stretcher = TimeStretcher(self.speed, self.sample_rate)
        return self._stretcher

    async def process(self, samples: Samples) -> Samples:
        return await asyncio.to_thread(lambda: self._get().process(samples))

    async def finish(self) -> Samples:
        return await asyncio.to_thread(lambda: self._get().finish())
