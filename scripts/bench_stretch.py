"""The cost of the speech API's ``speed``: ``TimeStretcher`` (Rubber Band, real time, R3 engine)
fed chunk by chunk as the engine hands them on, per speed.

    .venv/bin/python scripts/bench_stretch.py [--seconds 10] [--chunk-ms 320] [--rounds 5] [--wav FILE]

The input is a 24 kHz voice-like signal (harmonics of a gliding 120-220 Hz fundamental, noise
between "syllables"), or a mono WAV at 24 kHz. Prints, per speed, milliseconds of one core per
second of input audio (median of rounds; the stretcher made afresh each round, its creation
included) and the first chunk's own cost (a response's first bytes wait for it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RATE = 24_000
SPEEDS = (0.25, 0.5, 0.75, 1.25, 1.5, 2.0, 4.0)


def voice_like(seconds: float) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(0)
    t = np.arange(round(seconds * RATE)) / RATE
    f0 = 170 + 50 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllables = (np.sin(2 * np.pi * 4 * t) > -0.3).astype(np.float64)
    signal = 0.2 * voiced * syllables + 0.02 * rng.standard_normal(len(t)) * (1 - syllables)
    return signal.astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of input audio per round")
    parser.add_argument("--chunk-ms", type=float, default=320.0, help="the engine's chunk (tts.chunk_frames 4)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wav", type=Path, help="a mono 24 kHz WAV instead of the synthetic signal")
    from s2s_daemon.bench.machine import machine_line
    from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table

    add_doc_arguments(parser, "stretch")
    args = parser.parse_args()
    doc = doc_target(args)

    from s2s_daemon.pipeline.stretch import TimeStretcher

    if args.wav is not None:
        import soundfile

        audio, rate = soundfile.read(args.wav, dtype="float32")
        if rate != RATE or audio.ndim != 1:
            parser.error(f"{args.wav}: need mono {RATE} Hz, got {rate} Hz, shape {audio.shape}")
        source = f"{args.wav.name}, {len(audio) / RATE:.1f} s"
    else:
        audio = voice_like(args.seconds)
        source = f"voice-like signal, {args.seconds:g} s"
    chunk = round(args.chunk_ms * RATE / 1000)
    seconds = len(audio) / RATE
    print(machine_line(f"{source}, chunks of {args.chunk_ms:g} ms, {args.rounds} rounds, one thread"))
    print(f"{'speed':>6} {'ms per s of audio':>18} {'x real time':>12} {'first chunk ms':>15}")
    rows: list[list[object]] = []
    for speed in SPEEDS:
        per_second, first = [], []
        for _ in range(args.rounds):
            start = time.thread_time()
            stretcher = TimeStretcher(speed, RATE)
            for i in range(0, len(audio), chunk):
                stretcher.process(audio[i : i + chunk])
                if i == 0:
                    first.append((time.thread_time() - start) * 1000)
            stretcher.finish()
            per_second.append((time.thread_time() - start) * 1000 / seconds)
        cost = statistics.median(per_second)
        print(f"{speed:>6g} {cost:>18.1f} {1000 / cost:>12.0f} {statistics.median(first):>15.1f}")
        rows.append([f"{speed:g}", f"{cost:.1f}", f"{1000 / cost:.0f}", f"{statistics.median(first):.1f}"])
    if doc is not None:
        header = ["speed", "CPU ms per s of audio", "x real time", "first chunk ms"]
        notes = f"{source}, chunks of {args.chunk_ms:g} ms, median of {args.rounds} rounds, one thread (CPU time)."
        doc.publish("speed: the time-stretch's cost", markdown_table(header, rows, "rrrr"), notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
