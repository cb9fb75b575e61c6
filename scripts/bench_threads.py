"""How OpenMP's wait and the thread count hold up on a shared CPU: the torch engine alone (no
daemon), one process per measurement, frames per second of synthesis with audio.

For each checkpoint (``--models``), each condition (quiet; one busy process per core but one
beside it, each in a session of its own; a cgroup with a quota of one CPU, as root) and each wait
(``default``: libgomp's own spin, ``GOMP_SPINCOUNT=300000``; ``passive``: ``OMP_WAIT_POLICY=PASSIVE``;
``spin=N``: ``GOMP_SPINCOUNT=N``, the daemon's ``spin=3000``), the engine with every thread it
may use and with one (``--threads``), the count fixed: the daemon's watch, which lowers it beside
a busy process, is not at work here (``scripts/bench_shipped.py`` measures the daemon). Rounds
alternate the variants, so that the machine's drift hits all alike; the table gives the median of
the rounds, and each figure's share of the same row's quiet figure.

Usage: .venv/bin/python scripts/bench_threads.py --models tests/fixtures/qwen3_tiny/custom_voice,/tmp/cv06
       [--quantization int8] [--frames 60] [--rounds 3] [--waits default,passive,spin=1000]
       [--conditions quiet,busy,quota] [--threads 2,1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from s2s_daemon.bench.machine import machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table  # noqa: E402
from tests.support.load import CpuQuota, busy_neighbours  # noqa: E402

WORKER = r"""
import json, sys, time, logging
import structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine
model, quantization, threads, frames = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
engine = TorchQwen3Engine(EngineOptions(model=model, device="cpu", quantization=quantization,
                                        threads=threads, extra={"max_frames": str(frames)}))
engine.load_blocking()
engine.warmup_blocking()
request = SynthesisRequest(text="The quick brown fox jumps over the lazy dog near the river bank.",
                           voice=None, language="auto", greedy=True, seed=0, chunk_frames=4)
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
started = time.perf_counter()
samples = sum(len(chunk) for chunk in engine.synthesize_blocking(request, lambda: False))
print(json.dumps({"fps": samples / 1920 / (time.perf_counter() - started)}))
"""

WAITS = {"default": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def wait_env(name: str) -> dict[str, str]:
    if name.startswith("spin="):
        return {"GOMP_SPINCOUNT": name.removeprefix("spin=")}
    return WAITS[name]


def measure(model: str, quantization: str, threads: int, frames: int, env: dict[str, str], condition: str) -> float:
    """One process: load and warm up (not timed, and quiet), then the timed synthesis under ``condition``."""
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    full.update(env)
    full["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, model, quantization, str(threads), str(frames)],
        env=full,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the worker did not load")
        if condition == "busy":
            with busy_neighbours(max(1, (os.cpu_count() or 2) - 1)):
                time.sleep(1.0)
                proc.stdin.write("go\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
        elif condition == "quota":
            with CpuQuota(1.0, name=f"s2s-threads-{os.getpid()}") as quota:
                quota.add(proc.pid)
                proc.stdin.write("go\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
        else:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        return float(json.loads(line)["fps"])
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=str(REPO / "tests/fixtures/qwen3_tiny/custom_voice"))
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--waits", default="default,passive,spin=1000")
    parser.add_argument("--conditions", default="quiet,busy,quota", help="a subset of quiet,busy,quota")
    parser.add_argument("--threads", default=None, help="thread counts to run (default: every usable CPU, and 1)")
    add_doc_arguments(parser, "threads")
    args = parser.parse_args()
    doc = doc_target(args)
    cores = os.cpu_count() or 1
    most = cores if cores <= 2 else cores - 1
    wanted = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if "quiet" not in wanted:
        parser.error("--conditions needs quiet: the other figures are given as its share")
    quota_ok = CpuQuota.unavailable() is None
    conditions = [c for c in ("quiet", "busy", "quota") if c in wanted and (c != "quota" or quota_ok)]
    counts = sorted({int(t) for t in args.threads.split(",")} if args.threads else {most, 1}, reverse=True)
    waits = [w.strip() for w in args.waits.split(",") if w.strip()]
    results: dict[tuple[str, str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for model in args.models.split(","):
            for wait in waits:
                for threads in counts:
                    for condition in conditions:
                        fps = measure(model, args.quantization, threads, args.frames, wait_env(wait), condition)
                        results.setdefault((model, wait, threads, condition), []).append(fps)
                        print(f"  {Path(model).name} {wait} {threads} {condition}: {fps:.2f}", file=sys.stderr)
    print(machine_line(args.quantization, f"{args.frames} frames", f"median of {args.rounds} rounds"))
    print("frames/s of synthesis (share of the same row's quiet figure)")
    print(f"{'model':<14} {'wait':<10} {'threads':>7} " + " ".join(f"{c:>14}" for c in conditions))
    rows = []
    for model in args.models.split(","):
        for wait in waits:
            for threads in counts:
                quiet = statistics.median(results[(model, wait, threads, "quiet")])
                cells = []
                for condition in conditions:
                    value = statistics.median(results[(model, wait, threads, condition)])
                    cells.append(f"{value:.2f} ({100 * value / quiet:.0f}%)")
                rows.append([Path(model).name, wait, threads, *cells])
                print(f"{Path(model).name[:14]:<14} {wait:<10} {threads:>7} " + " ".join(f"{c:>14}" for c in cells))
    if doc is not None:
        table = markdown_table(["model", "wait", "threads", *conditions], rows)
        notes = f"{args.quantization}, {args.frames} frames, median of {args.rounds} rounds; frames/s (% of quiet)."
        doc.publish("OpenMP wait and threads on a shared CPU", table, notes)


if __name__ == "__main__":
    main()
