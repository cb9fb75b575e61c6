"""One measured process of a peer runtime, for ``scripts/bench_peers.py``: qwentts.cpp (GGML, the
PyPI wheel realtimetts-qwen-native-cpu) or vox-tts. Runs in the peers' virtual environment
(``scripts/peers_prep.sh``: numpy and the peer's wheel, no torch, nothing of this project).

    SCRATCH/venv/bin/python scripts/peers_child.py ggml --talker T.gguf --codec C.gguf --frames 100
    SCRATCH/venv/bin/python scripts/peers_child.py vox --tmod SCRATCH/vox/model.tmod --frames 100

The protocol is ours' in ``bench_peers.py`` (``run_calls``): load (timed), three stream calls of the
same text, speaker and seed, and one line ``RESULT {json}`` with the load time, each call's chunk
arrivals ``[[seconds since the call, samples so far], ...]`` and ``ru_maxrss``:

1. ``cold``: 4 frames, the first call after loading;
2. ``first``: 4 frames, the first chunk one frame where the runtime lets us choose (the warm first
   chunk);
3. ``steady``: ``--frames`` frames in the runtime's usual chunks (its steady pace).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

FRAME_SAMPLES = 1920
"""Samples of one 80 ms codec frame at 24 kHz: what a vox-tts pull asks for at most."""
COLD_FRAMES = 4
FIRST_FRAMES = 4
Stream = Callable[[int, bool], Iterator[np.ndarray]]
"""``stream(frames, first_small)``: the audio chunks of one call, float32 mono at 24 kHz."""


def arrivals(chunks: Iterator[np.ndarray]) -> list[list[float]]:
    """``[[seconds since the call, samples so far], ...]``, one row per chunk; timed from this call."""
    rows: list[list[float]] = []
    samples = 0
    start = time.perf_counter()
    for chunk in chunks:
        samples += len(chunk)
        rows.append([round(time.perf_counter() - start, 4), samples])
    return rows


def run_calls(stream: Stream, frames: int) -> dict[str, list[list[float]]]:
    """The three calls of the protocol, each one's arrivals."""
    return {
        "cold": arrivals(stream(COLD_FRAMES, True)),
        "first": arrivals(stream(FIRST_FRAMES, True)),
        "steady": arrivals(stream(frames, False)),
    }


def peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def ggml(args: argparse.Namespace) -> dict[str, Any]:
    """qwentts.cpp through the wheel: ``QwenTTS(talker, codec, cpu_threads, cpu_stream_frames)``."""
    from importlib.metadata import version

    from qwentts_cpp_cpu import QwenTTS  # type: ignore[import-not-found]  # the peers venv only (peers_prep.sh)

    start = time.perf_counter()
    tts = QwenTTS(args.talker, args.codec, cpu_threads=args.threads, cpu_stream_frames=args.stream_frames)
    load_s = time.perf_counter() - start

    def stream(frames: int, first_small: bool) -> Iterator[np.ndarray]:
        # its streaming chunk is fixed at load (cpu_stream_frames): first_small cannot change it
        for chunk, _rate in tts.stream(text=args.text, speaker=args.speaker, lang=args.language, seed=args.seed,
                                       max_new_tokens=frames):  # fmt: skip
            yield chunk

    calls = run_calls(stream, args.frames)
    return {"runtime": "ggml", "version": version("realtimetts-qwen-native-cpu"), "load_s": round(load_s, 3),
            "calls": calls, "settings": {"cpu_stream_frames": args.stream_frames}}  # fmt: skip


def vox(args: argparse.Namespace) -> dict[str, Any]:
    """vox-tts: ``vox.Engine(tmod, "cpu", threads)``, a CustomVoice speaker, ``engine.stream``."""
    from importlib.metadata import version

    import vox as vox_tts  # type: ignore[import-not-found]  # the peers venv only (peers_prep.sh)

    start = time.perf_counter()
    engine = vox_tts.Engine(args.tmod, "cpu", args.threads)
    voice = engine.speaker_voice(args.speaker)
    load_s = time.perf_counter() - start

    def stream(frames: int, first_small: bool) -> Iterator[np.ndarray]:
        # one chunk size a call: the warm first-chunk call decodes frame by frame, the steady one in its default
        chunk_frames = 1 if first_small else args.chunk_frames
        yield from engine.stream(args.text, voice, seed=args.seed, max_frames=frames, chunk_frames=chunk_frames,
                                 language=args.language, chunk_samples=FRAME_SAMPLES)  # fmt: skip

    calls = run_calls(stream, args.frames)
    return {"runtime": "vox", "version": version("vox-tts"), "load_s": round(load_s, 3), "calls": calls,
            "settings": {"chunk_frames": args.chunk_frames}}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runtime", choices=("ggml", "vox"))
    parser.add_argument("--talker", help="GGML: the talker's GGUF file")
    parser.add_argument("--codec", help="GGML: the codec's GGUF file")
    parser.add_argument("--stream-frames", type=int, default=2, help="GGML: cpu_stream_frames (0, 1, 2 or 4)")
    parser.add_argument("--tmod", help="vox: the model built by python -m vox build")
    parser.add_argument("--chunk-frames", type=int, default=4, help="vox: frames per chunk of the steady call")
    parser.add_argument("--frames", type=int, required=True, help="frames of the steady call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", default="The quick brown fox jumps over the lazy dog near the river.")
    parser.add_argument("--speaker", default="ryan")
    parser.add_argument("--language", default="english")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    result = ggml(args) if args.runtime == "ggml" else vox(args)
    result["peak_rss_mib"] = peak_rss_mib()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
