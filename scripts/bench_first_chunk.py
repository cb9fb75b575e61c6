"""Where a new sentence's first chunk goes: the prompt's preparation, the talker's prefill, the
code predictor's first frame, the codec decoder's first push, and the rest, timed inside one
synthesis (the engine's own calls wrapped, nothing else changed), as the daemon runs it: a
one-frame first chunk (``first_chunk_frames`` "1", the default), greedy.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv17 --size 1.7b --kind custom_voice
    .venv/bin/python scripts/bench_first_chunk.py ./cv17 [--formats int4,int8] [--threads 2] [--rounds 7]

Two cases per format, rounds alternating in one process: ``new voice``, the benchmark sentence with
no kept prompt (the prefix cache emptied: a voice's first sentence), and ``same voice``, the same
sentence right after another one in that voice (the role, language and speaker positions kept: the
daemon's usual case). Medians of the rounds; each part's median is its own, so the parts need not
add up to the median first chunk exactly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table

OTHER_SENTENCE = "A gentle breeze moved across the quiet harbor this morning."
"""Spoken before the benchmark sentence in the same voice for the ``same voice`` case."""
CASES = ("new voice", "same voice")
PARTS = ("prepare", "prefill", "predictor", "codec")
"""The timed calls: ``engine.prepare`` (text to the prompt's embeddings), ``runtime.prefill`` (the
talker over the prompt's positions not kept, and the first codebook's logits),
``runtime.predict_frame`` (the code predictor's 15 steps of the first frame), and the codec
decoder's push of the first chunk (``engine._decode``)."""


class PartTimer:
    """Wraps the engine's calls for ``PARTS`` and keeps each one's first call's seconds a round."""

    def __init__(self, engine: Any) -> None:
        from s2s_daemon.tts.torch_qwen3 import engine as engine_module

        self.seconds: dict[str, float] = {}
        self.positions = 0
        self.kept = 0
        runtime = engine.runtime
        engine.prepare = self._timed("prepare", engine.prepare)
        runtime.prefill = self._timed("prefill", runtime.prefill, self._count)
        runtime.predict_frame = self._timed("predictor", runtime.predict_frame)
        if runtime.prefixes is not None:
            restore = runtime.prefixes.restore

            def restored(*args: Any, **kwargs: Any) -> int:
                self.kept = int(restore(*args, **kwargs))
                return self.kept

            runtime.prefixes.restore = restored
        self._module = engine_module
        self._decode = engine_module._decode
        engine_module._decode = self._timed("codec", self._decode)

    def _count(self, embeds: Any, *_: Any, **__: Any) -> None:
        self.positions = int(embeds.shape[1])

    def _timed(
        self, part: str, call: Callable[..., Any], seen: Callable[..., None] | None = None
    ) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if seen is not None:
                seen(*args, **kwargs)
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds.setdefault(part, time.perf_counter() - started)

        return run

    def start(self) -> None:
        self.seconds = {}
        self.positions = self.kept = 0

    def close(self) -> None:
        self._module._decode = self._decode


def first_chunk_s(engine: Any, request: Any) -> float:
    started = time.perf_counter()
    for _piece in engine.synthesize_blocking(request, lambda: False):
        break
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 1.7B CustomVoice from make_checkpoint)")
    parser.add_argument("--formats", default="int4,int8", help="int8, int4, none (comma-separated)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=7)
    add_doc_arguments(parser, "first-chunk")
    args = parser.parse_args()
    doc = doc_target(args)

    from dataclasses import replace

    from s2s_daemon.bench.torch_cpu import cpu_engine, sentence_request

    print(machine_line(f"{args.threads} threads", f"{args.rounds} rounds"))
    rows: list[list[Any]] = []
    for fmt in args.formats.split(","):
        engine = cpu_engine(args.model, fmt, args.threads)
        timer = PartTimer(engine)
        try:
            isa = engine.info.isa.split(" ")[0] if engine.info is not None and engine.info.isa else "-"
            request = sentence_request(engine)
            other = replace(request, text=OTHER_SENTENCE)
            prefixes = engine.runtime.prefixes  # type: ignore[union-attr]
            got: dict[str, dict[str, list[float]]] = {c: {p: [] for p in ("total", *PARTS)} for c in CASES}
            positions: dict[str, tuple[int, int]] = {}
            for _ in range(args.rounds):
                for case in CASES:
                    if prefixes is not None:
                        prefixes.clear()
                    if case == "same voice":
                        first_chunk_s(engine, other)
                    timer.start()
                    got[case]["total"].append(first_chunk_s(engine, request))
                    for part in PARTS:
                        got[case][part].append(timer.seconds.get(part, float("nan")))
                    positions[case] = (timer.positions, timer.positions - timer.kept)
            for case in CASES:
                ms = {part: statistics.median(values) * 1000 for part, values in got[case].items()}
                rest = round(ms["total"] - sum(ms[p] for p in PARTS))  # an int: "0", never "-0"
                total, run = positions[case]
                print(
                    f"{fmt} {isa} {case}: first chunk {ms['total']:.0f} ms = prepare {ms['prepare']:.0f} + prefill"
                    f" {ms['prefill']:.0f} ({run} of {total} positions) + predictor {ms['predictor']:.0f} + codec"
                    f" {ms['codec']:.0f} + rest {rest:.0f}"
                )
                cells = [f"{ms[p]:.0f}" for p in ("total", *PARTS)]
                rows.append([fmt, isa, case, f"{run} of {total}", *cells, str(rest)])
        finally:
            timer.close()
            engine.close_blocking()
    if doc is not None:
        header = ["format", "path", "case", "positions run", "first chunk, ms", "prepare", "prefill",
                  "predictor", "codec", "rest"]  # fmt: skip
        doc.publish(
            "Where a new sentence's first chunk goes",
            markdown_table(header, rows, align="llllrrrrrr"),
            f"Model `{args.model}`, {args.threads} threads, the benchmark sentence with a one-frame first chunk,"
            f" greedy; medians of {args.rounds} rounds, each part's its own. new voice: no prompt kept; same voice:"
            " right after another sentence in that voice (its first positions kept, the daemon's usual case)."
            " prepare: text to the prompt's embeddings; prefill: the talker over the positions run and the first"
            " codebook; predictor: the code predictor's first frame; codec: the decoder's first push; rest: the"
            " remainder (the generator, the chunk's hand-over).",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
