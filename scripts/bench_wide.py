"""The native integer kernels' avx512 path (AVX-512 VNNI) against the avx2 path, side by side in one process.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_wide.py ./cv06 [--formats int8,int4] [--threads 2] [--rounds 4]

Both paths compute the same bits for the integer formats (tests/test_native_kernels.py); this
measures what the wide one saves where the products are compute bound: a prompt's prefill (the
ten-word sentence's, nothing kept) and a talker + code predictor step of 1 and of 4 requests
together (``step_batch``, no codec). One engine per path (``tts.torch.isa``: ``avx512``,
``avx2``); rounds alternate them. Needs a CPU with AVX-512 VNNI (else it says so and exits).
``scripts/bench_isa.py`` measures whole frames per path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 0.6B CustomVoice from make_checkpoint)")
    parser.add_argument("--formats", default="int8,int4")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps timed per round and batch size")
    add_doc_arguments(parser, "wide")
    args = parser.parse_args()
    doc = doc_target(args)

    import torch

    from s2s_daemon.bench.torch_cpu import cpu_engine
    from s2s_daemon.tts.engine import SynthesisRequest
    from s2s_daemon.tts.torch_qwen3 import native
    from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions

    torch.set_num_threads(args.threads)
    if native.why_not_here() is not None or "avx512" not in native.runnable_paths():
        print("this CPU has no AVX-512 VNNI (or no native kernels): nothing to compare")
        return 1
    print(machine_line(f"{args.threads} threads", f"{args.rounds} rounds"))
    texts = [
        "The quick brown fox jumps over the lazy dog near the river.",
        "A gentle breeze moved across the quiet harbor this morning.",
        "Please turn off the lights in the kitchen and the hall.",
        "Dinner is ready in ten minutes, so come down soon.",
    ]
    rows: list[list[object]] = []
    for fmt in args.formats.split(","):
        engines = {
            wide: cpu_engine(args.model, fmt, args.threads, "avx512" if wide else "avx2", prefix_cache_rows="0")
            for wide in (True, False)
        }
        info, gen = engines[True].info, engines[True].gen
        assert info is not None and gen is not None
        voice = info.voices[0] if info.voices else None
        times: dict[tuple[str, bool], list[float]] = {}
        with torch.inference_mode():
            prompts = [
                engines[True].prepare(SynthesisRequest(text=t, voice=voice, language="english", greedy=True))[0]
                for t in texts
            ]
            for _ in range(args.rounds):
                for wide in (True, False):
                    runtime = engines[wide].runtime
                    assert runtime is not None
                    t0 = time.perf_counter()
                    runtime.start(prompts[0], DecodeOptions(1, True, None))
                    times.setdefault(("prefill", wide), []).append(1000 * (time.perf_counter() - t0))
                    for n in (1, 4):
                        seqs = [runtime.start(p, DecodeOptions(args.steps + 2, True, None)) for p in prompts[:n]]
                        runtime.step_batch(seqs, gen)
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            runtime.step_batch(seqs, gen)
                        step_ms = 1000 * (time.perf_counter() - t0) / args.steps
                        times.setdefault((f"step, {n} requests", wide), []).append(step_ms)
        for engine in engines.values():
            engine.close_blocking()
        print(f"\n{fmt}, prompt of {prompts[0].prefill.shape[1]} positions: median ms (min-max)")
        print("what | AVX-512 VNNI | AVX2 | AVX2 / VNNI")
        for what in ("prefill", "step, 1 requests", "step, 4 requests"):
            wide_ms, narrow_ms = times[(what, True)], times[(what, False)]
            print(
                f"{what} | {statistics.median(wide_ms):.0f} ({min(wide_ms):.0f}-{max(wide_ms):.0f}) | "
                f"{statistics.median(narrow_ms):.0f} ({min(narrow_ms):.0f}-{max(narrow_ms):.0f}) | "
                f"{statistics.median(narrow_ms) / statistics.median(wide_ms):.2f}"
            )
            rows.append(
                [
                    fmt,
                    what,
                    f"{statistics.median(wide_ms):.0f} ({min(wide_ms):.0f}-{max(wide_ms):.0f})",
                    f"{statistics.median(narrow_ms):.0f} ({min(narrow_ms):.0f}-{max(narrow_ms):.0f})",
                    ratio(statistics.median(narrow_ms), statistics.median(wide_ms)),
                ]
            )
    if doc is not None:
        doc.publish(
            "The native integer kernels: AVX-512 VNNI against AVX2",
            markdown_table(["weights", "what", "AVX-512 VNNI ms", "AVX2 ms", "AVX2 / VNNI"], rows, "llrrr"),
            f"Median ms (min-max) over {args.rounds} rounds alternating the two forms, {args.threads} threads;"
            f" a step is the talker and code predictor for 1 or 4 requests together (`step_batch`, no codec),"
            f" {args.steps} steps timed a round; the prefill is the ten-word sentence's, nothing kept.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
