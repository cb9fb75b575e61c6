"""Does the MLX engine add per-chunk cost on top of mlx-audio's own streaming?

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    .venv/bin/python scripts/bench_mlx_overhead.py [--model DIR] [--quantization 4bit] \\
        [--frames 8] [--chunk-frames 2] [--runs 5] [--json out.json]

Two measurements on one loaded engine (default: the committed tiny CustomVoice checkpoint):

1. End to end, interleaved A/B: the same seeded request through mlx-audio's
   ``model.generate(stream=True)`` directly ("raw") and through
   ``MlxQwen3Engine.synthesize_blocking`` ("engine"); the audio must be identical, so
   both did the same work. Per-chunk times are the gaps between successive chunks.
2. The wrapper alone: mlx-audio's generator replaced by one that hands out ready-made
   chunks, so what is left is the engine's own per-chunk work (stop checks, the
   float32 copy to numpy, the release after the utterance).

Prints one line per run and a summary; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from s2s_daemon.bench.machine import machine_line  # noqa: E402  (path set above)
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio  # noqa: E402
from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest  # noqa: E402
from s2s_daemon.tts.mlx_qwen3 import MlxQwen3Engine, chunk_interval_s  # noqa: E402


def _gaps(stream: Iterator[Any]) -> tuple[list[float], list[Any]]:
    """Seconds between successive chunks (the first from the call), and the chunks."""
    gaps: list[float] = []
    chunks: list[Any] = []
    last = time.perf_counter()
    for chunk in stream:
        now = time.perf_counter()
        gaps.append(now - last)
        chunks.append(chunk)
        last = now
    return gaps, chunks


def _raw(model: Any, request: SynthesisRequest, frames: int) -> tuple[list[float], np.ndarray]:
    import mlx.core as mx

    mx.random.seed(request.seed or 0)
    stream = model.generate(
        text=request.text,
        voice=(request.voice or "").lower() or None,
        lang_code=request.language,
        split_pattern="",
        stream=True,
        streaming_interval=chunk_interval_s(request.chunk_frames),
        max_tokens=frames,
        verbose=False,
    )
    gaps, results = _gaps(stream)
    mx.clear_cache()
    return gaps, np.concatenate([np.array(r.audio.astype(mx.float32)) for r in results])


def _wrapped(engine: MlxQwen3Engine, request: SynthesisRequest) -> tuple[list[float], np.ndarray]:
    gaps, chunks = _gaps(engine.synthesize_blocking(request, lambda: False))
    return gaps, np.concatenate(chunks)


def _wrapper_alone(engine: MlxQwen3Engine, request: SynthesisRequest, chunks: int, repeats: int) -> float:
    """Microseconds per chunk the engine spends around ready-made mlx-audio chunks."""
    import mlx.core as mx
    from mlx_audio.tts.models.qwen3_tts.qwen3_tts import Model

    samples = request.chunk_frames * 1920
    ready = [mx.random.uniform(-0.5, 0.5, (samples,)) for _ in range(chunks)]
    mx.eval(ready)

    class _Result:
        def __init__(self, audio: Any) -> None:
            self.audio = audio

    def canned(self: Any, **_: Any) -> Iterator[_Result]:
        for audio in ready:
            yield _Result(audio)

    original = Model.generate
    Model.generate = canned  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        for _ in range(repeats):
            for _chunk in engine.synthesize_blocking(request, lambda: False):
                pass
        elapsed = time.perf_counter() - started
    finally:
        Model.generate = original  # type: ignore[method-assign]
    return 1e6 * elapsed / (repeats * chunks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO / "tests/fixtures/qwen3_tiny/custom_voice"))
    parser.add_argument("--quantization", default="4bit")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--chunk-frames", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--voice", default="Ryan")
    parser.add_argument("--json", type=Path)
    add_doc_arguments(parser, "mlx-overhead")
    args = parser.parse_args()
    doc = doc_target(args)

    engine = MlxQwen3Engine(
        EngineOptions(model=args.model, quantization=args.quantization, extra={"max_frames": str(args.frames)})
    )
    info = engine.load_blocking()
    engine.warmup_blocking()
    model = engine.mlx_model
    print(machine_line(f"mlx {args.quantization}", f"{args.frames} frames", f"chunks of {args.chunk_frames}"))
    request = SynthesisRequest(
        text="Hello there, how are you today?",
        voice=args.voice if info.voices else None,
        language="english",
        chunk_frames=args.chunk_frames,
        seed=1234,
    )
    raw_totals: list[float] = []
    eng_totals: list[float] = []
    raw_chunk: list[float] = []
    eng_chunk: list[float] = []
    for run in range(args.runs):
        order = ("raw", "engine") if run % 2 == 0 else ("engine", "raw")
        audio: dict[str, np.ndarray] = {}
        for which in order:
            if which == "raw":
                gaps, audio["raw"] = _raw(model, request, args.frames)
                raw_totals.append(sum(gaps))
                raw_chunk.extend(gaps[1:])
            else:
                gaps, audio["engine"] = _wrapped(engine, request)
                eng_totals.append(sum(gaps))
                eng_chunk.extend(gaps[1:])
        same = np.array_equal(audio["raw"], audio["engine"])
        print(
            f"run {run}: raw {raw_totals[-1]:.3f} s, engine {eng_totals[-1]:.3f} s, "
            f"identical audio: {same}, chunks: {len(audio['raw']) // (args.chunk_frames * 1920)}"
        )
        if not same:
            raise SystemExit("raw and engine audio differ: the comparison is not like for like")
    # Per utterance and per chunk, from utterances of 4 and of 64 ready-made chunks.
    short_us = _wrapper_alone(engine, request, 4, repeats=100)
    long_us = _wrapper_alone(engine, request, 64, repeats=20)
    per_chunk_us = (64 * long_us - 4 * short_us) / 60
    per_utterance_us = 4 * (short_us - per_chunk_us)
    engine.close_blocking()
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "frames": args.frames,
        "chunk_frames": args.chunk_frames,
        "runs": args.runs,
        "raw_total_s_median": statistics.median(raw_totals),
        "engine_total_s_median": statistics.median(eng_totals),
        "raw_chunk_s_median": statistics.median(raw_chunk) if raw_chunk else None,
        "engine_chunk_s_median": statistics.median(eng_chunk) if eng_chunk else None,
        "wrapper_alone_us_per_chunk": per_chunk_us,
        "wrapper_alone_us_per_utterance": per_utterance_us,
        "chunk_audio_s": args.chunk_frames / 12.5,
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if doc is not None:
        raw_chunk_s, eng_chunk_s = result["raw_chunk_s_median"], result["engine_chunk_s_median"]
        rows = [
            ["utterance, s (median)", f"{result['raw_total_s_median']:.3f}", f"{result['engine_total_s_median']:.3f}",
             ratio(result["engine_total_s_median"], result["raw_total_s_median"], 3)],
            ["later chunk, s (median)", None if raw_chunk_s is None else f"{raw_chunk_s:.3f}",
             None if eng_chunk_s is None else f"{eng_chunk_s:.3f}", ratio(eng_chunk_s, raw_chunk_s, 3)],
        ]  # fmt: skip
        doc.publish(
            "The MLX engine's own cost on top of mlx-audio's streaming",
            markdown_table(["what", "mlx-audio directly", "through the engine", "engine / direct"], rows),
            f"Model `{args.model}`, {args.quantization}, {args.frames} frames, chunks of {args.chunk_frames} frames"
            f" ({result['chunk_audio_s']:.2f} s of audio), {args.runs} runs alternating, identical audio both ways."
            f" The wrapper alone, around ready-made chunks: {per_chunk_us:.1f} us a chunk and"
            f" {per_utterance_us:.1f} us an utterance.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
