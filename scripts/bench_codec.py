"""The codec decoder's convs as one matrix product per tap against oneDNN's convolution, side by
side in one process.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_codec.py ./cv06 [--threads 2] [--rounds 6] [--chunk 4]

Streams random codes through the float32 decoder (native kernels on, as the engine runs it) in
pushes of ``--chunk`` frames after a 20-frame warm start, and prints milliseconds per frame with
the convs of many columns (the 300 Hz-24 kHz stages) run as products per tap (what the decoder
does) and as ``torch.nn.functional.conv1d`` on a contiguous copy of the weight (what it did
before), one stream per form with their pushes alternating; then the ratio push by push and the
largest difference between the two forms' audio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (or its speech_tokenizer folder)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=4, help="frames per push")
    parser.add_argument("--pushes", type=int, default=5, help="pushes timed per round and form")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from s2s_daemon.bench.report import machine_line
    from s2s_daemon.tts.torch_qwen3 import codec as codec_mod
    from s2s_daemon.tts.torch_qwen3 import native

    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    if (folder / "speech_tokenizer").is_dir():
        folder = folder / "speech_tokenizer"
    decoder = codec_mod.CodecDecoder.from_folder(folder)
    ext = native.load()
    if ext is not None:
        decoder.use_native(ext)
    print(machine_line(f"{args.threads} threads", f"{args.rounds} rounds", f"pushes of {args.chunk} frames"))

    taps_conv = codec_mod.CausalConv1d._conv
    dense = {}  # the weights oneDNN gets, contiguous as loaded before the tap-major layout
    for module in decoder.modules():
        if isinstance(module, codec_mod.CausalConv1d) and module.weight_taps is not None:
            dense[id(module)] = module.conv.weight.detach().contiguous()

    def onednn_conv(self: codec_mod.CausalConv1d, padded: torch.Tensor) -> torch.Tensor:
        t = padded.shape[-1] - self.context
        weight = dense.get(id(self))
        if weight is None or (weight.shape[-1] > 1 and t <= codec_mod.GEMM_MAX_COLUMNS):
            return taps_conv(self, padded)
        c = self.conv
        return F.conv1d(padded, weight, c.bias, dilation=c.dilation, groups=c.groups)

    forms = {"taps": taps_conv, "oneDNN": onednn_conv}
    frames = 20 + args.chunk * args.pushes
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, decoder.cfg.codebook_size, (frames, decoder.num_quantizers), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in forms}
    audio: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        # One stream per form, their pushes alternating: the machine's drift falls on both alike.
        streams = {name: decoder.stream() for name in forms}
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in forms}
        for i, n in [(0, 20)] + [(20 + k * args.chunk, args.chunk) for k in range(args.pushes)]:
            for name, form in forms.items():
                codec_mod.CausalConv1d._conv = form  # type: ignore[method-assign]
                start = time.perf_counter()
                pieces[name].append(streams[name].push(codes[i : i + n]))
                if i:
                    times[name].append((time.perf_counter() - start) * 1000 / n)
        audio = {name: torch.cat(p) for name, p in pieces.items()}
    codec_mod.CausalConv1d._conv = taps_conv  # type: ignore[method-assign]
    for name, values in times.items():
        q = statistics.quantiles(values, n=4)
        print(
            f"{name:>7}: {statistics.median(values):6.1f} ms per frame"
            f" (quartiles {q[0]:.1f}-{q[2]:.1f}, least {min(values):.1f})"
        )
    ratios = [b / a for a, b in zip(times["taps"], times["oneDNN"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    diff = float((audio["taps"] - audio["oneDNN"]).abs().max())
    print(
        f"oneDNN / taps, push by push: median {statistics.median(ratios):.2f}x (quartiles {q[0]:.2f}-{q[2]:.2f});"
        f" largest difference in the audio {diff:.2e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
