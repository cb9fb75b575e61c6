"""The text stage's cost per spoken sentence over the corpus of assistant answers
(``tests/fixtures/llm_answers/``): the whole text at once (``prepare_text``, one call per request)
and the same text streamed in small deltas (``StreamingTextStage``, as an LLM writes it).

    .venv/bin/python scripts/bench_text.py [--rounds 20] [--delta 8] [--doc]

Sentences are those of the spoken text as ``pipeline/segment.py`` cuts them for the engine. Prints,
per way, microseconds of one core per sentence (the corpus's total CPU time over its sentences,
median of rounds) and the p50/p90/max over answers; the goal is under 1 ms per sentence. The
markdown-it parser is built before the first round (once per process in the daemon).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llm_answers"
GOAL_US = 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="passes over the corpus per way")
    parser.add_argument("--delta", type=int, default=8, help="characters per streamed delta")
    from s2s_daemon.bench.machine import machine_line
    from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table
    from s2s_daemon.bench.report import percentiles

    add_doc_arguments(parser, "text")
    args = parser.parse_args()
    doc = doc_target(args)

    from s2s_daemon.pipeline.segment import split_sentences
    from s2s_daemon.text import StreamingTextStage, TextOptions, prepare_text

    options = TextOptions()
    answers = []
    for path in sorted(CORPUS.glob("*.md")):
        language = path.name.split("-")[1]
        text = path.read_text(encoding="utf-8")
        spoken = prepare_text(text, options, language).text  # also builds the parser
        sentences, _ = split_sentences(spoken, 100_000, complete=True)
        answers.append((text, language, max(1, len(sentences))))
    total_sentences = sum(count for _, _, count in answers)

    def whole(text: str, language: str) -> None:
        prepare_text(text, options, language)

    def streamed(text: str, language: str) -> None:
        stage = StreamingTextStage(options, language)
        for at in range(0, len(text), args.delta):
            stage.feed(text[at : at + args.delta])
        stage.close()

    print(
        machine_line(
            f"{len(answers)} answers, {total_sentences} spoken sentences, {args.rounds} rounds, "
            f"deltas of {args.delta} characters, one thread"
        )
    )
    print(f"{'way':<10} {'us per sentence':>16} {'p50':>8} {'p90':>8} {'max':>8}  (over answers)")
    rows: list[list[object]] = []
    for name, run in (("whole", whole), ("streamed", streamed)):
        per_round: list[float] = []
        per_answer: list[list[float]] = [[] for _ in answers]
        for _ in range(args.rounds):
            round_s = 0.0
            for index, (text, language, count) in enumerate(answers):
                start = time.thread_time()
                run(text, language)
                spent = time.thread_time() - start
                round_s += spent
                per_answer[index].append(spent * 1e6 / count)
            per_round.append(round_s * 1e6 / total_sentences)
        cost = statistics.median(per_round)
        spread = percentiles([statistics.median(values) for values in per_answer])
        verdict = "under the goal" if cost < GOAL_US else "OVER the goal"
        print(f"{name:<10} {cost:>16.0f} {spread['p50']:>8.0f} {spread['p90']:>8.0f} {spread['max']:>8.0f}  {verdict}")
        rows.append([name, f"{cost:.0f}", f"{spread['p50']:.0f}", f"{spread['p90']:.0f}", f"{spread['max']:.0f}"])
    if doc is not None:
        header = ["way", "CPU us per sentence", "p50 over answers", "p90", "max"]
        notes = (
            f"The corpus ({len(answers)} answers, {total_sentences} spoken sentences), median of {args.rounds} "
            f"rounds, one thread (CPU time); streamed in deltas of {args.delta} characters. Goal: under 1 ms."
        )
        doc.publish("text: the text stage's cost", markdown_table(header, rows, "lrrrr"), notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
