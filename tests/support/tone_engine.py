"""A deterministic test engine: a tone whose length follows the text, streamed in chunks.

Never reachable from a shipped config: only processes that call ``register()`` know it.
Options (``tts.options``): ``speed`` = multiple of real time (0 = as fast as possible),
``ms_per_char`` = audio per character, ``load_s`` = simulated load time, ``load_gate`` = a file
whose existence ends the load (a test holds the daemon in its loading phase as long as it likes),
``record`` = a file to which each text it is asked to synthesize is appended, one JSON line each
(``recorded(path)`` reads them: what the daemon spoke, after its text stage).
A text containing ``#fail`` raises inside synthesis (an engine error). Hangs, after the first
chunk: ``#stall=S`` sleeps S seconds (ignoring ``should_stop`` meanwhile, as a stuck device would),
then goes on; ``#hang`` blocks until ``HANG_RELEASE`` is set (in a subprocess: never, a wedged
engine thread). A runaway, as a model that misses its end of speech (``tts/runaway.py``), after the
text's own audio and until stopped (at most ``RUNAWAY_FRAMES``): ``#runaway-loop`` the same
0.6 s said over and over, ``#runaway-silence`` silence, ``#runaway`` the tone on and on.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from s2s_daemon.tts.engine import (
    DeviceMemory,
    EngineError,
    EngineInfo,
    EngineOptions,
    Samples,
    ShouldStop,
    SynthesisRequest,
)
from s2s_daemon.tts.registry import register_engine

SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1920
"""One 12.5 Hz codec frame."""
HANG_RELEASE = threading.Event()
"""Ends every ``#hang`` (in-process tests set it when they are done)."""
_STALL = re.compile(r"#stall=([0-9]+(?:\.[0-9]+)?)")
"""``#stall=2.5`` (the text stage may end the text with a full stop after it: not part of it)."""
RUNAWAY_FRAMES = 3000
"""Four minutes: a runaway the daemon failed to cut still ends."""
LOOP_LEVELS = np.array([0.5, 0.3, 0.05, 0.4, 0.1, 0.02, 0.45, 0.2, 0.03, 0.35] * 3, np.float32)
"""A speech-like loudness per 20 ms, 0.6 s long: what ``#runaway-loop`` repeats."""


def runaway(kind: str, first_frame: int, frames: int) -> Samples:
    """Frames ``first_frame`` .. ``+frames`` of a runaway of ``kind`` (loop, silence, tone)."""
    if kind == "silence":
        return np.zeros(frames * FRAME_SAMPLES, np.float32)
    chunk = tone(440.0, first_frame, frames)
    if kind != "loop":
        return chunk
    window = FRAME_SAMPLES // 4  # 20 ms
    start = first_frame * 4
    levels = LOOP_LEVELS[(start + np.arange(frames * 4)) % len(LOOP_LEVELS)]
    return (chunk * np.repeat(levels / 0.3, window)).astype(np.float32)


@functools.lru_cache(maxsize=256)
def tone(freq: float, first_frame: int, frames: int) -> Samples:
    """Frames ``first_frame`` .. ``+frames`` of a sine; cached so that at full speed the
    engine costs next to nothing and benchmarks measure the daemon, not ``np.sin``."""
    t = (np.arange(frames * FRAME_SAMPLES) + first_frame * FRAME_SAMPLES) / SAMPLE_RATE
    chunk = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    chunk.flags.writeable = False
    return chunk


class ToneEngine:
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.speed = float(options.extra.get("speed", "0"))
        self.ms_per_char = float(options.extra.get("ms_per_char", "40"))
        self.load_s = float(options.extra.get("load_s", "0"))
        gate = options.extra.get("load_gate")
        self.load_gate = Path(gate) if gate else None
        record = options.extra.get("record")
        self.record = Path(record) if record else None

    def load_blocking(self) -> EngineInfo:
        time.sleep(self.load_s)  # the engine's simulated load time (option load_s)
        while self.load_gate is not None and not self.load_gate.exists():  # held until a test makes it
            time.sleep(0.02)  # a poll of that condition, for as long as the test wants
        return EngineInfo(
            engine="tone",
            model=self.options.model,
            device="cpu",
            sample_rate=SAMPLE_RATE,
            voices=("Ryan", "Vivian"),
            languages=("auto", "english", "chinese", "german"),
            dtype="float32",
        )

    def warmup_blocking(self) -> None:
        return None

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[Samples]:
        if self.record is not None:
            line = {"text": request.text, "voice": request.voice, "language": request.language}
            with self.record.open("a", encoding="utf-8") as out:
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
        if "#fail" in request.text:
            raise EngineError("tone engine asked to fail")
        total_frames = max(1, round(len(request.text) * self.ms_per_char / 80.0))
        kind = next((k for k in ("loop", "silence") if f"#runaway-{k}" in request.text), None)
        kind = kind or ("tone" if "#runaway" in request.text else None)
        said = total_frames
        if kind is not None:
            total_frames = RUNAWAY_FRAMES
        freq = 440.0 if request.voice != "Vivian" else 660.0
        chunk_frames = request.chunk_frames
        stall = _STALL.search(request.text)
        hang_s = float(stall.group(1)) if stall else (None if "#hang" in request.text else 0.0)
        start = time.monotonic()
        frame = 0
        while frame < total_frames:
            if frame and hang_s != 0.0:  # after the first chunk: mid-utterance
                if hang_s is None:
                    HANG_RELEASE.wait()
                else:
                    time.sleep(hang_s)  # the simulated stall (#stall=S in the text)
                hang_s = 0.0
                start = time.monotonic() - frame * 0.08 / self.speed if self.speed > 0 else start
            if should_stop():
                return
            n = min(chunk_frames, total_frames - frame)
            chunk = tone(freq, frame, n) if frame + n <= said or kind is None else runaway(str(kind), frame, n)
            frame += n
            if self.speed > 0:
                due = start + frame * 0.08 / self.speed
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # the simulated synthesis pace (option speed)
            yield chunk

    def memory_blocking(self) -> DeviceMemory:
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        return None


def recorded(path: Path) -> list[str]:
    """The texts a tone engine with ``record: <path>`` was asked to synthesize, in order."""
    if not path.exists():
        return []
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line]


def register() -> None:
    register_engine("tone", ToneEngine)
