"""Pipeline overhead and sustained intake rate, through a real mosquitto.

Runs the daemon as a subprocess with the zero-cost tone engine (tests/support) and the
discard sink, so what is measured is the daemon's own machinery:

1. overhead: requests sent one at a time; ``ttfaMs`` of the latency event is receipt ->
   first synthesized chunk back on the event loop (intake, parse, queue, engine-thread
   hop). With an engine that costs ~0, that is the pipeline's overhead. p50/p99.
2. throughput: N say requests published as fast as the client can (QoS 1, pipelined);
   every one must end with a tts/finished (accepted and completed, or rejected
   queue_full): none silently dropped. Prints requests per second from the first
   publish to the last tts/finished.

Usage: .venv/bin/python scripts/bench_intake.py [--requests 5000] [--samples 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from tests.support.broker import Mosquitto  # noqa: E402
from tests.support.daemon import DaemonProcess, write_config  # noqa: E402
from tests.support.mqtt import recorder  # noqa: E402

SAY = "s2s/kitchen/tts/say"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def overhead(port: int, samples: int) -> list[float]:
    async with recorder(port) as rec:
        await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 30)
        for i in range(samples):
            rid = f"o{i}"
            await rec.say(SAY, {"id": rid, "text": "hi"})
            await rec.wait_for(lambda rid=rid: any(p["id"] == rid for p in rec.payloads("/metrics/latency")))
        return [p["ttfaMs"] for p in rec.payloads("/metrics/latency") if p["id"].startswith("o")]


async def throughput(port: int, n: int) -> tuple[float, dict[str, int]]:
    async with recorder(port, subscribe=("s2s/kitchen/tts/finished",)) as rec:
        start = time.monotonic()
        batch = 200
        for base in range(0, n, batch):
            await asyncio.gather(
                *(rec.say(SAY, json.dumps({"id": f"t{i}", "text": "hi"})) for i in range(base, min(n, base + batch)))
            )
        await rec.wait_for(lambda: len(rec.on("/tts/finished")) >= n, 120)
        took = time.monotonic() - start
        outcome: dict[str, int] = {}
        seen = set()
        for p in rec.payloads("/tts/finished"):
            seen.add(p["id"])
            key = p["status"] if "error" not in p else f"{p['status']}:{p['error']['code']}"
            outcome[key] = outcome.get(key, 0) + 1
        assert len(seen) == n, f"{n - len(seen)} requests without tts/finished"
        return n / took, outcome


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--max-pending", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker = Mosquitto(work)
        broker.start()
        config = write_config(
            work / "d.yaml",
            broker.port,
            queue={"max_pending": args.max_pending, "dedup_window": 100_000},
            log={"level": "warning"},
            telemetry={"memory_interval_s": 60},
        )
        proc = DaemonProcess(config)
        proc.start()
        try:
            lat = await overhead(broker.port, args.samples)
            assert proc.proc is not None
            daemon = psutil.Process(proc.proc.pid)
            before = daemon.cpu_times()
            rate, outcome = await throughput(broker.port, args.requests)
            after = daemon.cpu_times()
            cpu_s = (after.user + after.system) - (before.user + before.system)
        finally:
            proc.signal(signal.SIGTERM)
            await proc.wait(30)
            broker.stop()
    print(f"machine: {__import__('os').cpu_count()} CPUs; daemon + mosquitto + client on loopback")
    print(f"overhead  receipt -> first chunk on the loop (zero-cost engine), {len(lat)} requests:")
    p50, p99 = statistics.median(lat), pct(lat, 99)
    print(f"          p50 {p50:.2f} ms   p99 {p99:.2f} ms   max {max(lat):.2f} ms   goal p99 < 5 ms")
    print(f"throughput {args.requests} say requests, max_pending {args.max_pending}:")
    print(f"          {rate:.0f} requests/s answered   {outcome}   goal >= 1000/s, none dropped")
    print(
        f"          daemon CPU {cpu_s:.2f} s for {args.requests} requests = {1000 * cpu_s / args.requests:.2f} ms each"
        f" ({args.requests / cpu_s:.0f} requests per daemon CPU-second; the client and broker share the same 2 cores)"
    )


if __name__ == "__main__":
    asyncio.run(main())
