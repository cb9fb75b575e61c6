"""The code predictor's frame in one native call (``native.Predictor``) beside its loop of torch
calls (``runtime.predict_frame``'s), side by side in one process, rounds alternating: an utterance's
steady cost per frame with audio (as ``bench_steady.py`` times it), and a step of several streams
decoded together (talker and predictor, no codec; as the engine's batch runs them).

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_predictor.py ./cv06 [--format int8] [--frames 64] [--streams 4]

Both ways compute the same codes (``tests/test_native_predictor.py``); only the time differs. Real
time is 80 ms a frame. Greedy; random weights never end an utterance early: ``--frames`` caps it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio

TEXTS = (
    "The kettle is boiling in the kitchen now.",
    "Someone is at the front door, please answer it.",
    "The lights in the hall are switched off.",
    "Good night, sleep well and see you tomorrow.",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 0.6B CustomVoice from make_checkpoint)")
    parser.add_argument("--format", default="int8", help="none, int8 or int4")
    parser.add_argument("--frames", type=int, default=64, help="frames an utterance (and steps of the streams)")
    parser.add_argument("--chunk", type=int, default=4, help="frames a chunk of the utterance")
    parser.add_argument("--streams", type=int, default=4, help="streams decoded together (0: skip that part)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    add_doc_arguments(parser, "predictor")
    args = parser.parse_args()
    doc = doc_target(args)

    from dataclasses import replace

    import torch

    from s2s_daemon.bench.torch_cpu import cpu_engine, sentence_request, timed_utterance
    from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions

    engine = cpu_engine(args.model, args.format, args.threads, max_frames=str(args.frames))
    runtime, gen = engine.runtime, engine.gen
    assert runtime is not None and gen is not None
    predictor: Any = runtime.talker.code_predictor
    fused = predictor.native
    if fused is None:
        print("this checkpoint's code predictor is not fused here (its widths, or no native kernels): nothing to do")
        return 1
    request = replace(sentence_request(engine), chunk_frames=args.chunk)
    ways = {"one call": fused, "loop": None}

    def batch_step_ms() -> float:
        """Milliseconds a step of ``args.streams`` streams, past their first step, on all the threads
        (as the engine's step takes them while no codec push runs; an utterance before, with the
        codec on its own thread, leaves this thread fewer)."""
        torch.set_num_threads(args.threads)
        with torch.inference_mode():
            seqs = []
            for i in range(args.streams):
                prompt = engine.prepare(replace(request, text=TEXTS[i % len(TEXTS)]))[0]
                seqs.append(runtime.start(prompt, DecodeOptions(max_frames=args.frames, greedy=True, seed=None)))
            runtime.step_batch(seqs, gen)
            start = time.perf_counter()
            for _ in range(args.frames - 1):
                runtime.step_batch(seqs, gen)
            return (time.perf_counter() - start) * 1000 / (args.frames - 1)

    print(machine_line(f"{args.threads} threads", args.format, f"{args.frames} frames", f"{args.rounds} rounds"))
    steady: dict[str, list[float]] = {name: [] for name in ways}
    steps: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            predictor.native = way
            timed = timed_utterance(engine, request)
            if timed is not None:
                steady[name].append(timed[1])
            if args.streams > 0:
                steps[name].append(batch_step_ms())
    predictor.native = fused
    rows = []
    parts = [(f"one utterance: ms a frame with audio, chunks of {args.chunk}", steady)]
    if args.streams > 0:
        parts.append((f"{args.streams} streams together: ms a step, talker and predictor", steps))
    for label, values in parts:
        one, loop = statistics.median(values["one call"]), statistics.median(values["loop"])
        print(f"{label}: one call {one:.1f} (range {min(values['one call']):.1f}-{max(values['one call']):.1f}),"
              f" loop {loop:.1f} (range {min(values['loop']):.1f}-{max(values['loop']):.1f}); loop / one call"
              f" {loop / one:.2f}x")  # fmt: skip
        rows.append([label, f"{one:.1f}", f"{loop:.1f}", ratio(loop, one)])
    engine.close_blocking()
    if doc is not None:
        doc.publish(
            "The code predictor's frame: one native call beside the loop of torch calls",
            markdown_table(["what", "one call", "loop", "loop / one call"], rows),
            f"Weights {args.format}, {args.threads} threads, {args.frames} frames an utterance (and steps of the"
            f" streams), {args.rounds} rounds alternating the two ways in one process, medians; greedy. Both ways"
            " make the same codes; the utterance's frames after its first chunk over the time they took (the codec"
            " included), the streams' steps without the codec (as bench_batch.py's talker column).",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
