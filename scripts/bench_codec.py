"""The codec decoder on the CPU in several forms side by side in one process, pushes alternating:
time per frame and the quality guard of each form's audio against float32's.

Forms (``--forms``, comma-separated; the first is the reference the others are compared with):

- ``float32``: float32 weights, as the engine loads them with ``codec_dtype: float32``;
- ``bfloat16``: bfloat16 matrix weights with float32 activations (``codec_dtype: bfloat16``, what
  ``auto`` takes on a CPU with bfloat16 dot products): few-column products on the native kernels,
  many-column ones on oneDNN's bfloat16 dot products, the convs' weights in their plain layout,
  which oneDNN lays out for itself on every call;
- ``bfloat16-packed``: ``bfloat16`` with the convs on weights oneDNN laid out once, at load, for
  one frame's columns (``CodecDecoder.pack_onednn``), with ``--pack-threads`` threads in force
  (default ``--threads``): the engine's form until 2026-12-07. oneDNN's layout depends on the
  threads: ``--threads 1 --pack-threads 2`` is the codec's own thread beside the talker on two
  cores, or one thread on a busy machine, with the weights packed at the load's two;
- ``auto``: as the engine loads it under ``codec_dtype: auto``: the matrix dtype
  ``pick_codec_weights`` chooses here, the upsampler's ConvNeXt linears in int8
  (``int8_upsampler``);
- ``blocked``: float32 with every few-column GEMM of up to 64 rows on the native kernels (the form
  before ``native_row_limit`` sent those of more than 4 rows to the BLAS where it is the faster);
- ``oneDNN``: ``blocked`` with the convs of many columns through oneDNN's convolution on a
  contiguous copy of the weight (the form before they became one product per tap).

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_codec.py ./cv06 [--forms float32,bfloat16,auto] [--threads 2] [--rounds 4]
        [--chunks 1,4] [--pushes 6]
    ONEDNN_VERBOSE=1 .venv/bin/python scripts/bench_codec.py ./cv06 --rounds 1 --pushes 1   # what oneDNN runs

Streams random codes through each form (native kernels on, as the engine loads them), one stream
per form with their pushes alternating so that the machine's drift falls on all alike: a 20-frame
warm start, then ``--pushes`` pushes of each chunk size. Then ``--rounds`` x ``--pushes`` first
pushes of a new stream, one frame each (an utterance's first chunk, the state empty), forms
alternating. Prints milliseconds per frame, each form's ratio to the first push by push, and the
quality of its audio against the first form's
(``quality.compare``: SNR and mean log-mel difference, pass or FAIL against the guard's
thresholds). With a real checkpoint this is the guard on real weights. Run it on a quiet machine:
on a shared one the ratios still hold roughly (pushes alternate), the milliseconds do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table

FORMS = ("float32", "bfloat16", "bfloat16-packed", "auto", "blocked", "oneDNN")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (or its speech_tokenizer folder)")
    parser.add_argument("--forms", default="float32,bfloat16,auto", help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pack-threads", type=int, default=None, help="threads in force while bfloat16-packed packs")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunks", default="1,4", help="frames per push, comma-separated")
    parser.add_argument("--pushes", type=int, default=6, help="pushes timed per round, form and chunk size")
    add_doc_arguments(parser, "codec")
    args = parser.parse_args()
    doc = doc_target(args)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown or not forms:
        parser.error(f"--forms: unknown {unknown}; choose from {', '.join(FORMS)}")

    import torch
    import torch.nn.functional as F

    from s2s_daemon.tts.torch_qwen3 import codec as codec_mod
    from s2s_daemon.tts.torch_qwen3 import native, quality

    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    if (folder / "speech_tokenizer").is_dir():
        folder = folder / "speech_tokenizer"
    ext = native.load()
    if ext is None:
        print(f"no native kernels here ({native.unavailable_reason()}): nothing to compare")
        return 1
    auto, why = codec_mod.pick_codec_weights("auto", ext)
    print(machine_line(f"{args.threads} threads", f"{args.rounds} rounds"))
    print(f"auto: {str(auto).removeprefix('torch.')} ({why}); oneDNN bfloat16: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")  # fmt: skip
    decoders: dict[str, Any] = {}
    for name in forms:
        low = name.startswith("bfloat16") or (name == "auto" and auto == torch.bfloat16)
        weights = torch.bfloat16 if low else torch.float32
        decoder = codec_mod.CodecDecoder.from_folder(folder, "cpu", torch.float32, weights)
        decoder.prepare_native(ext, name == "auto" and codec_mod.int8_upsampler("auto", ext))  # as the engine does
        if name == "bfloat16-packed":
            torch.set_num_threads(args.pack_threads or args.threads)
            decoder.pack_onednn()
            torch.set_num_threads(args.threads)
        if name in ("blocked", "oneDNN"):  # every few-row GEMM of up to 64 rows on the native kernels
            for module in decoder.modules():
                if isinstance(module, (codec_mod.CausalConv1d, codec_mod.CausalConvTranspose1d)):
                    module.native_rows = int(ext.MAX_BLOCKED_ROWS)
                elif isinstance(module, native.PackedLinear):
                    module.max_rows = int(ext.MAX_BLOCKED_ROWS)
        decoders[name] = decoder

    taps_conv = codec_mod.CausalConv1d._conv
    dense = {}  # the weights oneDNN gets, contiguous as loaded before the tap-major layout
    if "oneDNN" in decoders:
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
    first = forms[0]
    cfg = decoders[first].cfg
    rows: list[list[object]] = []
    try:
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
            for name, values in times.items():
                q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
                line = (
                    f"  {name:>8}: {statistics.median(values):6.1f} ms per frame"
                    f" (quartiles {q[0]:.1f}-{q[2]:.1f}, least {min(values):.1f})"
                )
                row: list[object] = [chunk, name, f"{statistics.median(values):.1f}", f"{q[0]:.1f}-{q[2]:.1f}"]
                row += [f"{min(values):.1f}", None, None]
                if name != first:
                    ratios = [b / a for a, b in zip(times[first], values, strict=True)]
                    rq = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                    verdict = quality.compare(audio[first], audio[name])
                    line += f"; / {first} push by push {statistics.median(ratios):.2f}x ({rq[0]:.2f}-{rq[2]:.2f});"
                    line += f" audio {verdict}"
                    row[5:] = [f"{statistics.median(ratios):.2f}x ({rq[0]:.2f}-{rq[2]:.2f})", str(verdict)]
                print(line)
                rows.append(row)
        first_push(decoders, first, args, rows)
    finally:
        codec_mod.CausalConv1d._conv = taps_conv  # type: ignore[method-assign]
    guard = f"guard: SNR >= {quality.MIN_SNR_DB:.0f} dB and log-mel <= {quality.MAX_LOG_MEL_DB:.1f} dB against {first}"
    print(guard)
    bf16_convs = (
        "the convs' weights in their plain layout, which oneDNN lays out for itself on every call"
        f" (bfloat16-packed: on weights oneDNN laid out at load, with {args.pack_threads or args.threads}"
        " threads in force)"
        if codec_mod.LOW_CONV_ONEDNN
        else "the convs as products of stacked taps (oneDNN runs no bfloat16 convolution on this CPU)"
    )
    if doc is not None:
        header = ["frames a push", "form", "ms a frame (median)", "quartiles", "least", f"/ {first} push by push",
                  "audio against " + first]  # fmt: skip
        doc.publish(
            "The codec decoder: its forms side by side",
            markdown_table(header, rows, "rlrrrrl"),
            f"{args.threads} threads, {args.rounds} rounds of a 20-frame warm start then {args.pushes} pushes per"
            " chunk size, the forms' pushes alternating. bfloat16: the decoder's matrix weights in bfloat16,"
            f" activations in float32, {bf16_convs}; auto: as codec_dtype auto loads it here"
            f" ({str(auto).removeprefix('torch.')} with the upsampler's ConvNeXt linears in int8); blocked: every"
            " few-column GEMM of up to 64 rows"
            " on the native kernels; oneDNN: that and the convs of many columns through oneDNN's convolution;"
            f" first: a new stream's first push of one frame. {guard}.",
        )
    return 0


def first_push(decoders: dict[str, Any], first: str, args: argparse.Namespace, rows: list[list[object]]) -> None:
    """A new stream's first push of one frame per form, ``args.rounds * args.pushes`` times, forms
    alternating: milliseconds and each form's ratio to ``first``'s, push by push (no audio check:
    the streamed pushes above have it)."""
    import torch

    cfg = decoders[first].cfg
    generator = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(args.rounds * args.pushes):
        codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers), generator=generator)
        for name, decoder in decoders.items():
            stream = decoder.stream()
            start = time.perf_counter()
            stream.push(codes)
            times[name].append((time.perf_counter() - start) * 1000)
    print("a new stream's first push of 1 frame:")
    for name, values in times.items():
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        median, quartiles, least = f"{statistics.median(values):.1f}", f"{q[0]:.1f}-{q[2]:.1f}", f"{min(values):.1f}"
        line = f"  {name:>8}: {median:>6} ms (quartiles {quartiles}, least {least})"
        row: list[object] = ["first", name, median, quartiles, least, None, None]
        if name != first:
            ratios = [b / a for a, b in zip(times[first], values, strict=True)]
            rq = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            line += f"; / {first} push by push {statistics.median(ratios):.2f}x ({rq[0]:.2f}-{rq[2]:.2f})"
            row[5] = f"{statistics.median(ratios):.2f}x ({rq[0]:.2f}-{rq[2]:.2f})"
        print(line)
        rows.append(row)


if __name__ == "__main__":
    raise SystemExit(main())
