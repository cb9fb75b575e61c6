"""What the Wyoming server adds to the first audio, and how soon a streamed LLM answer speaks.

Runs the daemon as a subprocess (the real CLI, tone engine registered) with a real mosquitto and
``wyoming.enabled``, and talks to it with the wyoming package's own client, as Home Assistant does:

1. plain ``synthesize``, one at a time: the client's time from writing the event to the first
   ``audio-chunk``, beside the daemon's own ``ttfaMs`` (metrics/latency: receipt -> first chunk
   synthesized) for the same request. The difference is the server's cost: reading and parsing
   the event, submitting it, and handing the first chunk back as PCM over the socket.
2. streamed text (``synthesize-start``, ``synthesize-chunk`` deltas of 4 characters at
   ``--tokens-per-s``, ``synthesize-stop``): the time from the first ``synthesize-chunk`` to the
   first ``audio-chunk``, split into the wait for the first sentence's text (until the delta after
   its full stop: a sentence ends at a terminator before white space) and what comes after it.

Engines: ``tone`` (costs ~0: what is measured is the daemon and the server) and ``torch`` with
``--model`` (default the tiny random checkpoint tests/fixtures/qwen3_tiny/custom_voice, capped at
``--max-frames`` frames since random weights never end an utterance).

Usage: .venv/bin/python scripts/bench_wyoming.py [--engine tone,torch] [--runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from wyoming.audio import AudioChunk, AudioStop  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped  # noqa: E402

from s2s_daemon.bench.machine import machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table  # noqa: E402
from s2s_daemon.bench.report import percentile  # noqa: E402
from tests.support.broker import Mosquitto, free_port  # noqa: E402
from tests.support.daemon import DaemonProcess, write_config  # noqa: E402
from tests.support.mqtt import Recorder, recorder  # noqa: E402

TEXT = "The kettle is boiling."
ANSWER = "Sure. The kitchen lights are off now, and the oven timer is set for twenty minutes. Anything else?"
DELTA_CHARS = 4
"""About one LLM token."""


@dataclass
class Plain:
    wyoming_ms: float
    ttfa_ms: float


@dataclass
class Streamed:
    total_ms: float
    """First synthesize-chunk -> first audio-chunk."""
    text_ms: float
    """First synthesize-chunk -> the delta that completed the first sentence."""


async def connect(port: int, timeout_s: float = 300.0) -> AsyncTcpClient:
    deadline = time.monotonic() + timeout_s
    while True:
        client = AsyncTcpClient("127.0.0.1", port)
        try:
            await client.connect()
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        return client


async def plain(port: int, rec: Recorder, runs: int) -> list[Plain]:
    out: list[Plain] = []
    for i in range(runs):
        client = await connect(port)
        try:
            began = time.monotonic()
            await client.write_event(Synthesize(text=TEXT).event())
            first: float | None = None
            while (event := await client.read_event()) is not None:
                if first is None and AudioChunk.is_type(event.type):
                    first = time.monotonic()
                if AudioStop.is_type(event.type):
                    break
        finally:
            await client.disconnect()
        seen = i + 1
        await rec.wait_for(lambda: len(rec.payloads("/metrics/latency")) >= seen, 60)  # noqa: B023 -- awaited here
        ttfa = rec.payloads("/metrics/latency")[i]["ttfaMs"]
        assert first is not None
        out.append(Plain(1000 * (first - began), ttfa))
    return out


async def streamed(port: int, runs: int, tokens_per_s: float) -> list[Streamed]:
    deltas = [ANSWER[i : i + DELTA_CHARS] for i in range(0, len(ANSWER), DELTA_CHARS)]
    sentence_end = ANSWER.index(". ") + 2  # the delta holding the space after "Sure." completes it
    complete_at = next(n for n in range(len(deltas)) if (n + 1) * DELTA_CHARS >= sentence_end)
    out: list[Streamed] = []
    for _ in range(runs):
        client = await connect(port)
        marks: dict[str, float] = {}

        async def llm(client: AsyncTcpClient = client, marks: dict[str, float] = marks) -> None:
            await client.write_event(SynthesizeStart().event())
            for n, delta in enumerate(deltas):
                await client.write_event(SynthesizeChunk(text=delta).event())
                now = time.monotonic()
                marks.setdefault("first_chunk", now)
                if n == complete_at:
                    marks["sentence"] = now
                await asyncio.sleep(1.0 / tokens_per_s)
            await client.write_event(Synthesize(text=ANSWER).event())  # as Home Assistant does
            await client.write_event(SynthesizeStop().event())

        writer = asyncio.create_task(llm())
        try:
            while (event := await client.read_event()) is not None:
                if "audio" not in marks and AudioChunk.is_type(event.type):
                    marks["audio"] = time.monotonic()
                if SynthesizeStopped.is_type(event.type):
                    break
            await writer
        finally:
            writer.cancel()
            await client.disconnect()
        out.append(
            Streamed(1000 * (marks["audio"] - marks["first_chunk"]), 1000 * (marks["sentence"] - marks["first_chunk"]))
        )
    return out


async def bench(engine: str, args: argparse.Namespace) -> tuple[list[Plain], list[Streamed]]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker = Mosquitto(work)
        broker.start()
        port = free_port()
        tts: dict[str, Any] = {"engine": engine, "chunk_frames": args.chunk_frames}
        if engine == "torch":
            tts |= {
                "model": str(args.model),
                "warmup": True,
                "torch": {"device": "cpu"},
                "options": {"max_frames": str(args.max_frames)},
            }
        config = write_config(
            work / "d.yaml",
            broker.port,
            tts=tts,
            wyoming={"enabled": True, "host": "127.0.0.1", "port": port, "zeroconf": False},
            log={"level": "warning"},
            telemetry={"memory_interval_s": 60},
        )
        proc = DaemonProcess(config)
        proc.start()
        try:
            async with recorder(broker.port, subscribe=("s2s/+/metrics/latency",)) as rec:
                await (await connect(port)).disconnect()  # listening: the model is loaded
                await plain(port, rec, 2)  # warm-up
                rec.messages.clear()
                results = await plain(port, rec, args.runs)
                stream = await streamed(port, max(3, args.runs // 4), args.tokens_per_s)
        finally:
            proc.cleanup()
            broker.stop()
    return results, stream


def line(label: str, values: list[float]) -> str:
    return f"{label:<44} p50 {statistics.median(values):8.2f}  p95 {percentile(values, 95):8.2f}  (n={len(values)})"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="tone", help="comma-separated: tone, torch")
    parser.add_argument("--model", type=Path, default=REPO / "tests/fixtures/qwen3_tiny/custom_voice")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--chunk-frames", type=int, default=4)
    parser.add_argument("--max-frames", type=int, default=16)
    parser.add_argument("--tokens-per-s", type=float, default=30.0)
    add_doc_arguments(parser, "wyoming")
    args = parser.parse_args()
    doc = doc_target(args)
    print(machine_line())
    print(f"text {TEXT!r}; streamed answer of {len(ANSWER)} characters in deltas of {DELTA_CHARS} at", end=" ")
    print(f"{args.tokens_per_s:g}/s; chunk_frames {args.chunk_frames}; milliseconds")
    rows: list[list[object]] = []
    for engine in args.engine.split(","):
        results, stream = await bench(engine, args)
        name = engine + (f" ({args.model.name}, cpu, max_frames {args.max_frames})" if engine == "torch" else "")
        print(f"\n{name}")
        for label, values in (
            ("synthesize -> first audio-chunk (client)", [r.wyoming_ms for r in results]),
            ("daemon ttfaMs (metrics/latency)", [r.ttfa_ms for r in results]),
            ("server's share (client - ttfaMs)", [r.wyoming_ms - r.ttfa_ms for r in results]),
            ("streamed: first text chunk -> first audio", [s.total_ms for s in stream]),
            ("  of which waiting for the first sentence", [s.text_ms for s in stream]),
            ("  of which after the sentence was complete", [s.total_ms - s.text_ms for s in stream]),
        ):
            print(line(f"  {label}", values))
            rows.append([name, label.strip(), f"{statistics.median(values):.2f}", f"{percentile(values, 95):.2f}",
                         len(values)])  # fmt: skip
    if doc is not None:
        doc.publish(
            "What the Wyoming server adds to first audio, plain and streamed",
            markdown_table(["engine", "what", "p50 ms", "p95 ms", "n"], rows, "llrrr"),
            f"The daemon as a subprocess with a real mosquitto, talked to with the wyoming package's own client;"
            f" text {TEXT!r}; a streamed answer of {len(ANSWER)} characters in deltas of {DELTA_CHARS} at"
            f" {args.tokens_per_s:g}/s; chunk_frames {args.chunk_frames}. The server's share is the client's first"
            " audio-chunk minus the daemon's own ttfaMs for the same request.",
        )


if __name__ == "__main__":
    asyncio.run(main())
