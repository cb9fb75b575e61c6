"""The codec decoder on the CPU as it runs now against two earlier forms, side by side in one
process: "blocked", every few-column GEMM of up to 64 rows on the native kernels (before
2 December 2026 08:10, when ``native_row_limit`` began to send those of more than 4 rows to the
BLAS where it is the faster); "oneDNN", that and the convs of many columns through oneDNN's
convolution on a contiguous copy of the weight (before 07:00, when they became one product per
tap).

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_codec.py ./cv06 [--threads 2] [--rounds 4] [--chunks 1,4]

Streams random codes through each form (native kernels on, as the engine loads them), one stream
per form with their pushes alternating so that the machine's drift falls on all alike: a 20-frame
warm start, then ``--pushes`` pushes of each chunk size. Prints milliseconds per frame, each
earlier form's ratio to now push by push, and how far its audio is from now's (largest
difference; signal-to-noise ratio in dB).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (or its speech_tokenizer folder)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunks", default="1,4", help="frames per push, comma-separated")
    parser.add_argument("--pushes", type=int, default=6, help="pushes timed per round, form and chunk size")
    add_doc_arguments(parser, "codec")
    args = parser.parse_args()
    doc = doc_target(args)

    import torch
    import torch.nn.functional as F

    from s2s_daemon.tts.torch_qwen3 import codec as codec_mod
    from s2s_daemon.tts.torch_qwen3 import native

    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    if (folder / "speech_tokenizer").is_dir():
        folder = folder / "speech_tokenizer"
    ext = native.load()
    if ext is None:
        print(f"no native kernels here ({native.unavailable_reason()}): nothing to compare")
        return 1
    decoders = {}
    for name in ("now", "blocked", "oneDNN"):
        decoder = codec_mod.CodecDecoder.from_folder(folder)
        native.pack_linears(decoder, "float32", ext)  # as the engine loads it
        decoder.use_native(ext)
        if name != "now":  # every few-row GEMM of up to 64 rows on the native kernels, as before
            for module in decoder.modules():
                if isinstance(module, (codec_mod.CausalConv1d, codec_mod.CausalConvTranspose1d)):
                    module.native_rows = int(ext.MAX_BLOCKED_ROWS)
                elif isinstance(module, native.PackedLinear):
                    module.max_rows = int(ext.MAX_BLOCKED_ROWS)
        decoders[name] = decoder
    print(machine_line(f"{args.threads} threads", f"{args.rounds} rounds"))

    taps_conv = codec_mod.CausalConv1d._conv
    dense = {}  # the weights oneDNN gets, contiguous as loaded before the tap-major layout
    for module in decoders["oneDNN"].modules():
        if isinstance(module, codec_mod.CausalConv1d) and module.weight_taps is not None:
            dense[id(module)] = module.conv.weight.detach().contiguous()

    def onednn_conv(self: codec_mod.CausalConv1d, padded: torch.Tensor) -> torch.Tensor:
        t = padded.shape[-1] - self.context
        weight = dense.get(id(self))
        if weight is None or (weight.shape[-1] > 1 and t <= codec_mod.GEMM_MAX_COLUMNS):
            return taps_conv(self, padded)
        c = self.conv
        return F.conv1d(padded, weight, c.bias, dilation=c.dilation, groups=c.groups)

    codec_mod.CausalConv1d._conv = onednn_conv  # type: ignore[method-assign]  # only the oneDNN form's convs differ
    first = next(iter(decoders))
    cfg = next(iter(decoders.values())).cfg
    rows: list[list[object]] = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        frames = 20 + chunk * args.pushes
        generator = torch.Generator().manual_seed(chunk)
        codes = torch.randint(0, cfg.codebook_size, (frames, cfg.num_quantizers), generator=generator)
        times: dict[str, list[float]] = {name: [] for name in decoders}
        audio: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            streams = {name: decoder.stream() for name, decoder in decoders.items()}
            pieces: dict[str, list[torch.Tensor]] = {name: [] for name in decoders}
            for i, n in [(0, 20)] + [(20 + k * chunk, chunk) for k in range(args.pushes)]:
                for name, stream in streams.items():
                    start = time.perf_counter()
                    pieces[name].append(stream.push(codes[i : i + n]))
                    if i:
                        times[name].append((time.perf_counter() - start) * 1000 / n)
            audio = {name: torch.cat(p) for name, p in pieces.items()}
        print(f"pushes of {chunk} frame{'s' if chunk > 1 else ''}:")
        ref = audio[first].double()
        for name, values in times.items():
            q = statistics.quantiles(values, n=4)
            line = (
                f"  {name:>7}: {statistics.median(values):6.1f} ms per frame"
                f" (quartiles {q[0]:.1f}-{q[2]:.1f}, least {min(values):.1f})"
            )
            row: list[object] = [chunk, name, f"{statistics.median(values):.1f}", f"{q[0]:.1f}-{q[2]:.1f}"]
            row += [f"{min(values):.1f}", None, None, None]
            if name != first:
                ratios = [b / a for a, b in zip(times[first], values, strict=True)]
                rq = statistics.quantiles(ratios, n=4)
                err = audio[name].double() - ref
                snr = 10 * math.log10(float(ref.pow(2).sum()) / max(float(err.pow(2).sum()), 1e-300))
                line += (
                    f"; / {first} push by push {statistics.median(ratios):.2f}x ({rq[0]:.2f}-{rq[2]:.2f});"
                    f" audio off by at most {float(err.abs().max()):.1e}, SNR {snr:.0f} dB"
                )
                row[5:] = [
                    f"{statistics.median(ratios):.2f}x ({rq[0]:.2f}-{rq[2]:.2f})",
                    f"{float(err.abs().max()):.1e}",
                    f"{snr:.0f}",
                ]
            print(line)
            rows.append(row)
    codec_mod.CausalConv1d._conv = taps_conv  # type: ignore[method-assign]
    if doc is not None:
        header = ["frames a push", "form", "ms a frame (median)", "quartiles", "least", f"/ {first} push by push",
                  "audio off by at most", "SNR dB"]  # fmt: skip
        doc.publish(
            "The codec decoder: now against its earlier forms",
            markdown_table(header, rows, "rlrrrrrr"),
            f"{args.threads} threads, {args.rounds} rounds of a 20-frame warm start then {args.pushes} pushes per"
            " chunk size, the forms' pushes alternating. blocked: every few-column GEMM of up to 64 rows on the"
            " native kernels; oneDNN: that and the convs of many columns through oneDNN's convolution.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
