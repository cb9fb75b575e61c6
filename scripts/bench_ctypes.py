"""What driving the native kernels through ctypes costs: the old torch C++ extension (pybind11,
``at::parallel_for``) against the plain C library (``ctypes``, OpenMP), per frame on the 0.6B
shapes, side by side in one process.

    git show <revision before the library>:s2s_daemon/tts/torch_qwen3/native/linear.cpp > /tmp/linear.cpp
    .venv/bin/python scripts/bench_ctypes.py --old-source /tmp/linear.cpp [--format int8] [--threads 2]

The old extension is compiled here, once, with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja: this script's needs, not the daemon's). Both run the same packed tensors (the packing layout
is the same): random weights of the 0.6B talker (28 layers, hidden 1024, 16 heads and 8 key/value
heads of 128, intermediate 3072, the codec head 1024 -> 3072) and code predictor (5 such layers,
15 heads 1024 -> 2048). A frame is what decoding does per frame on these weights: one talker
position through its stack and the codec head, then 15 code predictor positions, each through its
stack and one head. Rounds alternate the two. Beside it, one call of a 64 x 64 product (one row),
the per-call cost alone, and a prompt's products (40 and 128 rows through the talker's gate/up
weight). The codec decoder is left out: its products are the same calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128
TALKER_LAYERS, PREDICTOR_LAYERS, GROUPS = 28, 5, 16
CODEC_VOCAB, PREDICTOR_VOCAB = 3072, 2048


def old_extension(source: Path) -> Any:
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp(prefix="s2s-old-ext-"))
    return load(
        name="s2s_qwen3_linear_old",
        sources=[str(source)],
        build_directory=str(folder),
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


class Model:
    """One set of packed weights (``native.PackedLinear``) and, for each implementation, its stacks
    and heads over them."""

    def __init__(self, fmt: str, kernels: Any) -> None:
        import torch

        from s2s_daemon.tts.torch_qwen3 import native

        self.fmt = fmt
        gen = torch.Generator().manual_seed(0)

        def linear(n: int, k: int) -> Any:
            layer = torch.nn.Linear(k, n, bias=False)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
            return native.PackedLinear(layer, fmt, kernels)

        def layer() -> tuple[Any, ...]:
            norms = [torch.ones(HIDDEN), torch.ones(HIDDEN), torch.ones(HEAD_DIM), torch.ones(HEAD_DIM)]
            return (
                linear(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
                linear(HIDDEN, HEADS * HEAD_DIM),
                linear(2 * INTER, HIDDEN),
                linear(HIDDEN, INTER),
                norms,
            )

        self.talker = [layer() for _ in range(TALKER_LAYERS)]
        self.predictor = [layer() for _ in range(PREDICTOR_LAYERS)]
        self.codec_head = linear(CODEC_VOCAB, HIDDEN)
        self.heads = [linear(PREDICTOR_VOCAB, HIDDEN) for _ in range(GROUPS - 1)]
        self.norm = torch.ones(HIDDEN)


def new_runner(model: Model, kernels: Any) -> Any:
    from s2s_daemon.tts.torch_qwen3.native import StackDims

    dims = StackDims(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1e-6)
    talker = kernels.stack(model.talker, model.norm, dims)
    predictor = kernels.stack(model.predictor, model.norm, dims)
    return talker, predictor, model.codec_head, model.heads


def old_runner(model: Model, ext: Any) -> Any:
    from s2s_daemon.tts.torch_qwen3.native import FORMATS

    code = FORMATS[model.fmt]

    def packed(lin: Any) -> Any:
        return ext.Packed(code, lin.data, lin.scales, lin.mins, lin.bias, lin.out_features, lin.in_features, lin.group)

    def stack(layers: list[tuple[Any, ...]]) -> Any:
        built = [ext.Layer(*(packed(lin) for lin in parts[:4]), *parts[4]) for parts in layers]
        return ext.Stack(built, model.norm, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1e-6)

    def head(lin: Any) -> Any:
        def run(x: Any) -> Any:
            return ext.linear(x, code, lin.data, lin.scales, lin.mins, lin.out_features, lin.group, lin.bias)

        return run

    return stack(model.talker), stack(model.predictor), head(model.codec_head), [head(h) for h in model.heads]


def frames_ms(runner: Any, frames: int) -> float:
    """ms a frame over ``frames`` frames, fresh caches."""
    import torch

    talker, predictor, codec_head, heads = runner
    length = max(frames, GROUPS) + 4
    k_t = torch.empty(TALKER_LAYERS, 1, KV_HEADS, length, HEAD_DIM)
    v_t = torch.empty_like(k_t)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * torch.linspace(0.001, 1.0, HEAD_DIM)[None, :]
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    x = torch.randn(1, 1, HIDDEN) * 0.1
    with torch.inference_mode():
        start = time.perf_counter()
        for pos in range(frames):
            h = talker.run(x, k_t, v_t, cos[pos : pos + 1], sin[pos : pos + 1], pos)
            codec_head(h[0])
            k_p = torch.empty(PREDICTOR_LAYERS, 1, KV_HEADS, GROUPS + 1, HEAD_DIM)
            v_p = torch.empty_like(k_p)
            for g in range(GROUPS - 1):
                hp = predictor.run(x, k_p, v_p, cos[g : g + 1], sin[g : g + 1], g)
                heads[g](hp[0])
        return (time.perf_counter() - start) * 1000 / frames


def call_us(fn: Any, x: Any, calls: int = 2000) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) * 1e6 / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-source", type=Path, required=True, help="the old extension's linear.cpp")
    parser.add_argument("--format", default="int8", choices=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    add_doc_arguments(parser, "ctypes")
    args = parser.parse_args()
    doc = doc_target(args)

    from s2s_daemon.tts.threads import prepare_openmp

    prepare_openmp()  # the daemon's OpenMP wait, before torch is imported
    import torch

    from s2s_daemon.tts.torch_qwen3 import native

    torch.set_num_threads(args.threads)
    kernels = native.load()
    if kernels is None:
        print(f"no native kernels here: {native.unavailable_reason()}")
        return 1
    print("compiling the old extension (this script only) ...", flush=True)
    ext = old_extension(args.old_source)
    print(machine_line(f"{args.threads} threads", f"{args.format}", f"{args.rounds} rounds",
                       f"new path {kernels.isa}"))  # fmt: skip
    model = Model(args.format, kernels)
    runners = {"old extension": old_runner(model, ext), f"ctypes library ({kernels.isa})": new_runner(model, kernels)}
    frame: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            frame[name].append(frames_ms(runner, args.frames))
    tiny = torch.nn.Linear(64, 64)
    packed = native.PackedLinear(tiny, args.format, kernels)
    x = torch.randn(1, 64)
    code = native.FORMATS[args.format]
    old_tiny = ext.Packed(code, packed.data, packed.scales, packed.mins, packed.bias, 64, 64, packed.group)
    # What each PackedLinear.forward calls: the old one ext.linear, the new one Kernels.apply.
    per_call = {
        "old extension": call_us(
            lambda v: ext.linear(v, code, packed.data, packed.scales, packed.mins, 64, packed.group, packed.bias), x
        ),
        "old extension, prebuilt handle": call_us(lambda v: old_tiny(v[0]), x),
        f"ctypes library ({kernels.isa})": call_us(lambda v: kernels.apply(packed.weight_struct, v), x),
    }
    # A prompt's products: 40 rows (the register-blocked product in the library) and 128 rows (4 MiB
    # blocks of widened weight rows, multiplied by at::mm in the old extension, torch.mm here).
    gate_up = model.talker[0][2]
    g = gate_up

    def old_product(v: Any) -> Any:
        return ext.linear(v, code, g.data, g.scales, g.mins, g.out_features, g.group, g.bias)

    prefill: dict[tuple[str, int], float] = {}
    for rows_in in (40, 128):
        xs = torch.randn(rows_in, HIDDEN)
        old_ms = [0.0] * args.rounds
        new_ms = [0.0] * args.rounds
        for r in range(args.rounds):
            old_ms[r] = call_us(old_product, xs, 20) / 1000
            new_ms[r] = call_us(lambda v: kernels.apply(gate_up.weight_struct, v), xs, 20) / 1000
        prefill["old extension", rows_in] = statistics.median(old_ms)
        prefill[f"ctypes library ({kernels.isa})", rows_in] = statistics.median(new_ms)
    base = statistics.median(frame["old extension"])
    rows = []
    for name, values in frame.items():
        ms = statistics.median(values)
        print(f"{name}: {ms:.1f} ms a frame (range {min(values):.1f}-{max(values):.1f}), {ratio(ms, base)} the old")
        rows.append([name, "frame", f"{ms:.1f} ms", f"{min(values):.1f}-{max(values):.1f}", ratio(ms, base)])
    old_us = per_call["old extension"]
    for name, us in per_call.items():
        print(f"{name}: {us:.1f} us a call of a 64 x 64 product (one row)")
        rows.append([name, "one 64 x 64 call", f"{us:.1f} us", "-", ratio(us, old_us)])
    for rows_in in (40, 128):
        old_ms = prefill["old extension", rows_in]
        for name in runners:
            ms = prefill[name, rows_in]
            print(f"{name}: {ms:.2f} ms for {rows_in} rows through the gate/up weight (6144 x 1024)")
            rows.append([name, f"{rows_in} prompt rows, 6144 x 1024", f"{ms:.2f} ms", "-", ratio(ms, old_ms)])
    if doc is not None:
        doc.publish(
            "The native kernels through ctypes against the old torch extension",
            markdown_table(["kernels", "what", "median", "range", "/ old extension"], rows, "llrrr"),
            f"Random {args.format} weights of the 0.6B shapes, {args.threads} threads, {args.frames} frames a round,"
            f" {args.rounds} rounds alternating; a frame is one talker position and the codec head, then 15 code"
            " predictor positions and one head each (no codec decoder). The same packed tensors for both.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
