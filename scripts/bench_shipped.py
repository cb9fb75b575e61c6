"""Fast as shipped: the daemon a user starts, ours beside the old behaviour, in one run.

Every figure comes from the daemon as a subprocess (the real CLI) with a real mosquitto; the
speaker is a PulseAudio null sink. Three sections (``--sections``, default all):

- ``first``: the default configuration on the 0.6B shapes, the null sink as the speaker: each of
  ``--sentences`` five-word sentences over MQTT, one after another, first heard (from publishing the
  request to the first non-silent sample recorded from the sink's monitor), the daemon's own
  ``firstAudioOutMs`` and real-time factor; then one request over HTTP (``/v1/audio/speech``),
  which must be answered whole.
- ``load``: frames per second of synthesis (the discard sink; ``audioMs``/``synthMs`` of each
  request's ``metrics/latency``), quiet, beside one busy process per core but one (each in a session
  of its own), and in a cgroup with a quota of one CPU (root; cgroup v1 or v2), for the tiny
  checkpoint and the 0.6B shapes; also ours with one thread, the floor the policy must not fall under.
- ``burst``: ``--burst`` requests (a fifth of them bad: an unknown voice, an empty text, an unknown
  language, a text too long) to the tiny checkpoint beside the busy processes: how many are
  answered (``tts/finished``), how many twice, how long the last one took.

Baseline: the old defaults, reproduced by explicit settings: ``tts.torch.quantization: none``,
``tts.torch.threads`` every core on a machine of two (else all but one), ``GOMP_SPINCOUNT=300000``
(libgomp's own spin when ``OMP_WAIT_POLICY`` is unset), ``audio.prebuffer_max_s: 600`` (the wait
had no bound). What no setting brings back: the old daemon also paced requests for the discard sink
(callers were held behind them); the burst's baseline is therefore kinder than the old daemon was.

Random weights never say end-of-speech: every request runs to ``--frames`` (``tts.options.max_frames``).

Usage:
  .venv/bin/python scripts/bench_shipped.py --model /tmp/cv06            # make it: python -m
      s2s_daemon.tools.make_checkpoint /tmp/cv06 --size 0.6b --kind custom_voice
  .venv/bin/python scripts/bench_shipped.py --model /tmp/cv06 --quick    # a small run: does it work
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from s2s_daemon.bench.machine import machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target  # noqa: E402
from tests.support.broker import Mosquitto, free_port  # noqa: E402
from tests.support.daemon import DaemonProcess, write_config  # noqa: E402
from tests.support.load import CpuQuota, busy_neighbours  # noqa: E402
from tests.support.mqtt import Recorder, recorder  # noqa: E402

TINY = REPO / "tests/fixtures/qwen3_tiny/custom_voice"
SAY = "s2s/kitchen/tts/say"
SENTENCES = (
    "The front door is unlocked.",
    "The kettle is boiling now.",
    "Someone rang the doorbell.",
    "The washing machine has finished.",
    "Dinner will be ready soon.",
    "The garage door is open.",
)
HTTP_TEXT = "Good evening, the living room lights are off and the back door is locked."
CORES = os.cpu_count() or 1
NEIGHBOURS = max(1, CORES - 1)
SETTLE_S = 6.0
"""After the neighbours start: the engine's CPU watch reads every second, then a frame ends."""
LOUD = 1e-3
"""A recorded sample above this is sound (the null sink's silence is exact zeros)."""


@dataclass(frozen=True)
class Variant:
    name: str
    sections: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)


def old_threads() -> int:
    return CORES if CORES <= 2 else CORES - 1


BASELINE = Variant(
    "baseline",
    {"tts": {"torch": {"quantization": "none", "threads": old_threads()}}, "audio": {"prebuffer_max_s": 600}},
    {"GOMP_SPINCOUNT": "300000"},
)
OURS = Variant("ours", {})
ONE_THREAD = Variant("ours, 1 thread", {"tts": {"torch": {"threads": 1}}})


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# --------------------------------------------------------------------------- the parts


