"""OpenMP's wait in the daemon: ours (``GOMP_SPINCOUNT=3000``, what ``s2s-daemon`` sets) beside
the passive wait and libgomp's own spin, in one run, the daemon as a subprocess (the real CLI, a
real mosquitto, the discard sink, ``tts.torch.threads: auto``, so the CPU watch is at work).

Three conditions per daemon, frames per second of synthesis from each request's
``metrics/latency`` (``audioMs``/``synthMs``):

- ``quiet``: ``--runs`` requests one after another;
- ``arrives``: one request published the moment a busy process starts beside it (one per core but
  one): what a wait costs until the engine's watch has it run fewer threads;
- ``busy``: ``--runs`` requests after the neighbours have run ``SETTLE_S``.

Variants alternate within each round, so that the machine's drift hits all alike; the table gives
medians over the rounds. ``scripts/bench_threads.py`` measures the engine alone with the thread
count fixed; this one measures what a user's daemon does.

Usage: .venv/bin/python scripts/bench_waits.py --model /tmp/cv06 [--rounds 2] [--runs 3] [--doc]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_shipped as shipped  # noqa: E402

from s2s_daemon.bench.machine import machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table  # noqa: E402
from s2s_daemon.tts.threads import SPIN_COUNT  # noqa: E402
from tests.support.load import busy_neighbours  # noqa: E402

VARIANTS = {
    f"ours (spin {SPIN_COUNT})": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "libgomp's spin": {"GOMP_SPINCOUNT": "300000"},
}
CONDITIONS = ("quiet", "arrives", "busy")
SETTLE_S = 6.0
"""After the neighbours start, before the ``busy`` requests: the watch reads every second."""


async def one_daemon(
    workdir: Path, name: str, port: int, model: Path, frames: int, env: dict[str, str], runs: int, timeout_s: float
) -> dict[str, list[float]]:
    sections = shipped.engine_sections(model, frames, {"sink": "discard"})
    async with shipped.running(workdir, name, port, sections, env) as (_, rec):
        quiet = await shipped.speeds(rec, "quiet", runs, timeout_s)
        with busy_neighbours(shipped.NEIGHBOURS):
            arrives = await shipped.speeds(rec, "arrives", 1, timeout_s)
            await asyncio.sleep(SETTLE_S)
            busy = await shipped.speeds(rec, "busy", runs, timeout_s)
    return {"quiet": quiet, "arrives": arrives, "busy": busy}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a 0.6B checkpoint folder (random weights will do)")
    parser.add_argument("--frames", type=int, default=40, help="frames per 0.6B request")
    parser.add_argument("--tiny-frames", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="requests per condition (quiet, busy)")
    parser.add_argument("--timeout", type=float, default=600.0, help="longest wait for one request")
    parser.add_argument("--workdir", type=Path, default=None, help="keep configs and daemon logs here")
    add_doc_arguments(parser, "waits")
    args = parser.parse_args()
    doc = doc_target(args)
    models = (("tiny", shipped.TINY, args.tiny_frames), ("0.6B", args.model, args.frames))
    results: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-waits-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("S2S_PREPARED_CACHE", str(workdir / "prepared"))
        with shipped.broker_in(workdir) as broker:
            for round_ in range(args.rounds):
                for label, model, frames in models:
                    for variant, env in VARIANTS.items():
                        slug = "".join(ch for ch in variant.split()[0] if ch.isalnum())
                        name = f"{label}-{slug}-{round_}"
                        got = await one_daemon(workdir, name, broker.port, model, frames, env, args.runs, args.timeout)
                        for condition, values in got.items():
                            results.setdefault((label, variant, condition), []).extend(values)
                        shown = ", ".join(f"{c} {statistics.median(v):.2f}" for c, v in got.items())
                        print(f"  {label} {variant}: {shown}", file=sys.stderr)
    rows = []
    for label, _, _ in models:
        medians = {v: [statistics.median(results[(label, v, c)]) for c in CONDITIONS] for v in VARIANTS}
        ours = medians[next(iter(VARIANTS))]
        for variant, cells in medians.items():
            ratios = [f"{v / o:.2f}x" for v, o in zip(cells, ours, strict=True)]
            rows.append([label, variant, *(f"{v:.2f}" for v in cells), *ratios])
    header = ["model", "wait", *CONDITIONS, *(f"{c} / ours" for c in CONDITIONS)]
    print(machine_line(f"{shipped.NEIGHBOURS} busy process(es) beside", f"median of {args.rounds} rounds"))
    print(markdown_table(header, rows))
    if doc is not None:
        notes = (
            f"frames/s of synthesis in the daemon (threads auto, the discard sink), {args.rounds} rounds of"
            f" {args.runs} requests quiet and busy ({shipped.NEIGHBOURS} busy process(es), after {SETTLE_S:.0f} s)"
            " and one as they start (arrives); tiny: the tests' checkpoint, 0.6B: random weights, 0.6B shapes."
        )
        doc.publish("OpenMP's wait in the daemon", markdown_table(header, rows), notes)


if __name__ == "__main__":
    asyncio.run(main())
