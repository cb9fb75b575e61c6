"""The codec on a thread of its own beside the talker (``codec_overlap: on``) against in line, in one process.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/lean/cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_overlap.py /tmp/lean/cv06 [--quantization int8] [--codec-dtype auto]
        [--threads 2] [--frames 40] [--chunk 4] [--rounds 4]

Loads the engine twice (overlap off, on; the same options otherwise) and synthesizes one sentence
with each in turn, ``--rounds`` times, greedy, ``--frames`` frames, chunks of ``--chunk``. Per run:
the first chunk's time, and the steady cost per frame past it (from the first chunk to the last,
over the frames after the first chunk). Prints the medians, overlap's ratio to in line run by run,
and whether the audio is the same (largest difference: none with the float32 decoder; with the
bfloat16 one a push on fewer threads may round a sum the other way). Run it on a quiet machine:
with a busy neighbour on one core, a thread per part makes the parts wait for each other. OpenMP
teams that spin while idle keep a core from the other part: it runs under the wait the daemon sets
(``tts/threads.py``: a short spin) unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set, to compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

TEXT = "Hello there, this is a short test of the speech synthesis system, spoken one word at a time."


def run(engine: Any, request: Any) -> tuple[float, float, Any]:
    """(first chunk s, steady s per frame, audio) of one synthesis."""
    import numpy as np

    start = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    chunks = []
    for chunk in engine.synthesize_blocking(request, lambda: False):
        stamps.append((time.perf_counter() - start, len(chunk)))
        chunks.append(chunk)
    first_s = stamps[0][0]
    later = sum(n for _, n in stamps[1:]) / 1920
    steady = (stamps[-1][0] - first_s) / later if later else float("nan")
    return first_s, steady, np.concatenate(chunks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--codec-dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    from s2s_daemon.bench.machine import machine_line
    from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table

    add_doc_arguments(parser, "overlap")
    args = parser.parse_args()
    doc = doc_target(args)

    import numpy as np

    from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

    engines = {}
    for name, overlap in (("in line", "off"), ("overlap", "on")):
        extra = {"threads": str(args.threads), "max_frames": str(args.frames), "codec_overlap": overlap,
                 "codec_dtype": args.codec_dtype}  # fmt: skip
        options = EngineOptions(model=args.model, device="cpu", dtype="float32", quantization=args.quantization,
                                kernels="native", extra=extra)  # fmt: skip
        engine = TorchQwen3Engine(options)
        info = engine.load_blocking()
        engine.warmup_blocking()
        engines[name] = engine
    from s2s_daemon.tts.threads import wait_policy

    policy = wait_policy()  # the daemon's short spin unless the environment sets a wait
    print(machine_line(f"{args.threads} threads", f"OpenMP wait {policy}", args.quantization,
                       f"codec {args.codec_dtype}", f"{args.frames} frames, chunks of {args.chunk}",
                       f"{args.rounds} rounds"))  # fmt: skip
    request = SynthesisRequest(text=TEXT, voice=info.voices[0] if info.voices else None, language="english",
                               greedy=True, chunk_frames=args.chunk)  # fmt: skip
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    audio: dict[str, Any] = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            first_s, steady, audio[name] = run(engine, request)
            rows[name].append((first_s, steady))
    table: list[list[object]] = []
    for name, values in rows.items():
        first = statistics.median(v[0] for v in values)
        steady = statistics.median(v[1] for v in values)
        line = f"{name:>8}: first chunk {first * 1000:7.1f} ms, steady {steady * 1000:6.1f} ms per frame"
        ratio_cell = None
        if name != "in line":
            ratio = statistics.median(b[1] / a[1] for a, b in zip(rows["in line"], values, strict=True))
            line += f"; steady / in line run by run {ratio:.2f}x"
            ratio_cell = f"{ratio:.2f}x"
        print(line)
        table.append([name, f"{first * 1000:.1f}", f"{steady * 1000:.1f}", ratio_cell])
    a, b = audio["in line"], audio["overlap"]
    if a.shape != b.shape:
        print(f"audio: {b.shape} samples with the overlap, {a.shape} in line")
    else:
        import torch

        from s2s_daemon.tts.torch_qwen3 import quality

        same = quality.compare(torch.from_numpy(a), torch.from_numpy(b))
        print(f"audio: largest difference between the two {float(np.abs(a - b).max()):.1e}; {same}")
    if doc is not None:
        header = ["codec", "first chunk ms", "steady ms a frame", "steady / in line, run by run"]
        notes = f"{args.threads} threads, {args.quantization}, codec {args.codec_dtype}, {args.frames} frames in"
        notes += f" chunks of {args.chunk}, median of {args.rounds} rounds; OpenMP wait {policy}."
        doc.publish("The codec beside the talker (codec_overlap)", markdown_table(header, table, "lrrr"), notes)
    for engine in engines.values():
        engine.close_blocking()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
