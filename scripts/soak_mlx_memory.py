"""Memory over many utterances on the MLX engine: RSS and MLX's counters must stay flat.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    .venv/bin/python scripts/soak_mlx_memory.py [--utterances 200] [--frames 1] \\
        [--model DIR] [--quantization 4bit] [--stop-every 5] [--json out.json]

Each utterance uses another text, voice and seed; every ``--stop-every``-th one is
stopped after its first chunk (the path that must release the decoder's streaming
state). After each utterance it records the process RSS (psutil) and MLX's active
and peak memory (the figures of the memory event). The summary gives the RSS of the
first and last 20 utterances, the least-squares RSS slope in MiB per 100 utterances
after the first 20 (warm-up: allocator pools, lazily imported code), and the range of
MLX's active memory.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
from s2s_daemon.tts.mlx_qwen3 import MlxQwen3Engine

REPO = Path(__file__).resolve().parents[1]
TEXTS = (
    "Hello there.",
    "The kitchen timer is done.",
    "Good morning, it is seven o'clock.",
    "Rain is expected this afternoon.",
    "Your parcel has arrived at the door.",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO / "tests/fixtures/qwen3_tiny/custom_voice"))
    parser.add_argument("--quantization", default="4bit")
    parser.add_argument("--utterances", type=int, default=200)
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--stop-every", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    process = psutil.Process()
    engine = MlxQwen3Engine(
        EngineOptions(model=args.model, quantization=args.quantization, extra={"max_frames": str(args.frames)})
    )
    info = engine.load_blocking()
    voices = info.voices or (None,)
    rss: list[float] = []
    active: list[float] = []
    peak: list[float] = []
    started = time.perf_counter()
    for i in range(args.utterances):
        request = SynthesisRequest(
            text=TEXTS[i % len(TEXTS)],
            voice=voices[i % len(voices)],
            language="auto",
            chunk_frames=1,
            seed=i,
        )
        stop_early = args.stop_every > 0 and i % args.stop_every == args.stop_every - 1
        stop = threading.Event()
        for _chunk in engine.synthesize_blocking(request, stop.is_set):
            if stop_early:
                stop.set()
        memory = engine.memory_blocking()
        rss.append(process.memory_info().rss / 2**20)
        active.append(memory.allocated_mib)
        peak.append(memory.peak_mib)
        if i % 20 == 19:
            print(
                f"{i + 1:4d} utterances  rss {rss[-1]:8.1f} MiB  mlx active {active[-1]:6.2f} MiB  "
                f"mlx peak {peak[-1]:6.2f} MiB  {time.perf_counter() - started:6.0f} s",
                flush=True,
            )
    engine.close_blocking()
    after_warmup = np.array(rss[20:]) if len(rss) > 40 else np.array(rss)
    slope = float(np.polyfit(np.arange(len(after_warmup)), after_warmup, 1)[0]) * 100
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "utterances": args.utterances,
        "frames_per_utterance": args.frames,
        "rss_first20_mean_mib": float(np.mean(rss[:20])),
        "rss_last20_mean_mib": float(np.mean(rss[-20:])),
        "rss_max_mib": float(max(rss)),
        "rss_slope_mib_per_100_after_20": slope,
        "mlx_active_min_mib": float(min(active)),
        "mlx_active_max_mib": float(max(active)),
        "mlx_peak_max_mib": float(max(peak)),
        "seconds": time.perf_counter() - started,
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
