"""What keeping a cloned voice's decoded reference saves at first audio (torch engine, Base model).

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./base06 --size 0.6b --kind base
    .venv/bin/python scripts/bench_ref_stream.py ./base06 [--seconds 5] [--format int8] [--rounds 4]

With a transcript (ICL cloning) the codec decoder needs the reference's frames as left context
before the request's own. The engine decodes them once and keeps the decoder's state
(``engine.REF_STREAMS``); this times a request's first chunk with that state kept and with it
dropped (decoded again, as before it was kept), alternating in one process. The clone prompt (the
encoders' output) is in memory in both cases and the prefix cache is off, so only the reference's
decoding differs. The reference is a synthetic recording of ``--seconds`` seconds; random weights
make the codes' values meaningless but their decoding costs what real ones do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio


def write_reference(path: Path, seconds: float) -> None:
    import numpy as np

    t = np.arange(int(24000 * seconds)) / 24000
    tone = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    noise = 0.02 * np.random.default_rng(0).standard_normal(t.size)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(((tone + noise) * 32767).astype("<i2").tobytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Base checkpoint folder (e.g. a random 0.6B Base from make_checkpoint)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the reference recording")
    parser.add_argument("--format", default="int8", choices=["none", "int8", "int4"], help="quantization")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=4)
    add_doc_arguments(parser, "ref-stream")
    args = parser.parse_args()
    doc = doc_target(args)

    from s2s_daemon.bench.torch_cpu import cpu_engine
    from s2s_daemon.tts.engine import SynthesisRequest

    engine = cpu_engine(args.model, args.format, args.threads, max_frames="8", voice_cache="off", prefix_cache_rows="0")
    info = engine.info
    assert info is not None
    if info.mode != "base":
        raise SystemExit(f"{args.model} is a {info.mode} checkpoint: cloning needs a Base one")
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref.wav"
        write_reference(ref, args.seconds)
        request = SynthesisRequest(
            text="The quick brown fox jumps over the lazy dog near the river.",
            voice=None,
            language="english",
            chunk_frames=4,
            greedy=True,
            ref_audio=str(ref),
            ref_text="This is the reference recording of my voice.",
        )

        def first_chunk_ms() -> float:
            t0 = time.perf_counter()
            for _chunk in engine.synthesize_blocking(request, lambda: False):
                break
            return 1000 * (time.perf_counter() - t0)

        cold = first_chunk_ms()  # the encoders run and the reference is decoded
        times: dict[str, list[float]] = {"kept": [], "decoded again": []}
        for _ in range(args.rounds):
            times["kept"].append(first_chunk_ms())
            engine.ref_streams.clear()
            times["decoded again"].append(first_chunk_ms())
    print(machine_line(f"{args.threads} threads", args.format, f"a {args.seconds:g} s reference"))
    print(f"first request (encoders, reference decoded): first chunk {cold:.0f} ms")
    for case, values in times.items():
        print(
            f"reference state {case:>13}: first chunk median {statistics.median(values):.0f} ms "
            f"(min {min(values):.0f}, max {max(values):.0f})"
        )
    if doc is not None:
        kept = statistics.median(times["kept"])
        rows = [["first request (encoders, reference decoded)", f"{cold:.0f}", "-", "-", ratio(cold, kept)]]
        rows += [
            [f"reference state {case}", f"{statistics.median(v):.0f}", f"{min(v):.0f}", f"{max(v):.0f}",
             ratio(statistics.median(v), kept)]
            for case, v in times.items()
        ]  # fmt: skip
        doc.publish(
            "What keeping a cloned voice's decoded reference saves at first audio",
            markdown_table(["request", "first chunk ms (median)", "min", "max", "/ kept"], rows),
            f"Base checkpoint, weights {args.format}, {args.threads} threads, a {args.seconds:g} s synthetic"
            f" reference with a transcript (ICL), {args.rounds} rounds alternating; the clone prompt in memory and"
            " the prefix cache off, so only the reference's decoding differs.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
