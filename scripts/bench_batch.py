"""Several streams at once on the torch engine: decoded together (batched) against interleaved.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/qwen3_06b_cv --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_batch.py /tmp/qwen3_06b_cv [--format int8] [--frames 32] [--streams 1,2,4]

One process, one engine, loaded once. Each round runs, for every stream count N, N requests of
ten-word sentences (a different one and a different voice each) at once through ``EngineWorker.stream`` (the
daemon's path): first with the engine's batch (``max_batch`` 4: a frame of every stream per step,
their rows in one pass of the weights), then interleaved (``max_batch`` 1: each stream's
generator in turn on the one engine thread, as before batching). Random weights never say
end-of-speech, so every stream makes ``--frames`` frames; 4-frame chunks, greedy. Rounds
alternate the ways (this machine is noisy) and the best of ``--rounds`` is kept. ``--ways`` adds
the batch as it was before a change, each way a column group (its audio a second, the batch's over
it round by round as the median of the rounds' ratios, its first chunk mean and slowest, beside
the batch's):

- ``codec-thread``: every codec push on the codec's own thread (``CodecWorker.helping`` off: the
  engine thread waits for a push behind instead of decoding a waiting one of another stream);
- ``one-open-a-step``: streams opened (prefilled) one a step even when they came together
  (``Batch.open_together`` off), the streams opened before each making a frame in between.

Printed per N and way: ``wall_s`` (first request to last chunk), ``x_one`` (that over one
stream's wall time: the goal is 4 streams in at most 1.6x one), ``first_chunk_s`` (mean over the
streams), ``agg_rtf`` (seconds of audio made per second, all streams together; 1.0 is real
time), and beside them the talker and code predictor alone (``talker_ms_per_step``: one frame of
every stream, no codec), which is where batching saves, and the codec decoder alone
(``codec_ms_per_frame``: pushes of 4 frames), which each stream pays in full: its share of a step,
N codec frames over those and the talker's step, is the part batching leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_info
from s2s_daemon.bench.performance_page import DocTarget, add_doc_arguments, doc_target, markdown_table, ratio

TEXTS = (
    "The quick brown fox jumps over the lazy dog near the river.",
    "A gentle breeze moved across the quiet harbor this morning.",
    "Please turn off the lights in the kitchen and the hall.",
    "Dinner is ready in ten minutes, so come down soon.",
)
"""One per stream, each in its own voice; the prefix cache is emptied before every run, so no run
starts with its prompts kept from an earlier one."""
FORMATS = {
    "fp32": {"dtype": "float32", "quantization": "none"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
}
WAYS = ("batched", "interleaved", "codec-thread", "one-open-a-step")
EXTRA_WAYS = {
    "codec-thread": (
        "every push on the codec thread",
        "Every push on the codec thread (`CodecWorker.helping` off): the engine thread waits for a push behind"
        " instead of decoding a waiting one of another stream itself.",
    ),
    "one-open-a-step": (
        "one stream opened a step",
        "One stream opened a step (`Batch.open_together` off): streams that came together are prefilled one a"
        " step, the streams opened before each making a frame in between.",
    ),
}
"""The ways beside the batch and the interleaved streams, each the batch with one change undone: its
columns' label and the page's sentence on it."""
SAMPLES_PER_FRAME = 1920
SAMPLE_RATE = 24000


async def run_streams(worker: Any, requests: list[Any]) -> dict[str, float]:
    """Every request at once; wall time, mean first chunk, seconds of audio."""
    started = time.perf_counter()
    firsts: list[float] = []
    samples = 0

    async def one(request: Any) -> None:
        nonlocal samples
        first = True
        async for chunk in worker.stream(request, lambda: False):
            if first:
                firsts.append(time.perf_counter() - started)
                first = False
            samples += len(chunk)

    await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - started
    audio_s = samples / SAMPLE_RATE
    return {
        "wall_s": wall,
        "first_chunk_s": sum(firsts) / max(1, len(firsts)),
        "first_chunk_max_s": max(firsts, default=wall),
        "audio_s": audio_s,
    }


def talker_step_ms(engine: Any, requests: list[Any], steps: int) -> float:
    """ms per batched step of the talker + code predictor for these requests (no codec)."""
    import torch

    from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions

    runtime, gen = engine.runtime, engine.gen
    with torch.inference_mode():
        seqs = []
        for request in requests:
            prompt, _, _, _ = engine.prepare(request)
            seqs.append(runtime.start(prompt, DecodeOptions(max_frames=steps + 2, greedy=True, seed=None)))
        runtime.step_batch(seqs, gen)  # the first step (warm caches)
        started = time.perf_counter()
        for _ in range(steps):
            runtime.step_batch(seqs, gen)
        return 1000 * (time.perf_counter() - started) / steps


def codec_frame_ms(engine: Any, threads: int, chunk: int = 4, pushes: int = 6) -> float:
    """ms a frame of the codec decoder alone, at ``threads`` intra-op threads: the median of a stream's
    pushes of ``chunk`` random frames after a first one (which warms it)."""
    import statistics

    import torch

    cfg = engine.codec.cfg
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, cfg.codebook_size, (chunk * (pushes + 1), cfg.num_quantizers), generator=generator)
    torch.set_num_threads(threads)
    times = []
    with torch.inference_mode():
        stream = engine.codec.stream()
        stream.push(codes[:chunk])
        for k in range(1, pushes + 1):
            started = time.perf_counter()
            stream.push(codes[k * chunk : (k + 1) * chunk])
            times.append(1000 * (time.perf_counter() - started) / chunk)
    return statistics.median(times)


async def main_async(args: argparse.Namespace, ways: list[str], doc: DocTarget | None) -> int:
    from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine
    from s2s_daemon.tts.worker import EngineWorker

    fmt = FORMATS[args.format]
    extra = {"max_frames": str(args.frames)}
    if args.threads:
        extra["threads"] = str(args.threads)
    engine = TorchQwen3Engine(
        EngineOptions(
            model=args.model,
            device="cpu",
            dtype=fmt["dtype"],
            quantization=fmt["quantization"],
            kernels="native",
            extra=extra,
        )
    )
    import torch

    # Loaded, warmed and run on the worker's engine thread, as the daemon does: torch's intra-op
    # thread setting belongs to the thread that made it (a frame took 0.30-0.33 s on another
    # thread against 0.18-0.20 on the loading one, 2 threads, int8).
    worker = EngineWorker(engine)
    info = await worker.load()
    await worker.warmup()
    threads = await worker._call(torch.get_num_threads)
    voices: list[str | None] = list(info.voices) or [None]
    counts = [int(n) for n in args.streams.split(",")]
    requests = {
        n: [
            SynthesisRequest(
                text=TEXTS[i % len(TEXTS)],
                voice=voices[i % len(voices)],
                language="english",
                chunk_frames=4,
                greedy=True,
            )
            for i in range(n)
        ]
        for n in counts
    }
    machine = machine_info()
    print(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "cpu": machine["cpu"],
                "isa": machine["isa"],
                "cores": machine["logical_cores"],
                "threads": threads,
                "load_1min": round(machine["load_average"][0], 2) if machine["load_average"] else None,
                "format": args.format,
                "frames_per_stream": args.frames,
                "model": args.model,
            }
        )
    )
    best: dict[tuple[int, str], dict[str, float]] = {}
    rounds: dict[tuple[int, str], list[dict[str, float]]] = {}
    extra = [way for way in ways if way in EXTRA_WAYS]
    codec_worker = engine.codec_worker
    if "codec-thread" in ways and codec_worker is None:
        print("--ways codec-thread: the engine has no codec thread here (codec_overlap, threads)", file=sys.stderr)
        return 2
    for _ in range(args.rounds):
        for n in counts:
            for way in ways:
                engine.options.extra["max_batch"] = "1" if way == "interleaved" else "4"
                worker._batched = None  # the worker reads max_batch again
                if codec_worker is not None:
                    codec_worker.helping = way != "codec-thread"
                batch = worker._batch()  # made anew for max_batch (None: interleaved)
                if batch is not None:
                    batch.open_together = way != "one-open-a-step"
                if engine.runtime is not None and engine.runtime.prefixes is not None:
                    await worker._call(engine.runtime.prefixes.clear)
                result = await run_streams(worker, requests[n])
                key = (n, way)
                rounds.setdefault(key, []).append(result)
                if key not in best or result["wall_s"] < best[key]["wall_s"]:
                    best[key] = result
    steps = {n: await worker._call(functools.partial(talker_step_ms, engine, requests[n], 8)) for n in counts}
    codec_ms = await worker._call(functools.partial(codec_frame_ms, engine, threads))
    one = best[(counts[0], "batched")]["wall_s"] if counts[0] == 1 else None
    rows: list[list[object]] = []
    for n in counts:
        b, i = best[(n, "batched")], best[(n, "interleaved")]
        rows.append(
            [
                n,
                f"{b['wall_s']:.2f}",
                f"{i['wall_s']:.2f}",
                ratio(i["wall_s"], b["wall_s"]),
                ratio(b["wall_s"], one) if one else None,
                f"{b['first_chunk_s']:.2f}",
                f"{i['first_chunk_s']:.2f}",
                f"{b['audio_s'] / b['wall_s']:.3f}",
                f"{i['audio_s'] / i['wall_s']:.3f}",
                f"{steps[n]:.1f}",
                f"{codec_ms:.1f}",
                f"{n * codec_ms / (steps[n] + n * codec_ms):.0%}",
            ]
        )
        if extra:
            rows[-1].append(f"{b['first_chunk_s']:.2f} / {b['first_chunk_max_s']:.2f}")
        for way in extra:
            other = best[(n, way)]
            paired = [
                (h["audio_s"] / h["wall_s"]) / (c["audio_s"] / c["wall_s"])
                for h, c in zip(rounds[(n, "batched")], rounds[(n, way)], strict=True)
            ]
            rows[-1] += [
                f"{other['audio_s'] / other['wall_s']:.3f}",
                f"{statistics.median(paired):.2f}x",
                f"{other['first_chunk_s']:.2f} / {other['first_chunk_max_s']:.2f}",
            ]
    for n in counts:
        for way in ways:
            r = best[(n, way)]
            print(
                json.dumps(
                    {
                        "streams": n,
                        "way": way,
                        "wall_s": round(r["wall_s"], 2),
                        "x_one": round(r["wall_s"] / one, 2) if one else None,
                        "first_chunk_s": round(r["first_chunk_s"], 2),
                        "first_chunk_max_s": round(r["first_chunk_max_s"], 2),
                        "agg_rtf": round(r["audio_s"] / r["wall_s"], 3),
                        "talker_ms_per_step": round(steps[n], 1) if way == "batched" else None,
                        "codec_ms_per_frame": round(codec_ms, 1),
                    }
                )
            )
    await worker.close()
    if doc is not None:
        header = ["streams", "batched wall s", "interleaved wall s", "interleaved / batched", "batched / one stream",
                  "first chunk s, batched", "interleaved", "audio s per s, batched", "interleaved",
                  "talker ms a step, batched", "codec ms a frame", "codec's share of a step"]  # fmt: skip
        if extra:
            header.append("first chunk s, mean / slowest, batched")
        for way in extra:
            label = EXTRA_WAYS[way][0]
            header += [f"audio s per s, {label}", "batched / that, round by round",
                       f"first chunk s, mean / slowest, {label}"]  # fmt: skip
        doc.publish(
            "Several streams at once: batched against interleaved",
            markdown_table(header, rows, "r" * len(header)),
            f"Weights {args.format}, {threads} threads, {args.frames} frames a stream, 4-frame chunks, greedy;"
            f" best of {args.rounds} rounds alternating the ways. Batched: `max_batch` 4 (a frame of every"
            " stream per step); interleaved: `max_batch` 1. The goal: 4 streams in at most 1.6x one's wall time."
            f" The parts of a step, each alone at {threads} threads: the talker and code predictor for a frame of"
            " every stream (no codec), and the codec decoder's frame (pushes of 4 frames), which batching does not"
            " share: its share is N codec frames over those and the talker's step."
            + "".join(" " + EXTRA_WAYS[way][1] for way in extra),
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("model", help="checkpoint folder (e.g. a 0.6b random checkpoint from make_checkpoint)")
    parser.add_argument("--format", choices=sorted(FORMATS), default="int8")
    parser.add_argument("--frames", type=int, default=32, help="frames per stream")
    parser.add_argument("--streams", default="1,2,4", help="stream counts (start with 1 for the x_one column)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (default: the engine's choice)")
    parser.add_argument("--ways", default="batched,interleaved", help=f"comma-separated, of {', '.join(WAYS)}")
    add_doc_arguments(parser, "batch")
    args = parser.parse_args()
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if "batched" not in ways or "interleaved" not in ways or set(ways) - set(WAYS):
        parser.error(f"--ways: batched and interleaved, and of {', '.join(EXTRA_WAYS)} (got {args.ways!r})")
    return asyncio.run(main_async(args, ways, doc_target(args)))


if __name__ == "__main__":
    raise SystemExit(main())
