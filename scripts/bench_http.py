"""What the speech API adds to the first audio: the client's first byte beside the engine's first chunk.

Runs the daemon as a subprocess (a real mosquitto, the discard sink, ``http.enabled``), sends
``POST /v1/audio/speech`` one at a time over one keep-alive connection per response format,
and sets side by side, per request:

- ``ttfaMs`` of the request's ``metrics/latency`` event: receipt -> first synthesized chunk;
- ``firstAudioOutMs``: receipt -> first chunk handed to the caller's stream;
- the client's time to first byte, from sending the request (so it also holds the request's
  own transfer and parsing before receipt, a fraction of a millisecond on loopback);
- added = client first byte - ttfaMs: what HTTP, encoding and the socket add to the engine.

``flac`` is sent whole (see s2s_daemon/intake/http/encoders.py): its first byte is the last.

Usage: .venv/bin/python scripts/bench_http.py [--engine tone|torch] [--runs 10]
  torch uses the tiny random checkpoint tests/fixtures/qwen3_tiny/custom_voice on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from s2s_daemon.bench.machine import machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table  # noqa: E402
from tests.support.broker import Mosquitto, free_port, wait_port  # noqa: E402
from tests.support.daemon import DaemonProcess, write_config  # noqa: E402
from tests.support.mqtt import recorder  # noqa: E402

TEXT = "Hello from the speech API benchmark."
FORMATS = ("pcm", "wav", "mp3", "opus", "flac")


def engine_sections(engine: str) -> dict[str, Any]:
    if engine == "tone":  # zero-cost: measures the daemon's own machinery
        return {"tts": {"engine": "tone", "options": {"speed": "0"}, "warmup": False}}
    model = REPO / "tests/fixtures/qwen3_tiny/custom_voice"
    return {
        "tts": {
            "engine": "torch",
            "model": str(model),
            "voice": "ryan",
            "warmup": True,
            "torch": {"device": "cpu", "dtype": "float32"},
            "options": {"max_frames": "24"},  # random weights never end: 24 frames, about 2 s of audio
        }
    }


async def one(http: aiohttp.ClientSession, url: str, fmt: str) -> tuple[str, float, int]:
    body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": fmt}
    if fmt != "flac":  # streamed: a wav without it is sent whole, with its length
        body["stream_format"] = "audio"
    sent = time.monotonic()
    first = None
    size = 0
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for piece in response.content.iter_any():
            if first is None:
                first = time.monotonic()
            size += len(piece)
        request_id = response.headers["X-Request-Id"]
    assert first is not None and size > 0
    return request_id, 1000.0 * (first - sent), size


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["tone", "torch"], default="tone")
    parser.add_argument("--runs", type=int, default=10)
    add_doc_arguments(parser, "http")
    args = parser.parse_args()
    doc = doc_target(args)
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker = Mosquitto(work)
        broker.start()
        port = free_port()
        config = write_config(
            work / "d.yaml",
            broker.port,
            http={"enabled": True, "port": port},
            log={"level": "warning"},
            telemetry={"memory_interval_s": 60},
            **engine_sections(args.engine),
        )
        proc = DaemonProcess(config)
        proc.start()
        try:
            async with recorder(broker.port, subscribe=("s2s/+/metrics/latency", "s2s/+/status")) as rec:
                await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 300)
                await asyncio.to_thread(wait_port, port, 30)
                url = f"http://127.0.0.1:{port}/v1/audio/speech"
                async with aiohttp.ClientSession() as http:
                    await one(http, url, "pcm")  # opens the connection, warms the path
                    for fmt in FORMATS:
                        ttfb: dict[str, float] = {}
                        size = 0
                        for _ in range(args.runs):
                            request_id, ms, size = await one(http, url, fmt)
                            ttfb[request_id] = ms
                        events = await rec.wait_for(
                            lambda ids=set(ttfb): (
                                got if len(got := [p for p in rec.payloads("/metrics/latency") if p["id"] in ids])
                                == len(ids) else None
                            ),
                            30,
                        )  # fmt: skip
                        rows.append(print_row(fmt, events, ttfb, size))
        finally:
            proc.signal(signal.SIGTERM)
            await proc.wait(60)
            broker.stop()
    print(f"engine {args.engine}, {args.runs} requests per format, text of {len(TEXT)} characters;")
    print(f"machine: {machine_line()}; daemon, broker, client on loopback")
    if doc is not None:
        header = ["format", "ttfaMs p50", "firstAudioOutMs p50", "client first byte p50", "added p50", "added max",
                  "bytes"]  # fmt: skip
        doc.publish(
            "What the HTTP speech API adds to first audio",
            markdown_table(header, rows),
            f"Engine {args.engine}{' (the tiny random checkpoint, CPU, 24 frames)' if args.engine == 'torch' else ''},"
            f" {args.runs} requests a format over one keep-alive connection, a text of {len(TEXT)} characters;"
            " daemon, broker and client on loopback. ms; added = the client's first byte - ttfaMs (receipt to the"
            " first synthesized chunk): what HTTP, encoding and the socket add. flac is sent whole.",
        )


HEADER_PRINTED = False


def print_row(fmt: str, events: list[dict[str, Any]], ttfb: dict[str, float], size: int) -> list[object]:
    """Print the format's figures (the header first, once); return them as table cells."""
    global HEADER_PRINTED
    ttfa = [e["ttfaMs"] for e in events]
    out = [e["firstAudioOutMs"] for e in events]
    client = [ttfb[e["id"]] for e in events]
    added = [ttfb[e["id"]] - e["ttfaMs"] for e in events]
    if not HEADER_PRINTED:
        print(
            f"{'format':<7}{'ttfaMs p50':>12}{'firstOut p50':>14}{'client TTFB p50':>17}"
            f"{'added p50':>11}{'added max':>11}{'bytes':>9}"
        )
        HEADER_PRINTED = True
    med = statistics.median
    print(
        f"{fmt:<7}{med(ttfa):>12.2f}{med(out):>14.2f}{med(client):>17.2f}{med(added):>11.2f}{max(added):>11.2f}{size:>9}"
    )
    return [fmt, *(f"{v:.2f}" for v in (med(ttfa), med(out), med(client), med(added), max(added))), size]


if __name__ == "__main__":
    asyncio.run(main())