class HeardClock:
    """``parec`` of the speaker sink's monitor, every block stamped with when it arrived."""

    def __init__(self, env: dict[str, str], rate_hz: int = 44_100) -> None:
        self.rate_hz = rate_hz
        self.blocks: list[tuple[float, np.ndarray]] = []
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            ["parec", "-d", "spk.monitor", "--raw", "--format=float32le", f"--rate={rate_hz}", "--channels=1",
             "--latency-msec=10"],
            env=env,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._read, name="bench.parec", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        rest = b""
        while True:
            data = self._proc.stdout.read1(8192)
            if not data:
                return
            data = rest + data
            usable = len(data) - len(data) % 4
            rest = data[usable:]
            with self._lock:
                self.blocks.append((time.monotonic(), np.frombuffer(data[:usable], "<f4")))

    def first_loud_after(self, since: float) -> float | None:
        """When the first sample above ``LOUD`` recorded after ``since`` was played (its block's
        arrival less the samples after it)."""
        with self._lock:
            blocks = [(at, b) for at, b in self.blocks if at >= since]
        for at, block in blocks:
            loud = np.nonzero(np.abs(block) > LOUD)[0]
            if len(loud):
                return at - (len(block) - int(loud[0])) / self.rate_hz
        return None

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(5)


@contextlib.asynccontextmanager
async def running(
    workdir: Path, name: str, port: int, sections: dict[str, Any], env: dict[str, str], quota: CpuQuota | None = None
) -> AsyncIterator[tuple[DaemonProcess, Recorder]]:
    """The daemon with ``sections`` (over the defaults of ``write_config``), ready on ``port``."""
    config = write_config(workdir / f"{name}.yaml", port, **sections)
    daemon = DaemonProcess(config, env=env)
    daemon.start()
    assert daemon.proc is not None
    if quota is not None:
        quota.add(daemon.proc.pid)
    try:
        async with recorder(port) as rec:
            await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 600)
            yield daemon, rec
    finally:
        daemon.signal(signal.SIGTERM)
        try:
            await daemon.wait(60)
        except TimeoutError:
            daemon.cleanup()
        print(f"  ({name}: log {daemon.log_path})", file=sys.stderr)


async def latency_of(rec: Recorder, request_id: str, timeout_s: float) -> dict[str, Any]:
    finished = await rec.wait_finished([request_id], timeout_s=timeout_s)
    if finished[request_id]["status"] != "completed":
        raise RuntimeError(f"{request_id}: {finished[request_id]}")
    return await rec.wait_for(  # type: ignore[no-any-return]
        lambda: next((p for p in rec.payloads("/metrics/latency") if p["id"] == request_id), None), 30
    )


def engine_sections(model: Path, frames: int, sink: dict[str, Any]) -> dict[str, Any]:
    return {
        "tts": {"engine": "torch", "model": str(model), "warmup": True, "options": {"max_frames": str(frames)}},
        "audio": sink,
        "log": {"format": "json", "level": "info"},
    }


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------- sections


