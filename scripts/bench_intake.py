"""Pipeline overhead and sustained intake rate, through a real mosquitto.

Runs the daemon as a subprocess with the zero-cost tone engine (tests/support) and the
discard sink, so what is measured is the daemon's own machinery:

1. overhead: requests sent one at a time; ``ttfaMs`` of the latency event is receipt ->
   first synthesized chunk back on the event loop (intake, parse, queue, engine-thread
   hop). With an engine that costs ~0, that is the pipeline's overhead. p50/p99.
2. throughput: N say requests published as fast as the client can (QoS 1, pipelined);
   every one must end with a tts/finished (accepted and completed, or rejected
   queue_full): none silently dropped. Prints requests per second from the first
   publish to the last tts/finished. The load comes from mosquitto's own C clients
   (``mosquitto_pub -l``, ``mosquitto_sub``) by default, so the 2 cores go to the daemon
   and the broker rather than to a Python load generator; ``--client python`` uses an
   aiomqtt client instead (slower: it competes with the daemon for the same cores).

``--profile FILE`` samples the daemon with py-spy (if installed) during the throughput
phase, keeps its raw stacks (FILE with a .txt suffix, for flamegraph.pl or speedscope) and
prints the top functions by own time.

Usage: .venv/bin/python scripts/bench_intake.py [--requests 5000] [--samples 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from s2s_daemon.bench.machine import machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio  # noqa: E402
from s2s_daemon.bench.report import percentile  # noqa: E402
from tests.support.broker import Mosquitto  # noqa: E402
from tests.support.daemon import DaemonProcess, write_config  # noqa: E402
from tests.support.mqtt import recorder  # noqa: E402

SAY = "s2s/kitchen/tts/say"
FINISHED = "s2s/kitchen/tts/finished"


async def overhead(port: int, samples: int) -> list[float]:
    async with recorder(port) as rec:
        await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 30)
        for i in range(samples):
            rid = f"o{i}"
            await rec.say(SAY, {"id": rid, "text": "hi"})
            await rec.wait_for(lambda rid=rid: any(p["id"] == rid for p in rec.payloads("/metrics/latency")))
        return [p["ttfaMs"] for p in rec.payloads("/metrics/latency") if p["id"].startswith("o")]


def tally(finished: list[dict[str, Any]], n: int) -> dict[str, int]:
    outcome: dict[str, int] = {}
    seen = set()
    for p in finished:
        seen.add(p["id"])
        key = p["status"] if "error" not in p else f"{p['status']}:{p['error']['code']}"
        outcome[key] = outcome.get(key, 0) + 1
    assert len(seen) == n, f"{n - len(seen)} requests without tts/finished"
    assert len(finished) == n, f"{len(finished) - n} duplicate tts/finished"
    return outcome


async def throughput_c(port: int, n: int) -> tuple[float, dict[str, int]]:
    """mosquitto_pub -l publishes one request per stdin line; mosquitto_sub collects the answers."""
    common = ["-h", "127.0.0.1", "-p", str(port), "-q", "1"]
    sub = await asyncio.create_subprocess_exec(
        "mosquitto_sub", *common, "-v", "-t", FINISHED, "-t", "bench/probe", stdout=asyncio.subprocess.PIPE
    )
    assert sub.stdout is not None
    try:
        # Subscribed once a probe comes back.
        while True:
            probe = await asyncio.create_subprocess_exec("mosquitto_pub", *common, "-t", "bench/probe", "-m", "x")
            await probe.wait()
            try:
                async with asyncio.timeout(0.5):
                    line = await sub.stdout.readline()
                    if line.startswith(b"bench/probe"):
                        break
            except TimeoutError:
                continue
        lines = "".join(json.dumps({"id": f"t{i}", "text": "hi"}) + "\n" for i in range(n)).encode()
        start = time.monotonic()
        pub = await asyncio.create_subprocess_exec(
            "mosquitto_pub", *common, "-M", "200", "-t", SAY, "-l", stdin=asyncio.subprocess.PIPE
        )
        assert pub.stdin is not None
        pub.stdin.write(lines)
        await pub.stdin.drain()
        pub.stdin.close()
        finished: list[dict[str, Any]] = []
        async with asyncio.timeout(120):
            while len(finished) < n:
                line = await sub.stdout.readline()
                topic, _, payload = line.partition(b" ")
                if topic.decode() == FINISHED:
                    finished.append(json.loads(payload))
        took = time.monotonic() - start
        await pub.wait()
    finally:
        sub.terminate()
        await sub.wait()
    return n / took, tally(finished, n)


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
        return n / took, tally(rec.payloads("/tts/finished"), n)


def start_profile(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy not found: pip install py-spy", file=sys.stderr)
        return None
    raw = out.with_suffix(".txt")
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--output", str(raw), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def report_profile(spy: subprocess.Popen[bytes], out: Path, top: int = 25) -> None:
    spy.send_signal(signal.SIGINT)
    spy.wait(30)
    raw = out.with_suffix(".txt")
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        count = int(count_s)
        frames = stack.split(";")
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        if frames and frames[0].startswith("thread "):
            frames = frames[1:]
        samples += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + count
    print(f"profile: {samples} samples; raw stacks in {raw}")
    print("  own%  incl%  function")
    for frame, count in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * count / samples:4.1f}  {100 * total[frame] / samples:5.1f}  {frame}")


async def measure(args: argparse.Namespace, journal: bool) -> dict[str, Any]:
    """One daemon (journal on or off) through both phases."""
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
            journal={"enabled": journal, "path": str(work / "journal.sqlite3"), "synchronous": args.synchronous},
        )
        proc = DaemonProcess(config)
        proc.start()
        try:
            lat = await overhead(broker.port, args.samples)
            assert proc.proc is not None
            daemon = psutil.Process(proc.proc.pid)
            spy = start_profile(daemon.pid, args.profile) if args.profile else None
            before = daemon.cpu_times()
            run = throughput_c if args.client == "c" else throughput
            rate, outcome = await run(broker.port, args.requests)
            after = daemon.cpu_times()
            if spy is not None and args.profile is not None:
                report_profile(spy, args.profile)
            cpu_s = (after.user + after.system) - (before.user + before.system)
            user_s = after.user - before.user
        finally:
            proc.signal(signal.SIGTERM)
            await proc.wait(30)
            broker.stop()
    return {"lat": lat, "rate": rate, "outcome": outcome, "cpu_s": cpu_s, "user_s": user_s}


def report(args: argparse.Namespace, label: str, m: dict[str, Any]) -> None:
    lat, rate, outcome, cpu_s, user_s = m["lat"], m["rate"], m["outcome"], m["cpu_s"], m["user_s"]
    print(f"== {label}")
    print(f"overhead  receipt -> first chunk on the loop (zero-cost engine), {len(lat)} requests:")
    p50, p99 = statistics.median(lat), percentile(lat, 99)
    print(f"          p50 {p50:.2f} ms   p99 {p99:.2f} ms   max {max(lat):.2f} ms   goal p99 < 5 ms")
    print(f"throughput {args.requests} say requests, max_pending {args.max_pending}, {args.client} client:")
    print(f"          {rate:.0f} requests/s answered   {outcome}   goal >= 1000/s, none dropped")
    print(
        f"          daemon CPU {cpu_s:.2f} s ({user_s:.2f} user, {cpu_s - user_s:.2f} system) for {args.requests}"
        f" requests = {1000 * cpu_s / args.requests:.2f} ms each"
        f" ({args.requests / cpu_s:.0f} requests per daemon CPU-second; the client and broker share the same 2 cores)"
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--max-pending", type=int, default=32)
    parser.add_argument("--client", choices=("c", "python"), default="c")
    parser.add_argument("--journal", choices=("on", "off", "both"), default="both", help="the request journal")
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full", help="journal.synchronous")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the daemon during the throughput phase")
    add_doc_arguments(parser, "intake")
    args = parser.parse_args()
    doc = doc_target(args)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.journal]
    results = [(journal, await measure(args, journal)) for journal in modes]
    print(f"machine: {machine_line()}; daemon + mosquitto + client on loopback")
    for journal, m in results:
        report(args, f"journal {'on (synchronous ' + args.synchronous + ')' if journal else 'off'}", m)
    if doc is not None:
        base = results[0][1]
        rows = [
            [
                f"on (synchronous {args.synchronous})" if journal else "off",
                f"{statistics.median(m['lat']):.2f}",
                f"{percentile(m['lat'], 99):.2f}",
                f"{max(m['lat']):.2f}",
                f"{m['rate']:.0f}",
                ratio(m["rate"], base["rate"]),
                ", ".join(f"{k} {v}" for k, v in sorted(m["outcome"].items())),
                f"{1000 * m['cpu_s'] / args.requests:.2f}",
            ]
            for journal, m in results
        ]
        header = ["journal", "overhead p50 ms", "p99 ms", "max ms", "requests/s answered",
                  f"/ journal {'on' if results[0][0] else 'off'}", "outcome", "daemon CPU ms a request"]  # fmt: skip
        doc.publish(
            "The MQTT intake: pipeline overhead and sustained rate",
            markdown_table(header, rows, "lrrrrrlr"),
            f"The daemon as a subprocess with the zero-cost tone engine and the discard sink, a real mosquitto;"
            f" overhead: receipt to first chunk on the loop over {args.samples} requests one at a time (goal p99"
            f" < 5 ms); throughput: {args.requests} say requests from the {args.client} client, max_pending"
            f" {args.max_pending}, every one answered by a tts/finished (goal >= 1000/s, none dropped).",
        )


if __name__ == "__main__":
    asyncio.run(main())
