"""Streaming text in: first sound while an LLM is still writing, and long texts in sentences.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_stream.py /tmp/cv06 [--quantization int8] [--rounds 2]
        [--tokens-per-s 30] [--long-chars 2000] [--skip-long]

Through the daemon's own pipeline (engine worker, TTS stage, playback stage; a sink that drops the
audio and notes when each chunk came), one fresh process per round, CPU, 2 threads:

1. **A 600-character reply written at ``--tokens-per-s``** (a token is a word with its space), as a
   stream (``TextFeed``: what ``tts/stream`` and ``say -`` use) and sent whole once written, from
   the first token to the first sample. The goal: the streamed first sample within the time the
   writer took to finish the first clause, plus the engine's first-chunk time for that clause
   alone (measured in the same process), plus 50 ms.
2. **A ``--long-chars`` text spoken whole**: seconds per frame (each chunk's frames over the time
   since the previous chunk, so a sentence's prefill counts) over the first and the last quarter
   of its frames, and RSS at the first chunk and at the end: flat means the KV cache is bounded
   by a sentence, not by the text.

Random weights rarely end a sentence by themselves: ``--max-frames`` caps each sentence (each engine
call), as real speech would end it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import DocTarget, add_doc_arguments, doc_target, markdown_table, ratio

REPLY = (
    "Sure, here is what I found about tomorrow's weather in the city. In the morning, skies will be "
    "mostly cloudy with a light breeze from the west, and temperatures around eleven degrees. By noon, "
    "the clouds should break up, giving way to long sunny spells. In the afternoon, it will warm up to "
    "about eighteen degrees, which is pleasant for a walk in the park. There is a small chance of a "
    "shower in the early evening, so you may want to carry an umbrella just in case. Overnight, the "
    "sky clears again and it gets cool, down to seven degrees. Would you like the forecast for the "
    "weekend as well?"
)
SENTENCES = [
    "The old lighthouse stood at the end of the harbour, its white paint peeling in the salty wind.",
    "Every evening, the keeper climbed the narrow stairs and lit the great lamp.",
    "Ships far out at sea saw the beam sweep across the water, and knew they were close to home.",
    "One winter, a storm came that was stronger than any the village had seen.",
    "The waves rose higher than the harbour wall, and the rain fell sideways.",
    "Still, the keeper kept the light burning through the long and noisy night.",
    "In the morning, the fishermen came to thank him, carrying bread and warm soup.",
]


def long_text(chars: int) -> str:
    out: list[str] = []
    i = 0
    while sum(len(s) + 1 for s in out) < chars:
        out.append(SENTENCES[i % len(SENTENCES)])
        i += 1
    return " ".join(out)[:chars].rsplit(" ", 1)[0] + "."


def tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


# -- one round, in its own process ---------------------------------------------------------------


class ChunkSink:
    """Drops the audio; notes when each chunk came and how long it was."""

    name = "bench"
    realtime = False

    def __init__(self) -> None:
        self.chunks: list[tuple[float, float, float]] = []
        """(monotonic time, seconds of audio, RSS MiB) per chunk."""

    async def open(self) -> None:
        return None

    async def play(self, utterance: Any, on_first_sample: Any) -> Any:
        from s2s_daemon.pipeline.messages import PlaybackReport

        first = None
        samples = 0
        async for chunk in utterance.chunks:
            now = time.monotonic()
            if first is None and len(chunk):
                first = now
                on_first_sample(now)
            samples += len(chunk)
            self.chunks.append((now, len(chunk) / utterance.sample_rate, rss_mib()))
        return PlaybackReport(first, time.monotonic(), 1000.0 * samples / utterance.sample_rate)

    async def close(self) -> None:
        return None


class Events:
    def __init__(self) -> None:
        self.done: dict[str, Any] = {}

    def started(self, job: Any) -> None:
        return None

    def finished(self, job: Any) -> None:
        self.done[job.request.id] = job

    def state_changed(self) -> None:
        return None


async def _round(args: argparse.Namespace) -> dict[str, Any]:
    from s2s_daemon.config import load_config
    from s2s_daemon.pipeline.messages import SayRequest
    from s2s_daemon.pipeline.segment import split_sentences
    from s2s_daemon.pipeline.textfeed import TextFeed
    from s2s_daemon.tts.engine import SynthesisRequest
    from s2s_daemon.wiring import build_stages, load_engine

    environ = {
        "S2S_TTS__MODEL": str(args.model),
        "S2S_TTS__ENGINE": "torch",
        "S2S_TTS__TORCH__QUANTIZATION": args.quantization,
        "S2S_TTS__TORCH__DEVICE": "cpu",
        "S2S_TTS__OPTIONS__THREADS": "2",
        "S2S_TTS__MAX_TEXT_CHARS": "100000",
        "S2S_JOURNAL__ENABLED": "false",
        "S2S_TTS__VOICE": "Ryan",
        "S2S_TTS__OPTIONS__MAX_FRAMES": str(args.max_frames),
        "S2S_AUDIO__GAPLESS": "false" if args.no_gapless else "true",
    }
    config = load_config(None, environ=environ)
    worker, info = await load_engine(config)
    sink = ChunkSink()
    events = Events()
    template = SynthesisRequest(text="", voice=None, language="auto", seed=1, greedy=True)
    stages = build_stages(config, worker, info, sink, events, max_pending=4, template=template)
    run = asyncio.create_task(stages.run())
    ledger = stages.ledger
    voice = info.voices[0] if info.voices else None
    result: dict[str, Any] = {"load_rss_mib": round(rss_mib(), 1)}

    def request(rid: str, text: str, feed: TextFeed | None = None, at: float | None = None) -> Any:
        return ledger.submit(
            SayRequest(
                id=rid,
                text=text,
                voice=voice,
                language="english",
                site_id="bench",
                received_at=at if at is not None else time.monotonic(),
                feed=feed,
            )
        )

    async def until_first_sample(job: Any, stop: bool = True) -> None:
        while job.timeline.first_sample_out is None and not job.done.is_set():  # noqa: ASYNC110 -- polls the ledger's timeline
            await asyncio.sleep(0.002)
        if stop:
            ledger.stop_id(job.request.id)
        await job.done.wait()

    # Warm: one short sentence.
    await until_first_sample(request("warm", "Hello there, how are you today?"), stop=False)

    pieces = tokens(REPLY)
    gap = 1.0 / args.tokens_per_s
    first_clause = split_sentences(REPLY, 300, complete=True, first=True)[0][0]
    clause_pieces = next(i for i in range(1, len(pieces) + 1) if len("".join(pieces[:i]).strip()) >= len(first_clause))
    # The engine's first chunk for the first clause alone (the goal's middle term).
    job = request("clause", first_clause)
    await until_first_sample(job)
    tl = job.timeline
    clause_first_chunk_s = tl.first_chunk - tl.synth_started
    clause_first_sample_s = tl.first_sample_out - tl.received

    async def write(feed: TextFeed | None, t0: float) -> None:
        for i, piece in enumerate(pieces):
            await asyncio.sleep(max(0.0, t0 + i * gap - time.monotonic()))
            if feed is not None:
                feed.add(i, piece, last=i == len(pieces) - 1)

    order = ["streamed", "whole"] if args.round % 2 == 0 else ["whole", "streamed"]
    for mode in order:
        t0 = time.monotonic()
        if mode == "streamed":
            feed = TextFeed(100_000, 30.0, now=t0)
            writer = asyncio.create_task(write(feed, t0))
            job = request("streamed", "", feed, at=t0)
            await until_first_sample(job)
            writer.cancel()
            tl = job.timeline
            result["streamed"] = {
                "first_sample_s": round(tl.first_sample_out - t0, 3),
                "first_chunk_s": round(tl.first_chunk - t0, 3),
                "prebuffer_s": round(tl.prebuffer_s, 3),
                "first_text_s": round(tl.first_text - t0, 3),
                "first_chunk_after_text_s": round(tl.first_chunk - tl.first_text, 3),
            }
        else:
            await write(None, t0)
            job = request("whole", REPLY)  # received once written
            await until_first_sample(job)
            tl = job.timeline
            result["whole"] = {
                "first_sample_s": round(tl.first_sample_out - t0, 3),
                "first_chunk_s": round(tl.first_chunk - t0, 3),
                "prebuffer_s": round(tl.prebuffer_s, 3),
                "written_s": round(tl.received - t0, 3),
                "after_written_s": round(tl.first_sample_out - tl.received, 3),
            }
        await asyncio.sleep(0.2)
    clause_written_s = (clause_pieces - 1) * gap
    result["goal"] = {
        "first_clause": first_clause,
        "clause_written_s": round(clause_written_s, 3),
        "clause_first_chunk_s": round(clause_first_chunk_s, 3),
        "clause_first_sample_s": round(clause_first_sample_s, 3),
        "goal_s": round(clause_written_s + clause_first_chunk_s + 0.05, 3),
    }
    result["streamed"]["met"] = result["streamed"]["first_sample_s"] <= result["goal"]["goal_s"]
    result["streamed"]["met_by_first_chunk"] = result["streamed"]["first_chunk_s"] <= result["goal"]["goal_s"]

    if not args.skip_long:
        text = long_text(args.long_chars)
        sink.chunks.clear()
        start = time.monotonic()
        job = request("long", text)
        await job.done.wait()
        chunks = list(sink.chunks)
        frames = [(t, a / 0.08) for t, a, _ in chunks]
        costs = []
        previous = job.timeline.synth_started or start
        for t, f in frames:
            costs.append(((t - previous), f))
            previous = t
        quarter = max(1, len(costs) // 4)

        def per_frame(part: list[tuple[float, float]]) -> float:
            return sum(c for c, _ in part) / max(sum(f for _, f in part), 1e-9)

        result["long"] = {
            "chars": len(text),
            "segments": len(split_sentences(text, 300, complete=True, first=True)[0]),
            "audio_s": round(job.timeline.audio_s, 1),
            "wall_s": round(time.monotonic() - start, 1),
            "s_per_frame_first_quarter": round(per_frame(costs[:quarter]), 4),
            "s_per_frame_last_quarter": round(per_frame(costs[-quarter:]), 4),
            "rss_first_chunk_mib": round(chunks[0][2], 1) if chunks else None,
            "rss_end_mib": round(chunks[-1][2], 1) if chunks else None,
            "status": str(job.status),
        }
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)
    stages.requests.close()
    await run
    await worker.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--quantization", default="int8", choices=["none", "int8", "int4"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens-per-s", type=float, default=30.0)
    parser.add_argument("--long-chars", type=int, default=2000)
    parser.add_argument(
        "--max-frames",
        type=int,
        default=60,
        help="frames per sentence at most (random weights rarely stop by themselves; 60 = 4.8 s)",
    )
    parser.add_argument("--skip-long", action="store_true", help="only the streamed reply")
    parser.add_argument("--no-gapless", action="store_true", help="audio.gapless: false (play as it comes)")
    parser.add_argument("--json", action="store_true", help="one JSON line per round instead of the table")
    parser.add_argument("--round", type=int, default=None, help=argparse.SUPPRESS)
    add_doc_arguments(parser, "stream")
    args = parser.parse_args()
    if args.round is not None:  # a round, in this process
        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
        print(json.dumps(asyncio.run(_round(args))))
        return 0
    doc = doc_target(args)
    print(f"# bench_stream {machine_line()}")
    print(
        f"# model {args.model}, torch {args.quantization}, 2 threads, {args.tokens_per_s:g} tokens/s,"
        f" at most {args.max_frames} frames a sentence, audio.gapless {not args.no_gapless}"
    )
    rounds = []
    for r in range(args.rounds):
        command = [sys.executable, __file__, str(args.model), "--quantization", args.quantization, "--round", str(r)]
        command += ["--tokens-per-s", str(args.tokens_per_s), "--long-chars", str(args.long_chars)]
        command += ["--max-frames", str(args.max_frames)] + (["--no-gapless"] if args.no_gapless else [])
        if args.skip_long or r > 0:
            command.append("--skip-long")  # the long text once: it takes minutes
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            return 1
        data = json.loads(out.stdout.strip().splitlines()[-1])
        rounds.append(data)
        if args.json:
            print(json.dumps(data))
    if doc is not None:
        publish(doc, args, rounds)
    if args.json:
        return 0
    print(f"\n600-character reply ({len(tokens(REPLY))} tokens), from its first token to the first sample, s:")
    print(
        "round | streamed: first sample (first chunk, prebuffered) | whole, written at the end: first sample"
        " (after written) | streamed: first text ready, first chunk after it | goal | met (by first chunk)"
    )
    for r, d in enumerate(rounds):
        s, w, g = d["streamed"], d["whole"], d["goal"]
        print(
            f"{r} | {s['first_sample_s']:.3f} ({s['first_chunk_s']:.3f}, {s['prebuffer_s']:.2f} s)"
            f" | {w['first_sample_s']:.3f} ({w['after_written_s']:.3f})"
            f" | {s['first_text_s']:.3f}, {s['first_chunk_after_text_s']:.3f} | {g['goal_s']:.3f}"
            f" | {s['met']} ({s['met_by_first_chunk']})"
        )
    print(
        "(an engine slower than real time holds the first sample until the first sentence will play without"
        " a gap: prebuffered)"
    )
    g = rounds[0]["goal"]
    print(
        f"goal = first clause written ({g['clause_written_s']:.3f} s: {g['first_clause']!r})"
        f" + its first chunk alone ({g['clause_first_chunk_s']:.3f} s) + 0.05 s"
    )
    long = rounds[0].get("long")
    if long:
        print(f"\n{long['chars']}-character text whole ({long['segments']} segments, {long['audio_s']} s of audio):")
        print(
            f"s per frame: first quarter {long['s_per_frame_first_quarter']}, last quarter "
            f"{long['s_per_frame_last_quarter']}; RSS MiB at first chunk {long['rss_first_chunk_mib']}, at the end "
            f"{long['rss_end_mib']}; peak {rounds[0]['peak_rss_mib']}; {long['wall_s']} s wall, {long['status']}"
        )
    return 0


def publish(doc: DocTarget, args: argparse.Namespace, rounds: list[dict[str, Any]]) -> None:
    rows = []
    for r, d in enumerate(rounds):
        s, w, g = d["streamed"], d["whole"], d["goal"]
        rows.append(
            [
                r,
                f"{s['first_sample_s']:.3f} ({s['first_chunk_s']:.3f}, {s['prebuffer_s']:.2f})",
                f"{w['first_sample_s']:.3f} ({w['after_written_s']:.3f})",
                ratio(s["first_sample_s"], w["first_sample_s"]),
                f"{s['first_text_s']:.3f}, {s['first_chunk_after_text_s']:.3f}",
                f"{g['goal_s']:.3f}",
                f"{s['met']} ({s['met_by_first_chunk']})",
            ]
        )
    header = ["round", "streamed: first sample s (first chunk, prebuffered)",
              "whole, sent once written: first sample s (after written)", "streamed / whole",
              "streamed: first text ready, first chunk after it, s", "goal s", "met (by first chunk)"]  # fmt: skip
    g = rounds[0]["goal"]
    notes = (
        f"A {len(REPLY)}-character reply ({len(tokens(REPLY))} tokens) written at {args.tokens_per_s:g} tokens/s,"
        f" from its first token. Torch {args.quantization}, 2 threads, at most {args.max_frames} frames a sentence,"
        f" audio.gapless {not args.no_gapless}; one fresh process a round. Goal = the first clause written"
        f" ({g['clause_written_s']:.3f} s) + its first chunk alone ({g['clause_first_chunk_s']:.3f} s) + 0.05 s."
        " An engine slower than real time holds the first sample until the first sentence will play without a"
        " gap (prebuffered)."
    )
    long = rounds[0].get("long")
    if long:
        notes += "\n\n" + markdown_table(
            ["long text, spoken whole", "segments", "audio s", "s a frame, first quarter", "last quarter",
             "RSS MiB at first chunk", "at the end", "peak", "wall s"],
            [[f"{long['chars']} characters", long["segments"], long["audio_s"], long["s_per_frame_first_quarter"],
              long["s_per_frame_last_quarter"], long["rss_first_chunk_mib"], long["rss_end_mib"],
              rounds[0]["peak_rss_mib"], long["wall_s"]]],
        )  # fmt: skip
    doc.publish("Streaming text in: first sound while the text is written", markdown_table(header, rows), notes)


if __name__ == "__main__":
    raise SystemExit(main())