async def section_first(args: argparse.Namespace, workdir: Path, broker: Mosquitto) -> list[str]:
    from tests.support.pulse import PulseServer, pulse_available

    if not pulse_available():
        return ["first: skipped: pulseaudio is not installed"]
    import aiohttp

    pulse = PulseServer(workdir / "pulse")
    pulse.start()
    heard = HeardClock(pulse.env())
    rows: list[str] = []
    try:
        for variant in (BASELINE, OURS):
            http_port = free_port()
            sections = merge(
                engine_sections(args.model, args.frames, {"sink": "speaker"}),
                {"http": {"enabled": True, "port": http_port}, "tts": {"voice": "Ryan"}},
            )
            sections = merge(sections, variant.sections)
            env = pulse.env(**variant.env)
            firsts, outs, rtfs = [], [], []
            async with running(workdir, f"first-{variant.name}", broker.port, sections, env) as (daemon, rec):
                for i in range(args.sentences):
                    text = SENTENCES[i % len(SENTENCES)]
                    request_id = f"first{i}"
                    sent = time.monotonic()
                    await rec.say(SAY, {"id": request_id, "text": text})
                    latency = await latency_of(rec, request_id, args.timeout)
                    at = heard.first_loud_after(sent)
                    firsts.append(1000.0 * (at - sent) if at is not None else float("nan"))
                    outs.append(float(latency.get("firstAudioOutMs") or float("nan")))
                    rtfs.append(float(latency.get("rtf") or float("nan")))
                started = time.monotonic()
                body = {"model": "tts-1", "input": HTTP_TEXT, "voice": "alloy", "response_format": "pcm"}
                http_result = "?"
                try:
                    timeout = aiohttp.ClientTimeout(total=args.timeout)
                    async with (
                        aiohttp.ClientSession(timeout=timeout) as http,
                        http.post(f"http://127.0.0.1:{http_port}/v1/audio/speech", json=body) as response,
                    ):
                        size = len(await response.read())
                        http_result = f"HTTP {response.status}, {size / 48000:.1f} s of audio"
                except (TimeoutError, aiohttp.ClientError) as exc:
                    http_result = f"failed: {type(exc).__name__} {exc}"
                http_s = time.monotonic() - started
                threads = [line for line in daemon.log().splitlines() if '"engine_format"' in line]
            fmt = json.loads(threads[-1]).get("weights") if threads else "?"
            rows.append(
                f"{variant.name:<10} {fmt:<8} first heard median {med(firsts):7.0f} ms, max {max(firsts):7.0f} ms"
                f" | firstAudioOutMs median {med(outs):7.0f} | RTF median {med(rtfs):5.2f}"
                f" | HTTP: {http_result} in {http_s:.1f} s"
            )
    finally:
        heard.stop()
        pulse.stop()
    return [
        f"first heard on the speaker (0.6B shapes {args.model}, {args.sentences} sentences of 5 words,"
        f" {args.frames} frames each; HTTP: one sentence):",
        *rows,
    ]


async def speeds(rec: Recorder, prefix: str, count: int, timeout_s: float) -> list[float]:
    out = []
    for i in range(count):
        request_id = f"{prefix}{i}"
        await rec.say(SAY, {"id": request_id, "text": SENTENCES[i % len(SENTENCES)], "voice": "ryan"})
        latency = await latency_of(rec, request_id, timeout_s)
        out.append((latency["audioMs"] / 80.0) / (latency["synthMs"] / 1000.0))
    return out


async def section_load(args: argparse.Namespace, workdir: Path, broker: Mosquitto) -> list[str]:
    quota_why = CpuQuota.unavailable()
    rows = [
        f"frames per second (median of {args.runs}), the discard sink; busy: {NEIGHBOURS} busy process(es) beside;"
        f" quota: a cgroup of one CPU{'' if quota_why is None else ' (skipped: ' + quota_why + ')'}:",
        f"{'model':<6} {'variant':<16} {'quiet':>7} {'busy':>7} {'busy %':>7} {'quota':>7} {'quota %':>8}",
    ]
    for label, model, frames in (("tiny", TINY, args.tiny_frames), ("0.6B", args.model, args.frames)):
        for variant in (BASELINE, OURS, ONE_THREAD):
            sections = merge(engine_sections(model, frames, {"sink": "discard"}), variant.sections)
            env = dict(variant.env)
            name = f"load-{label}-{variant.name.replace(' ', '').replace(',', '-')}"
            async with running(workdir, name, broker.port, sections, env) as (_, rec):
                quiet = await speeds(rec, "quiet", args.runs, args.timeout)
                with busy_neighbours(NEIGHBOURS):
                    await asyncio.sleep(SETTLE_S)
                    busy = await speeds(rec, "busy", args.runs, args.timeout)
            quota: list[float] = []
            if quota_why is None:
                with CpuQuota(1.0, name=f"s2s-bench-{os.getpid()}") as limit:
                    async with running(workdir, f"{name}-quota", broker.port, sections, env, limit) as (_, rec):
                        quota = await speeds(rec, "quota", args.runs, args.timeout)
            q, b, c = med(quiet), med(busy), med(quota)
            rows.append(
                f"{label:<6} {variant.name:<16} {q:7.2f} {b:7.2f} {100 * b / q:6.0f}% {c:7.2f} {100 * c / q:7.0f}%"
            )
    return rows


