"""glibc's trim threshold while the torch engine runs: 128 KiB (glibc's own, what a fixed mmap
threshold left before) beside 32 MiB (what ``memory.loading`` sets now), rounds alternating in one
process on one engine: steady milliseconds a frame with audio past the first chunk, the codec
decoder's milliseconds a frame in its pushes, and minor page faults a frame.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_trim.py ./cv06 [--format int4] [--frames 64] [--rounds 5] [--threads 2]

With the low threshold each free that leaves more than 128 KiB at the top of a heap (the main
one, and the arena of each thread: the engine's, the codec's) gives those pages back to the
system, and the next step's temporaries fault them in again. Linux with glibc only (``mallopt``);
the daemon's defaults otherwise (its OpenMP wait is not set here: torch is imported first).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table

SETTINGS = {"128 KiB": 128 << 10, "32 MiB": 32 << 20}
"""Trim thresholds compared, the first as before."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 0.6B CustomVoice from make_checkpoint)")
    parser.add_argument("--format", default="int4", help="none, int8 or int4")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=5)
    add_doc_arguments(parser, "trim")
    args = parser.parse_args()
    doc = doc_target(args)
    from s2s_daemon.tts.torch_qwen3 import memory

    libc = memory._libc()
    if libc is None:
        print("needs Linux with glibc (mallopt)")
        return 1

    from s2s_daemon.bench.torch_cpu import cpu_engine, sentence_request, timed_utterance
    from s2s_daemon.tts.torch_qwen3 import codec as codec_mod

    pushes: list[float] = []
    push = codec_mod.StreamingDecodeState.push

    def timed_push(self: Any, codes: Any) -> Any:
        started = time.perf_counter()
        out = push(self, codes)
        pushes.append((time.perf_counter() - started) * 1000 / max(1, codes.shape[0]))
        return out

    codec_mod.StreamingDecodeState.push = timed_push  # type: ignore[method-assign]
    engine = cpu_engine(args.model, args.format, args.threads, max_frames=str(args.frames))
    request = replace(sentence_request(engine), chunk_frames=4)
    print(machine_line(f"{args.threads} threads", args.format, f"{args.frames} frames", f"{args.rounds} rounds"))
    steady: dict[str, list[float]] = {name: [] for name in SETTINGS}
    codec: dict[str, list[float]] = {name: [] for name in SETTINGS}
    faults: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for number in range(args.rounds):
        for name, threshold in SETTINGS.items():
            libc.mallopt(memory.M_TRIM_THRESHOLD, threshold)
            pushes.clear()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            timed = timed_utterance(engine, request)
            if timed is None:
                print("no frame after the first chunk: raise --frames")
                return 1
            steady[name].append(timed[1])
            codec[name].append(statistics.median(pushes))
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / args.frames)
            print(
                f"round {number + 1}, trim {name:>7}: {timed[1]:6.1f} ms a frame past the first chunk, codec"
                f" {codec[name][-1]:5.1f} ms a frame, {faults[name][-1]:5.0f} minor faults a frame",
                flush=True,
            )
    first = next(iter(SETTINGS))
    rows = []
    for name in SETTINGS:
        ratios = [b / a for a, b in zip(steady[first], steady[name], strict=True)]
        row = [
            name,
            f"{statistics.median(steady[name]):.1f}",
            f"{min(steady[name]):.1f}-{max(steady[name]):.1f}",
            "-" if name == first else f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            f"{statistics.median(codec[name]):.1f}",
            f"{statistics.median(faults[name]):,.0f}",
        ]
        print(" | ".join(row))
        rows.append(row)
    if doc is not None:
        header = ["trim threshold", "ms a frame (median)", "range", f"/ {first} round by round",
                  "codec ms a frame", "minor faults a frame"]  # fmt: skip
        doc.publish(
            "glibc's trim threshold while the engine runs",
            markdown_table(header, rows, "lrrrrr"),
            f"Weights {args.format}, {args.threads} threads, one engine, {args.frames} frames an utterance in"
            f" 4-frame chunks, {args.rounds} rounds alternating the thresholds (`mallopt`), greedy; the frames"
            " after the first chunk over the time they took, codec included (on its own thread); codec: the"
            " median push's milliseconds a frame. 128 KiB: glibc's own, before; 32 MiB: what the engine sets"
            " once loaded (`memory.loading`).",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
