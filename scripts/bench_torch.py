"""Benchmark the torch engine per weight format: frames per second, time to first chunk, peak RSS.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/qwen3_06b_cv --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_torch.py /tmp/qwen3_06b_cv [--formats fp32,int8,int4,fp32-torch] [--frames 24]

Each format runs in its own subprocess so its peak RSS is its own. Per format it loads the
engine, warms up (2 frames), then synthesizes a ten-word sentence with a fixed frame count
(random weights never say end-of-speech) in 4-frame chunks, greedy:

- ``ttfa_ms``: from the synthesize call to a first chunk of 4 frames (prefill + 4 frames + decode);
  ``ttfa1_ms`` the same with a one-frame first chunk (``first_chunk_frames: "1"``, the default);
  ``ttfa1_streamed_ms`` that with the text fed step by step (``text_streaming: "1"``); these three
  with no prompt kept (the prefix cache emptied first, ``runtime.PrefixCache``);
- ``ttfa1_voice_ms``: ``ttfa1_ms`` for the sentence right after another one in the same voice (its
  first positions kept: the daemon's usual case); ``ttfa1_again_ms``: the same sentence again;
- ``prefill_ms``: the talker's prefill of the sentence's prompt, none kept; ``codec_ms_per_frame``: the codec
  decoder per frame in a 4-frame chunk (its second, so its state is warm);
- ``audio_fps``: codec frames per second of the whole stream, codec decoding included
  (real time is 12.5);
- ``talker_fps``: frames per second of the talker + code predictor alone (no codec), the prompt's
  prefill included (``ms_per_frame`` is its inverse); ``steady_ms``: past the prefill, what
  ``floor_ms`` bounds: the time of the ``--frames`` frames less that of a third of them, per frame
  between (both runs with no prompt kept);
- ``audio_ms_per_frame`` beside ``qwentts_cpp_ms``: our time per frame with audio decoding and
  qwentts.cpp's for the matching GGML format (F32, BF16, Q8_0, Q4_K_M; quoted from ../shared/PEERS.md);
- ``peak_rss_mib``: the child's maximum resident set;
- ``floor_ms``: bytes of weights one frame reads (talker layers + codec head once, predictor
  layers + one head per codebook 1..15) divided by the measured read bandwidth: the fastest a
  frame could be if matrix-vector products ran at memory speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line, read_bandwidth_gbs
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio

TEXT = "The quick brown fox jumps over the lazy dog near the river."
OTHER_TEXT = "A gentle breeze moved across the quiet harbor this morning."
"""Spoken before ``TEXT`` in the same voice for ``ttfa1_voice_ms``."""
FORMATS = {
    "fp32": {"dtype": "float32", "quantization": "none", "kernels": "native"},
    "bf16": {"dtype": "bfloat16", "quantization": "none", "kernels": "native"},
    "int8": {"dtype": "float32", "quantization": "int8", "kernels": "native"},
    "int4": {"dtype": "float32", "quantization": "int4", "kernels": "native"},
    "fp32-torch": {"dtype": "float32", "quantization": "none", "kernels": "torch"},
    "bf16-torch": {"dtype": "bfloat16", "quantization": "none", "kernels": "torch"},
    "int8-torch": {"dtype": "float32", "quantization": "int8", "kernels": "torch"},
}
"""``fmt-torch``: torch's own kernels (FBGEMM for int8) instead of the native ones."""

QWENTTS_CPP_MS = {"fp32": 433, "bf16": 344, "int8": 312, "int4": 291}
"""qwentts.cpp (GGML) on a random 0.6B CustomVoice checkpoint, 2 threads, ms per frame with audio
decoding (F32, BF16, Q8_0, Q4_K_M; the mean of two runs), from ../shared/PEERS.md: measured
2026-12-01 on this project's machine kind (2-core AMD EPYC, AVX2) with the PyPI wheel
realtimetts-qwen-native-cpu 0.4.2, interleaved with our engine at 1eeef62. Its GGUF files need
qwentts.cpp's converter, which no registry carries, so it is quoted here, not run."""


def quoted_peer_ms(model: str, fmt: str) -> float | None:
    """``QWENTTS_CPP_MS`` for ``fmt`` where ``model`` is a 0.6B (``tts_model_size`` of its
    config.json): the quotes are of the 0.6B, and beside a 1.7B they would compare two models."""
    try:
        size = json.loads((Path(model) / "config.json").read_text(encoding="utf-8")).get("tts_model_size")
    except (OSError, ValueError):
        return None
    return QWENTTS_CPP_MS.get(fmt) if size == "0b6" else None


