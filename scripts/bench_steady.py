"""The torch engine's steady cost per frame with audio, past its first chunk: a long utterance's
frames after the first chunk (prefill and first frame excluded) divided by the time they took,
for two chunk sizes side by side in one process, rounds alternating.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_steady.py ./cv06 [--format int4] [--frames 64] [--chunks 4,16] [--threads 2]

Real time is 80 ms a frame (12.5 frames a second). Random weights never end an utterance early:
``--frames`` caps it (``tts.options.max_frames``). Greedy; the prompt is kept between rounds (the
prefix cache), which does not touch the figure: it starts after the first chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 0.6B CustomVoice from make_checkpoint)")
    parser.add_argument("--format", default="int4", help="none, int8 or int4")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--chunks", default="4,16", help="chunk sizes in frames, comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    add_doc_arguments(parser, "steady")
    args = parser.parse_args()
    doc = doc_target(args)

    from dataclasses import replace

    from s2s_daemon.bench.machine import read_bandwidth_gbs
    from s2s_daemon.bench.torch_cpu import cpu_engine, sentence_request, timed_utterance

    engine = cpu_engine(args.model, args.format, args.threads, max_frames=str(args.frames))
    assert engine.info is not None
    request = sentence_request(engine)
    chunks = [int(c) for c in args.chunks.split(",")]
    print(machine_line(f"{args.threads} threads", f"{args.format}", f"{args.frames} frames", f"{args.rounds} rounds"))
    bandwidth = [read_bandwidth_gbs(args.threads)]
    steady: dict[int, list[float]] = {c: [] for c in chunks}
    for _ in range(args.rounds):
        for chunk in chunks:
            timed = timed_utterance(engine, replace(request, chunk_frames=chunk))
            if timed is not None:
                steady[chunk].append(timed[1])
    bandwidth.append(read_bandwidth_gbs(args.threads))
    reads = f"read bandwidth {bandwidth[0]:.1f} GB/s before, {bandwidth[1]:.1f} after"
    print(reads)
    for chunk, values in steady.items():
        print(
            f"chunks of {chunk:>2} frames: {statistics.median(values):6.1f} ms a frame past the first chunk"
            f" (range {min(values):.1f}-{max(values):.1f}; real time: 80)"
        )
    if doc is not None:
        rows = [
            [
                f"{chunk} frames",
                f"{statistics.median(v):.1f}",
                f"{min(v):.1f}-{max(v):.1f}",
                ratio(statistics.median(v), 80),
            ]
            for chunk, v in steady.items()
        ]
        doc.publish(
            "The torch engine's steady cost per frame past the first chunk",
            markdown_table(["chunks of", "ms a frame (median)", "range", "/ real time (80 ms)"], rows),
            f"Weights {args.format}, {args.threads} threads, {args.frames} frames an utterance, {args.rounds} rounds"
            " alternating the chunk sizes, greedy; the frames after the first chunk over the time they took."
            f" Below 1x is faster than real time. R{reads[1:]} (a frame reads its weights from memory: on a"
            " shared host the figure moves with what other guests read).",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
