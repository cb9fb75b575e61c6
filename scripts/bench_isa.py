"""The native kernels' instruction-set paths side by side: ``tts.torch.isa: avx2`` (what an Intel
N100-class mini PC runs) beside the widest path this CPU has, per weight format, in one process.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_isa.py /tmp/cv06 [--formats int8,int4] [--paths avx2,auto] [--threads 2]

One engine per (format, path); rounds alternate the paths. The figure is bench_steady.py's: a long
utterance's frames after its first chunk (4-frame chunks, codec included) over the time they took;
beside it the time to a one-frame first chunk (the prompt kept between rounds). Real time is 80 ms
a frame. The goal for an AVX2-only CPU: int4 at real time (80 ms a frame or less) and int8 within
1.25x of int4 (printed after the table). The engines of one format share the prepared weights (one
file, mapped), so two paths cost little more memory than one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio

REAL_TIME_MS = 80.0
"""One codec frame of audio."""
INT8_OVER_INT4 = 1.25
"""The goal's bound on int8's time a frame over int4's on the same path."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 0.6B CustomVoice from make_checkpoint)")
    parser.add_argument("--formats", default="int8,int4", help="none, int8, int4, comma-separated")
    parser.add_argument("--paths", default="avx2,auto", help="tts.torch.isa values, comma-separated")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    add_doc_arguments(parser, "isa")
    args = parser.parse_args()
    doc = doc_target(args)

    from s2s_daemon.tts.threads import prepare_openmp

    prepare_openmp()  # the daemon's OpenMP wait, before torch is imported

    from s2s_daemon.bench.torch_cpu import SENTENCE, cpu_engine, timed_utterance
    from s2s_daemon.tts.engine import SynthesisRequest
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        print(f"no native kernels here: {native.why_not_here()}")
        return 1
    paths = args.paths.split(",")
    print(
        machine_line(
            f"{args.threads} threads",
            f"{args.frames} frames",
            f"{args.rounds} rounds",
            f"library paths {' '.join(native.carried_paths())}",
        )
    )
    request = SynthesisRequest(
        text=SENTENCE,
        voice=None,
        language="english",
        greedy=True,
        chunk_frames=4,
    )
    rows: list[list[object]] = []
    medians: dict[tuple[str, str], float] = {}
    for fmt in args.formats.split(","):
        engines = {path: cpu_engine(args.model, fmt, args.threads, path, max_frames=str(args.frames)) for path in paths}
        steady: dict[str, list[float]] = {path: [] for path in paths}
        first: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path, engine in engines.items():
                assert engine.info is not None
                voice = engine.info.voices[0] if engine.info.voices else None
                timed = timed_utterance(engine, replace(request, voice=voice))
                if timed is not None:
                    first[path].append(timed[0])
                    steady[path].append(timed[1])
        best = min(statistics.median(v) for v in steady.values())
        for path, engine in engines.items():
            assert engine.info is not None
            ran, why = engine.info.isa.split(" ", 1) if engine.info.isa else ("torch", "")
            ms = statistics.median(steady[path])
            medians[fmt, ran] = ms
            print(
                f"{fmt} {ran:>8} ({path}): {ms:6.1f} ms a frame past the first chunk"
                f" (range {min(steady[path]):.1f}-{max(steady[path]):.1f}), first chunk"
                f" {statistics.median(first[path]):.0f} ms; {why}"
            )
            rows.append(
                [
                    fmt,
                    ran,
                    f"{ms:.1f}",
                    f"{min(steady[path]):.1f}-{max(steady[path]):.1f}",
                    ratio(ms, REAL_TIME_MS),
                    ratio(ms, best),
                    f"{statistics.median(first[path]):.0f}",
                ]
            )
        for engine in engines.values():
            engine.close_blocking()
    verdict = goal(medians)
    print(verdict)
    if doc is not None:
        doc.publish(
            "The native kernels' paths: AVX2 beside the widest",
            markdown_table(
                [
                    "weights",
                    "path",
                    "ms a frame (median)",
                    "range",
                    "/ real time (80 ms)",
                    "/ fastest",
                    "first chunk ms",
                ],
                rows,
                "llrrrrr",
            ),
            f"Model `{args.model}`, {args.threads} threads, {args.frames} frames an utterance in 4-frame chunks,"
            f" {args.rounds} rounds alternating the paths (tts.torch.isa {', '.join(paths)}), greedy, the daemon's"
            " OpenMP wait and other defaults (codec_overlap, codec_dtype); the frames after the first chunk over"
            f" the time they took, codec included; the first chunk is one frame, the prompt kept. {verdict}",
        )
    return 0


def goal(medians: dict[tuple[str, str], float]) -> str:
    """The AVX2 goal, met or not, from the medians by (format, path)."""
    int4, int8 = medians.get(("int4", "avx2")), medians.get(("int8", "avx2"))
    if int4 is None or int8 is None:
        return "Goal (int4 and int8 on avx2) not measured in this run."
    met = int4 <= REAL_TIME_MS and int8 <= INT8_OVER_INT4 * int4
    return (
        f"Goal on avx2: int4 {int4:.1f} ms a frame (at most {REAL_TIME_MS:.0f}), int8 {int8 / int4:.2f}x int4's"
        f" (at most {INT8_OVER_INT4:.2f}x): {'met' if met else 'not met'}."
    )


if __name__ == "__main__":
    raise SystemExit(main())