def weight_bytes_per_frame(engine: Any) -> int:
    """Bytes of weights read to produce one frame."""
    from torch import nn

    from s2s_daemon.tts.torch_qwen3.native import PackedLinear
    from s2s_daemon.tts.torch_qwen3.quant import Int8Linear

    def size(module: nn.Module) -> int:
        total = 0
        for m in module.modules():
            if isinstance(m, (Int8Linear, PackedLinear)):
                total += m.weight_bytes
            else:
                total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        return total

    talker = engine.runtime.talker
    cp = talker.code_predictor
    groups = engine.runtime.groups
    per_frame = size(talker.model.layers) + size(talker.codec_head)
    per_group = size(cp.model.layers) + size(cp.small_to_mtp_projection) + size(cp.lm_head[0])
    return per_frame + (int(groups) - 1) * per_group


def split_ms(engine: Any, request: Any, codes: Any) -> tuple[float, float]:
    """(seconds of the prompt's prefill, seconds per frame of the codec decoder in 4-frame chunks)."""
    import torch

    from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions

    with torch.inference_mode():
        prompt = engine.prepare(request)[0]
        if engine.runtime.prefixes is not None:
            engine.runtime.prefixes.clear()  # the whole prompt, none of it kept
        t0 = time.perf_counter()
        engine.runtime.start(prompt, DecodeOptions(max_frames=codes.shape[0], greedy=True, seed=None))
        prefill = time.perf_counter() - t0
        stream = engine.codec.stream()
        chunk = codes[4:8]
        if len(chunk) == 4:
            stream.push(codes[:4])
        else:  # fewer than 8 frames (--frames): the first 4, cold
            chunk = codes[:4]
        t0 = time.perf_counter()
        stream.push(chunk)
        codec = (time.perf_counter() - t0) / max(1, len(chunk))
    return prefill, codec


