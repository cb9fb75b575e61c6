"""The sampler's draw three ways, side by side in one process, on random logits the shape of the
code predictor's (1 x 2,048; its 15 draws a frame): ``sampling.choose`` with the native kernels
(``Kernels.sample``: one call), ``choose`` in torch operators over the ``top_k`` candidates, and
the draw over the whole vocabulary (``filtered_probabilities`` then ``torch.multinomial``).

    .venv/bin/python scripts/bench_sampling.py [--top-k 50] [--top-p 1.0] [--temperature 0.9] [--threads 2]
        [--between 64]

In the engine a draw follows the kernels' pass over the predictor's weights, which leaves the
caches cold: with ``--between`` MiB (0: none) a buffer that large is read before each draw, outside
its time. Rounds alternate the forms; prints microseconds per draw (median of rounds) and the
ratios to the native draw.
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
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--draws", type=int, default=500, help="draws per round and form")
    parser.add_argument("--between", type=int, default=64, help="MiB read before each draw (0: none)")
    add_doc_arguments(parser, "sampling")
    args = parser.parse_args()
    doc = doc_target(args)

    import torch

    from s2s_daemon.tts.torch_qwen3 import native
    from s2s_daemon.tts.torch_qwen3.config import SamplingSettings
    from s2s_daemon.tts.torch_qwen3.sampling import choose, filtered_probabilities

    torch.set_num_threads(args.threads)
    ext = native.load()
    if ext is None:
        print(f"no native kernels here ({native.unavailable_reason()}): nothing to compare")
        return 1
    settings = SamplingSettings(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(1, args.vocab, generator=generator) * 3 for _ in range(args.draws)]
    buffer = torch.ones((args.between << 20) // 4) if args.between > 0 else None

    def native_draw(row: Any) -> None:
        choose(row, settings, False, generator, ext)

    def short(row: Any) -> None:
        choose(row, settings, False, generator)

    def whole(row: Any) -> None:
        scores = row / settings.temperature
        torch.multinomial(filtered_probabilities(scores, settings), num_samples=1, generator=generator)

    def run(draw: Any) -> float:
        """Microseconds per draw, each timed alone after the buffer's read."""
        total = 0.0
        for row in logits:
            if buffer is not None:
                buffer.sum()
            start = time.perf_counter()
            draw(row)
            total += time.perf_counter() - start
        return float(total * 1e6 / args.draws)

    forms = {"native (one call)": native_draw, "top-k candidates": short, "whole vocabulary": whole}
    print(machine_line(f"{args.threads} threads", f"top_k {args.top_k}, top_p {args.top_p}, vocabulary {args.vocab}",
                       f"{args.between} MiB read before each draw"))  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, draw in forms.items():
            times[name].append(run(draw))
    base = statistics.median(times["native (one call)"])
    for name, values in times.items():
        print(f"{name:>17}: {statistics.median(values):6.1f} us per draw (least {min(values):.1f});"
              f" / native {statistics.median(values) / base:.2f}x")  # fmt: skip
    if doc is not None:
        rows = [
            [name, f"{statistics.median(values):.1f}", f"{min(values):.1f}", ratio(statistics.median(values), base)]
            for name, values in times.items()
        ]
        doc.publish(
            "The sampler's draw: one native call, torch over the top-k candidates, the whole vocabulary",
            markdown_table(["draw", "us per draw (median)", "least", "/ native"], rows),
            f"{args.rounds} rounds of {args.draws} draws each, alternating; top_k {args.top_k}, top_p {args.top_p},"
            f" temperature {args.temperature}, vocabulary {args.vocab}, {args.threads} threads; before each draw"
            f" {args.between} MiB read (outside its time), as the kernels' pass over the weights does in the engine.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
