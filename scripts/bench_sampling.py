"""The sampler's draw over the ``top_k`` candidates (``sampling.choose``) against the draw over the
whole vocabulary (``filtered_probabilities`` then ``torch.multinomial``), side by side in one
process, on random logits the shape of the code predictor's (1 x 2,048; its 15 draws a frame).

    .venv/bin/python scripts/bench_sampling.py [--top-k 50] [--top-p 1.0] [--temperature 0.9] [--threads 2]

Rounds alternate the two; prints microseconds per draw (median of rounds) and their ratio.
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
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--draws", type=int, default=500, help="draws per round and form")
    add_doc_arguments(parser, "sampling")
    args = parser.parse_args()
    doc = doc_target(args)

    import torch

    from s2s_daemon.tts.torch_qwen3.config import SamplingSettings
    from s2s_daemon.tts.torch_qwen3.sampling import choose, filtered_probabilities

    torch.set_num_threads(args.threads)
    settings = SamplingSettings(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(1, args.vocab, generator=generator) * 3 for _ in range(args.draws)]

    def short() -> None:
        for row in logits:
            choose(row, settings, False, generator)

    def whole() -> None:
        for row in logits:
            scores = row / settings.temperature
            torch.multinomial(filtered_probabilities(scores, settings), num_samples=1, generator=generator)

    print(machine_line(f"{args.threads} threads", f"top_k {args.top_k}, top_p {args.top_p}, vocabulary {args.vocab}"))
    times: dict[str, list[float]] = {"top-k candidates": [], "whole vocabulary": []}
    for _ in range(args.rounds):
        for name, run in (("top-k candidates", short), ("whole vocabulary", whole)):
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e6 / args.draws)
    for name, values in times.items():
        print(f"{name:>17}: {statistics.median(values):6.1f} us per draw (least {min(values):.1f})")
    short_us, whole_us = (statistics.median(times[name]) for name in ("top-k candidates", "whole vocabulary"))
    print(f"whole / top-k: {whole_us / short_us:.2f}x")
    if doc is not None:
        rows = [
            [name, f"{statistics.median(values):.1f}", f"{min(values):.1f}", ratio(statistics.median(values), short_us)]
            for name, values in times.items()
        ]
        doc.publish(
            "The sampler's draw: top-k candidates against the whole vocabulary",
            markdown_table(["draw over", "us per draw (median)", "least", "/ top-k"], rows),
            f"{args.rounds} rounds of {args.draws} draws each, alternating; top_k {args.top_k}, top_p {args.top_p},"
            f" temperature {args.temperature}, vocabulary {args.vocab}, {args.threads} threads.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
