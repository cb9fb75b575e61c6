"""Benchmark the speaker sink: chunk arrival -> first sample at the device, and callback cost.

    .venv/bin/python scripts/bench_audio.py --pulse            # private PulseAudio null sink
    .venv/bin/python scripts/bench_audio.py --device "USB"     # a real output device

For each callback period it streams utterances the way the TTS stage does (chunks of
``--chunk-ms`` arriving at ``--speed`` x real time) and reports:

- first-chunk delay: from the first chunk's arrival at the sink to its first sample
  being handed to the device (PortAudio callback); the prebuffer (``--latency-ms``) is
  part of it when the chunk is shorter than that;
- later-chunk delay: the same for every other chunk (mostly the audio queued ahead);
- cancel -> flush: from cancelling ``play`` (stop, barge-in) to the callback dropping
  what is buffered;
- callback duration p50/p99/max against the period, underruns and xruns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from s2s_daemon.audio.speaker import SpeakerSink  # noqa: E402  (path set above)
from s2s_daemon.bench.machine import machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import DocTarget, add_doc_arguments, doc_target, markdown_table  # noqa: E402
from s2s_daemon.bench.report import percentiles  # noqa: E402
from s2s_daemon.config import AudioConfig  # noqa: E402
from s2s_daemon.pipeline.channel import Channel, Overflow  # noqa: E402
from s2s_daemon.pipeline.messages import SayRequest, Utterance  # noqa: E402

ENGINE_RATE = 24_000


async def one_utterance(sink: SpeakerSink, seconds: float, chunk_ms: float, speed: float, seed: int) -> dict[str, Any]:
    import soxr

    rng = np.random.default_rng(seed)
    samples = (0.1 * rng.standard_normal(int(seconds * ENGINE_RATE))).astype(np.float32)
    chunk = int(ENGINE_RATE * chunk_ms / 1000)
    chunks = [samples[i : i + chunk] for i in range(0, len(samples), chunk)]
    # The sink resamples with an identical stream: the same output lengths tell where each chunk lands.
    twin = soxr.ResampleStream(ENGINE_RATE, sink.rate_hz, 1, dtype="float32", quality="HQ")
    lengths = [len(twin.resample_chunk(c)) for c in chunks]
    request = SayRequest(id=f"bench-{seed}", text="x", voice=None, language="auto", site_id="bench")
    utt = Utterance(request, ENGINE_RATE, Channel(4, Overflow.BLOCK, "bench.chunks"))
    arrivals: list[float] = []

    async def feed() -> None:
        start = time.monotonic()
        for k, c in enumerate(chunks):
            if speed > 0:
                # Like a streaming engine: chunk k is ready once its audio has been generated.
                due = start + (k + 1) * (chunk_ms / 1000) / speed
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            await utt.chunks.put(c)
            arrivals.append(time.monotonic())
        utt.chunks.close()

    base = sink._wpos
    feeder = asyncio.create_task(feed())
    report = await sink.play(utt, lambda at: None)
    await feeder
    starts, rpos, _ = sink.callback_trace()
    delays = []
    position = base
    for arrival, length in zip(arrivals, lengths, strict=True):
        handed = np.nonzero(rpos > position)[0]
        if len(handed):
            delays.append(1000 * (float(starts[handed[0]]) - arrival))
        position += length
    return {"delays_ms": delays, "underruns": report.underruns}


async def one_cancel(sink: SpeakerSink, seed: int) -> float:
    """Milliseconds from cancelling ``play`` to the callback dropping the buffer."""
    samples = (0.1 * np.random.default_rng(seed).standard_normal(3 * ENGINE_RATE)).astype(np.float32)
    request = SayRequest(id=f"cancel-{seed}", text="x", voice=None, language="auto", site_id="bench")
    utt = Utterance(request, ENGINE_RATE, Channel(64, Overflow.BLOCK, "bench.chunks"))
    for i in range(0, len(samples), 7680):
        utt.chunks.put_nowait(samples[i : i + 7680])
    utt.chunks.close()
    play = asyncio.create_task(sink.play(utt, lambda at: None))
    await asyncio.sleep(0.5 + 0.01 * seed)
    cancelled_at = time.monotonic()
    play.cancel()
    await asyncio.gather(play, return_exceptions=True)
    return 1000 * (sink._flush_at - cancelled_at)


async def run_period(args: argparse.Namespace, period_ms: float) -> dict[str, Any]:
    config = AudioConfig(sink="speaker", device=args.device, latency_ms=args.latency_ms)
    sink = SpeakerSink(config, period_ms=period_ms)
    await sink.open()
    try:
        firsts: list[float] = []
        later: list[float] = []
        underruns = 0
        for i in range(args.utterances):
            result = await one_utterance(sink, args.seconds, args.chunk_ms, args.speed, seed=i)
            firsts.append(result["delays_ms"][0])
            later.extend(result["delays_ms"][1:])
            underruns += result["underruns"]
            await asyncio.sleep(0.2)
        flushes = [await one_cancel(sink, seed) for seed in range(args.utterances)]
        stats = sink.stats()
    finally:
        await sink.close()
    return {
        "period_ms": period_ms,
        "device": stats.device,
        "rate_hz": stats.rate_hz,
        "output_latency_ms": round(stats.output_latency_ms, 1),
        "first_chunk_delay_ms": percentiles(firsts, ndigits=2),
        "later_chunk_delay_ms": percentiles(later, ndigits=2),
        "cancel_to_flush_ms": percentiles(flushes, ndigits=2),
        "callback_ms": {
            "p50": round(stats.callback_p50_ms, 3),
            "p99": round(stats.callback_p99_ms, 3),
            "max": round(stats.callback_max_ms, 3),
        },
        "callback_p99_over_period": round(stats.callback_p99_ms / period_ms, 4),
        "underruns": underruns,
        "xruns": stats.xruns,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await run_period(args, float(p)) for p in args.periods.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="output device name or index (default: system default)")
    parser.add_argument("--pulse", action="store_true", help="start a private PulseAudio null sink and use it")
    parser.add_argument("--periods", default="10,20", help="callback periods to try, ms, comma separated")
    parser.add_argument("--latency-ms", type=float, default=80.0, help="audio.latency_ms (prebuffer)")
    parser.add_argument("--chunk-ms", type=float, default=320.0, help="engine chunk (4 codec frames = 320 ms)")
    parser.add_argument("--speed", type=float, default=1.5, help="engine speed, x real time (0: instant)")
    parser.add_argument("--seconds", type=float, default=3.0, help="audio per utterance")
    parser.add_argument("--utterances", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    add_doc_arguments(parser, "audio")
    args = parser.parse_args()
    doc = doc_target(args)
    server = None
    try:
        if args.pulse:
            from tests.support.pulse import PulseServer

            server = PulseServer(Path(tempfile.mkdtemp(prefix="bench-pulse-")))
            server.start()
            context = server.activated()
            context.__enter__()
            args.device = args.device or "pulse"
        results = asyncio.run(main_async(args))
    finally:
        if server is not None:
            server.stop()
    if doc is not None:
        publish(doc, args, results)
    if args.json:
        sys.stdout.write(json.dumps(results, indent=2) + "\n")
        return 0
    sys.stdout.write(machine_line() + "\n")
    sys.stdout.write(
        f"chunks of {args.chunk_ms:.0f} ms at {args.speed}x real time, prebuffer {args.latency_ms:.0f} ms, "
        f"{args.utterances} utterances of {args.seconds:.1f} s\n"
    )
    for r in results:
        sys.stdout.write(
            f"period {r['period_ms']:>4.0f} ms  device {r['device']} @ {r['rate_hz']} Hz  "
            f"(output latency {r['output_latency_ms']} ms)\n"
            f"  first chunk -> device: {r['first_chunk_delay_ms']} ms\n"
            f"  later chunks -> device: {r['later_chunk_delay_ms']} ms\n"
            f"  cancel -> buffer flushed: {r['cancel_to_flush_ms']} ms\n"
            f"  callback: {r['callback_ms']} ms; p99/period = {r['callback_p99_over_period']}; "
            f"underruns {r['underruns']}, xruns {r['xruns']}\n"
        )
    return 0


def publish(doc: DocTarget, args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    def spread(figures: dict[str, float], *keys: str) -> str:
        return " / ".join(f"{figures[k]:.1f}" for k in keys) if figures else "-"

    rows = [
        [
            f"{r['period_ms']:.0f}",
            f"{r['device']} @ {r['rate_hz']} Hz",
            r["output_latency_ms"],
            spread(r["first_chunk_delay_ms"], "p50", "p99", "max"),
            spread(r["later_chunk_delay_ms"], "p50", "p99", "max"),
            spread(r["cancel_to_flush_ms"], "p50", "p99", "max"),
            " / ".join(f"{r['callback_ms'][k]:.3f}" for k in ("p50", "p99", "max")),
            r["callback_p99_over_period"],
            r["underruns"],
            r["xruns"],
        ]
        for r in results
    ]
    header = ["period ms", "device", "output latency ms", "first chunk -> device ms", "later chunks -> device ms",
              "cancel -> flushed ms", "callback ms", "callback p99 / period", "underruns", "xruns"]  # fmt: skip
    doc.publish(
        "The speaker sink: chunk to device, cancel to flush, callback cost",
        markdown_table(header, rows, "rlrrrrrrrr"),
        f"Chunks of {args.chunk_ms:.0f} ms arriving at {args.speed}x real time, prebuffer {args.latency_ms:.0f} ms,"
        f" {args.utterances} utterances of {args.seconds:.1f} s per period; p50 / p99 / max.",
    )


if __name__ == "__main__":
    raise SystemExit(main())