def run_one(model: str, fmt: str, frames: int, threads: int) -> dict[str, Any]:
    import torch

    from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

    torch.set_num_threads(threads)
    opts = FORMATS[fmt]
    engine = TorchQwen3Engine(
        EngineOptions(
            model=model,
            device="cpu",
            dtype=opts["dtype"],
            quantization=opts["quantization"],
            kernels=opts["kernels"],
            extra={"max_frames": str(frames), "threads": str(threads), "first_chunk_frames": "4"},
        )
    )
    t0 = time.perf_counter()
    info = engine.load_blocking()
    load_s = time.perf_counter() - t0
    engine.warmup_blocking()
    request = SynthesisRequest(text=TEXT, voice=info.voices[0] if info.voices else None, language="english",
                               chunk_frames=4, greedy=True)  # fmt: skip
    prefixes = engine.runtime.prefixes if engine.runtime is not None else None

    def cold() -> None:
        """Forget the kept prompts (runtime.PrefixCache): the next prompt runs whole."""
        if prefixes is not None:
            prefixes.clear()

    def first_chunk_s(req: Any) -> float:
        t0 = time.perf_counter()
        for _chunk in engine.synthesize_blocking(req, lambda: False):
            break
        return time.perf_counter() - t0

    cold()
    t0 = time.perf_counter()
    first: float | None = None
    samples = 0
    for chunk in engine.synthesize_blocking(request, lambda: False):
        if first is None:
            first = time.perf_counter() - t0
        samples += len(chunk)
    total = time.perf_counter() - t0
    got_frames = samples // 1920
    # Time to a one-frame first chunk (tts.options.first_chunk_frames: "1"), the latency setting.
    engine.options.extra["first_chunk_frames"] = "1"
    cold()
    ttfa1 = first_chunk_s(request)
    # A new sentence in a voice that has spoken (the daemon's usual case): the prompt's first
    # positions (role, language and speaker tags) come from the prefix cache.
    cold()
    first_chunk_s(replace(request, text=OTHER_TEXT))
    ttfa1_voice = first_chunk_s(request)
    # The same sentence said again: all of the prompt but its last position is kept.
    ttfa1_again = first_chunk_s(request)
    # The text fed step by step (tts.options.text_streaming: "1"): a shorter prompt; cold.
    engine.options.extra["text_streaming"] = "1"
    cold()
    ttfa1_streamed = first_chunk_s(request)
    engine.options.extra.pop("text_streaming")
    engine.options.extra["first_chunk_frames"] = "4"
    cold()
    t0 = time.perf_counter()
    codes = engine.codes_blocking(request, max_frames=frames)
    talker_s = time.perf_counter() - t0
    cold()
    t0 = time.perf_counter()
    fewer = engine.codes_blocking(request, max_frames=max(1, frames // 3))
    fewer_s = time.perf_counter() - t0
    between = codes.shape[0] - fewer.shape[0]
    steady_s = (talker_s - fewer_s) / between if between > 0 else None
    prefill_s, codec_s = split_ms(engine, request, codes)
    bytes_per_frame = weight_bytes_per_frame(engine)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "format": fmt,
        "threads": threads,
        "load_s": round(load_s, 1),
        "frames": got_frames,
        "ttfa_ms": round(1000 * (first or 0.0), 0),
        "ttfa1_ms": round(1000 * ttfa1, 0),
        "ttfa1_voice_ms": round(1000 * ttfa1_voice, 0),
        "ttfa1_again_ms": round(1000 * ttfa1_again, 0),
        "ttfa1_streamed_ms": round(1000 * ttfa1_streamed, 0),
        "prefill_ms": round(1000 * prefill_s, 0),
        "codec_ms_per_frame": round(1000 * codec_s, 1),
        "audio_fps": round(got_frames / total, 2),
        "talker_fps": round(codes.shape[0] / talker_s, 2),
        "steady_ms": round(1000 * steady_s, 1) if steady_s else None,
        "peak_rss_mib": round(peak_kib / 1024, 0),
        "weight_mib_per_frame": round(bytes_per_frame / 2**20, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a 0.6b random checkpoint from make_checkpoint)")
    parser.add_argument("--formats", default="fp32,bf16,int8,int4,fp32-torch,int8-torch")
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_doc_arguments(parser, "torch")
    args = parser.parse_args()
    if args.child:
        from s2s_daemon.tts.threads import prepare_openmp

        prepare_openmp()  # the daemon's OpenMP wait, set before run_one imports torch
        print(json.dumps(run_one(args.model, args.child, args.frames, args.threads)))
        return 0
    doc = doc_target(args)
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"machine: {machine_line(f'threads {args.threads}', f'read bandwidth {bandwidth:.1f} GB/s')}")
    rows = []
    for fmt in args.formats.split(","):
        cmd = [sys.executable, str(Path(__file__).resolve()), args.model, "--child", fmt,
               "--frames", str(args.frames), "--threads", str(args.threads)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"{fmt}: failed (rc {proc.returncode})\n{proc.stderr[-2000:]}")
            continue
        row = json.loads(lines[-1])
        row["floor_ms"] = round(row["weight_mib_per_frame"] * 2**20 / (bandwidth * 1e9) * 1000, 1)
        row["ms_per_frame"] = round(1000 / row["talker_fps"], 1) if row["talker_fps"] else None
        row["audio_ms_per_frame"] = round(1000 / row["audio_fps"], 1) if row["audio_fps"] else None
        row["qwentts_cpp_ms"] = quoted_peer_ms(args.model, fmt)
        rows.append(row)
        print(json.dumps(row))
    print()
    header = ("format", "ttfa_ms", "ttfa1_ms", "ttfa1_voice_ms", "ttfa1_again_ms", "ttfa1_streamed_ms", "prefill_ms",
              "codec_ms_per_frame", "audio_fps", "audio_ms_per_frame", "qwentts_cpp_ms", "ms_per_frame",
              "steady_ms", "floor_ms", "weight_mib_per_frame", "peak_rss_mib", "load_s")  # fmt: skip
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row.get(h)) for h in header))
    if doc is not None:
        cells = [
            [row.get(h) for h in header] + [ratio(row["audio_ms_per_frame"], row["qwentts_cpp_ms"])] for row in rows
        ]
        doc.publish(
            "The torch engine per weight format",
            markdown_table([*header, "audio_ms_per_frame / qwentts_cpp_ms"], cells),
            f"Model `{args.model}`, {args.threads} threads, {args.frames} frames of a ten-word sentence in 4-frame"
            f" chunks, greedy, each format in its own process; read bandwidth {bandwidth:.1f} GB/s. ttfa: to a"
            " first chunk of 4 frames; ttfa1: of one frame (cold, after another sentence in the same voice,"
            " the same sentence again, the text streamed); audio_fps: codec frames a second with audio decoding"
            " (real time is 12.5); ms_per_frame: talker and code predictor alone, the prompt's prefill included;"
            " steady_ms: past the prefill (all frames less a third of them); floor_ms: the weights a frame"
            " reads over the read bandwidth. qwentts_cpp_ms: qwentts.cpp (GGML) on the 0.6B quoted from the"
            " project's peers notes (2026-12-01, a 2-core AMD EPYC with AVX2), not run here, and left empty for"
            " another model size (scripts/bench_peers.py runs it beside ours). Each child under the daemon's"
            " OpenMP wait and its other defaults (codec_dtype, codec_overlap).",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
