"""What the talker's prefix cache saves: one prompt's prefill with nothing kept, after another
sentence in the same voice, and said again (``runtime.PrefixCache``).

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_prefix.py ./cv06 [--format int8] [--threads 2] [--rounds 6]

One process, the three cases alternating round by round (``TalkerRuntime.start``, the batch's
prefill, which ``frames`` shares), so that a noisy machine weighs on each alike. Prints each case's
milliseconds (median, min, max) and the positions taken from the cache, with the machine and load.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 0.6B CustomVoice from make_checkpoint)")
    parser.add_argument("--format", default="int8", choices=["none", "int8", "int4"], help="quantization")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=6)
    add_doc_arguments(parser, "prefix")
    args = parser.parse_args()
    doc = doc_target(args)

    import torch

    from s2s_daemon.bench.torch_cpu import cpu_engine
    from s2s_daemon.tts.engine import SynthesisRequest
    from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions

    engine = cpu_engine(args.model, args.format, args.threads)
    info = engine.info
    assert info is not None
    runtime = engine.runtime
    assert runtime is not None
    prefixes = runtime.prefixes
    if prefixes is None:
        raise SystemExit("the prefix cache is off (tts.options.prefix_cache_rows 0)")

    def request(text: str) -> SynthesisRequest:
        voice = info.voices[0] if info.voices else None
        return SynthesisRequest(text=text, voice=voice, language="english", chunk_frames=4, greedy=True)

    one = DecodeOptions(max_frames=1, greedy=True, seed=None)
    times: dict[str, list[float]] = {"nothing kept": [], "same voice": [], "said again": []}
    kept: dict[str, int] = {}
    with torch.inference_mode():
        prompt = engine.prepare(request("The quick brown fox jumps over the lazy dog near the river."))[0]
        other = engine.prepare(request("A gentle breeze moved across the quiet harbor this morning."))[0]
        before: dict[str, Any] = {"nothing kept": None, "same voice": other, "said again": prompt}
        for _ in range(args.rounds):
            for case, earlier in before.items():
                prefixes.clear()
                if earlier is not None:
                    runtime.start(earlier, one)
                reused = prefixes.reused
                t0 = time.perf_counter()
                runtime.start(prompt, one)
                times[case].append(1000 * (time.perf_counter() - t0))
                kept[case] = prefixes.reused - reused
    print(machine_line(f"{args.threads} threads", args.format, f"prompt of {prompt.prefill.shape[1]} positions"))
    for case, values in times.items():
        print(
            f"{case:>13}: {kept[case]:>3} positions kept, prefill median {statistics.median(values):.0f} ms "
            f"(min {min(values):.0f}, max {max(values):.0f})"
        )
    if doc is not None:
        base = statistics.median(times["nothing kept"])
        rows = [
            [
                case,
                kept[case],
                f"{statistics.median(v):.0f}",
                f"{min(v):.0f}",
                f"{max(v):.0f}",
                ratio(statistics.median(v), base),
            ]
            for case, v in times.items()
        ]
        doc.publish(
            "What the talker's prefix cache saves at prefill",
            markdown_table(["case", "positions kept", "prefill ms (median)", "min", "max", "/ nothing kept"], rows),
            f"Weights {args.format}, {args.threads} threads, a prompt of {prompt.prefill.shape[1]} positions,"
            f" {args.rounds} rounds alternating the three cases (`TalkerRuntime.start`).",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
