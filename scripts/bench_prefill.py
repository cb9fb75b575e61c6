"""A new sentence's prefill on the native kernels: the talker's whole prompt in one call of the
native stack (its integer products on tiles of weight rows held in cache) beside the same stack
four positions a call (each weight streamed from memory again for every four positions, the way
prompts ran before), rounds alternating in one process; and each matrix of the talker's first
layer at the prompt's row count beside torch's float32 GEMM of the same weight dequantized.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv17 --size 1.7b --kind custom_voice
    .venv/bin/python scripts/bench_prefill.py ./cv17 [--formats int4,int8] [--threads 2] [--rounds 5]

The prefill is ``runtime.start`` of the benchmark sentence with no kept prompt (the prefix cache
emptied first): the talker's prompt into a fresh cache and its first logits. Medians of the rounds.
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
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio

WAYS = ("whole prompt a call", "4 positions a call")


def prefill_ms(engine: Any, prompt: Any, rows_a_call: int) -> float:
    """One prefill of ``prompt`` with the stack taking ``rows_a_call`` positions a call."""
    import torch

    from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions

    runtime = engine.runtime
    stack = runtime.talker.model.native
    kept = stack.max_rows
    stack.max_rows = rows_a_call
    try:
        with torch.inference_mode():
            runtime.prefixes.clear()
            t0 = time.perf_counter()
            runtime.start(prompt, DecodeOptions(max_frames=1, greedy=True, seed=None))
            return (time.perf_counter() - t0) * 1000
    finally:
        stack.max_rows = kept


def matrices(engine: Any, rows: int, rounds: int) -> list[tuple[str, int, int, float, float]]:
    """Per matrix of the talker's first layer: (name, out, in, our ms, torch float32 ms) with
    ``rows`` input rows, best of ``rounds``."""
    import torch

    layer: Any = engine.runtime.talker.model.layers[0]
    out = []
    for name, lin in (
        ("qkv", layer.self_attn.qkv_proj),
        ("o", layer.self_attn.o_proj),
        ("gate_up", layer.mlp.gate_up_proj),
        ("down", layer.mlp.down_proj),
    ):
        x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(rows))
        dense = lin.dequantized()

        def best(run: Any) -> float:
            run()
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1000)
            return min(times)

        with torch.inference_mode():
            ours = best(lambda lin=lin, x=x: lin(x))
            blas = best(lambda dense=dense, x=x: torch.mm(x, dense.t()))
        out.append((name, lin.out_features, lin.in_features, ours, blas))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 1.7B CustomVoice from make_checkpoint)")
    parser.add_argument("--formats", default="int4,int8", help="int8, int4 (comma-separated)")
    parser.add_argument(
        "--paths", default="auto", help="tts.torch.isa values side by side, comma-separated (e.g. amx,avx512)"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=5)
    add_doc_arguments(parser, "prefill")
    args = parser.parse_args()
    doc = doc_target(args)

    from s2s_daemon.bench.torch_cpu import cpu_engine, sentence_request

    paths = args.paths.split(",")
    print(machine_line(f"{args.threads} threads", f"{args.rounds} rounds", f"paths {args.paths}"))
    prefill_rows: list[list[Any]] = []
    matrix_rows: list[list[Any]] = []
    positions = 0
    for fmt in args.formats.split(","):
        engines = {path: cpu_engine(args.model, fmt, args.threads, isa=path) for path in paths}
        try:
            for path, engine in engines.items():
                if not engine.runtime.talker.model.native_prompt:  # type: ignore[union-attr]
                    raise SystemExit(f"{fmt} on {path}: the talker's prompt does not run on the native stack here")
            first = next(iter(engines.values()))
            prompt = first.prepare(sentence_request(first))[0]
            positions = prompt.prefill.shape[1]
            times: dict[tuple[str, str], list[float]] = {(p, w): [] for p in paths for w in WAYS}
            for _ in range(args.rounds):
                for path, engine in engines.items():
                    whole_rows = engine.runtime.talker.model.native.max_rows  # type: ignore[union-attr]
                    times[path, WAYS[0]].append(prefill_ms(engine, prompt, whole_rows))
                    times[path, WAYS[1]].append(prefill_ms(engine, prompt, 4))
            base = statistics.median(times[paths[0], WAYS[0]])
            for path, engine in engines.items():
                isa = engine.info.isa.split(" ")[0] if engine.info is not None and engine.info.isa else path
                whole, fours = (statistics.median(times[path, w]) for w in WAYS)
                print(f"{fmt} {isa}: prefill of {positions} positions: whole {whole:.0f} ms, 4 a call {fours:.0f} ms")
                prefill_rows.append(
                    [fmt, isa, positions, f"{whole:.0f}", f"{fours:.0f}", ratio(whole, fours), ratio(whole, base)]
                )
                for name, n, k, ours, blas in matrices(engine, positions, args.rounds):
                    gflops = 2 * n * k * positions / 1e6
                    print(f"  {name:8s} {n}x{k}: ours {ours:.2f} ms ({gflops / ours:.0f} GFLOP/s), torch {blas:.2f} ms")
                    cells = [f"{n} x {k}", f"{ours:.2f}", f"{gflops / ours:.0f}", f"{blas:.2f}", ratio(ours, blas)]
                    matrix_rows.append([fmt, isa, name, *cells])
        finally:
            for engine in engines.values():
                engine.close_blocking()
    if doc is not None:
        header = ["format", "path", "positions", "whole prompt a call, ms", "4 a call, ms", "whole / 4", "/ first path"]
        table = markdown_table(header, prefill_rows, align="llrrrrr")
        table += "\n\n" + markdown_table(
            ["format", "path", "matrix", "out x in", "ours, ms", "GFLOP/s", "torch float32, ms", "ours / torch"],
            matrix_rows,
            align="lllrrrrr",
        )
        doc.publish(
            "A new sentence's prefill on the native kernels",
            table,
            f"Model `{args.model}`, {args.threads} threads, the benchmark sentence's talker prompt ({positions}"
            f" positions), no prompt kept; medians of {args.rounds} rounds alternating the paths and the two ways."
            " Whole prompt a call: the native stack's integer products on tiles of weight rows held in cache (on"
            " `amx` on AMX's tiles, laid out with 16 weight rows to a register on `avx512`, 8 on `avx2`); 4 a call:"
            " the same stack streaming every weight again for each four positions. Below: each matrix of the"
            " talker's first layer with the prompt's rows, ours against torch's float32 GEMM of the weight"
            " dequantized (best of the rounds).",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