async def section_burst(args: argparse.Namespace, workdir: Path, broker: Mosquitto) -> list[str]:
    rows = [
        f"a burst of {args.burst} requests (a fifth bad) to the tiny checkpoint, {NEIGHBOURS} busy process(es)"
        f" beside, {args.tiny_burst_frames} frames each, answers waited for up to {args.burst_timeout:.0f} s:"
    ]
    bad = (
        {"voice": "nobody"},
        {"text": ""},
        {"language": "klingon"},
        {"text": "x" * 2001},
    )
    for variant in (BASELINE, OURS):
        sections = merge(engine_sections(TINY, args.tiny_burst_frames, {"sink": "discard"}), variant.sections)
        name = f"burst-{variant.name}"
        with busy_neighbours(NEIGHBOURS):
            async with running(workdir, name, broker.port, sections, dict(variant.env)) as (_, rec):
                await asyncio.sleep(SETTLE_S)
                ids = [f"b{i}" for i in range(args.burst)]
                started = time.monotonic()
                for i, request_id in enumerate(ids):
                    payload: dict[str, Any] = {"id": request_id, "text": SENTENCES[i % len(SENTENCES)], "voice": "ryan"}
                    if i % 5 == 4:
                        payload.update(bad[(i // 5) % len(bad)])
                    await rec.say(SAY, payload)
                wanted = len(ids)
                with contextlib.suppress(TimeoutError):
                    await rec.wait_for(lambda: len(answers(rec)) >= wanted, args.burst_timeout)  # noqa: B023 -- awaited here
                took = time.monotonic() - started
                got = answers(rec)
                twice = sum(1 for n in got.values() if n > 1)
                finished = [p for p in rec.payloads("/tts/finished") if p["id"] in got]
                completed = sum(1 for p in finished if p.get("status") == "completed")
                codes: dict[str, int] = {}
                for p in finished:
                    code = (p.get("error") or {}).get("code")
                    if code:
                        codes[code] = codes.get(code, 0) + 1
        rows.append(
            f"{variant.name:<10} answered {len(got)}/{len(ids)} ({len(ids) - len(got)} unanswered, {twice} twice)"
            f" in {took:.0f} s; completed {completed}; errors {codes}"
        )
    return rows


def answers(rec: Recorder) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in rec.payloads("/tts/finished"):
        counts[p["id"]] = counts.get(p["id"], 0) + 1
    return counts


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def broker_in(workdir: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(workdir)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a 0.6B checkpoint folder (random weights will do)")
    parser.add_argument("--sections", default="first,load,burst")
    parser.add_argument("--sentences", type=int, default=4)
    parser.add_argument("--frames", type=int, default=40, help="frames per 0.6B request (80 ms each)")
    parser.add_argument("--tiny-frames", type=int, default=150)
    parser.add_argument("--tiny-burst-frames", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3, help="requests per condition in the load section")
    parser.add_argument("--burst", type=int, default=640)
    parser.add_argument("--burst-timeout", type=float, default=240.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="longest wait for one request")
    parser.add_argument("--quick", action="store_true", help="a small run that shows the script works")
    parser.add_argument("--workdir", type=Path, default=None, help="keep configs and daemon logs here")
    add_doc_arguments(parser, "shipped")
    args = parser.parse_args()
    doc = doc_target(args)
    if args.quick:
        args.sentences, args.frames, args.tiny_frames, args.runs, args.burst = 2, 16, 60, 1, 40
        args.burst_timeout = 120.0
    wanted = {s.strip() for s in args.sections.split(",") if s.strip()}
    out: list[str] = [
        machine_line(f"baseline = {json.dumps(BASELINE.sections)} + {BASELINE.env}"),
    ]
    with tempfile.TemporaryDirectory(prefix="bench-shipped-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        # The prepared weights of both formats are made once, before the timed runs.
        os.environ.setdefault("S2S_PREPARED_CACHE", str(workdir / "prepared"))
        with broker_in(workdir) as broker:
            for name, section in (("first", section_first), ("load", section_load), ("burst", section_burst)):
                if name in wanted:
                    print(f"bench_shipped: {name}...", file=sys.stderr)
                    out.extend(["", *await section(args, workdir, broker)])
                    print("\n".join(out), file=sys.stderr)
    print("\n".join(out))
    if doc is not None:
        body = "\n".join(out[1:]).strip("\n")
        doc.publish("Fast as shipped: the default daemon beside the old defaults", f"```\n{body}\n```")


if __name__ == "__main__":
    asyncio.run(main())
