"""Callers at once through the daemon, as users send them: the daemon as a subprocess (``s2s-daemon
run``, the torch engine on MODEL, its other settings the shipped defaults), and N speech requests at
once through its OpenAI API with the official ``openai`` SDK, streamed, in the API's default format
(mp3) unless ``--response-format`` says otherwise. Per request: its first audio (the first bytes of
the answer, counted from when the requests went out) and its audio's length (decoded); per N: the
audio seconds made a wall second in aggregate, each caller's own rate, the slowest first audio.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint ./cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_callers.py ./cv06 [--callers 1,4] [--frames 60] [--rounds 2]

Random weights never end an utterance: ``--frames`` caps each (``tts.options.max_frames``), 4.8 s of
audio at 60; the text stage may speak a request as more than one utterance (its sentences, or clauses
of a long one). Real time is 1 s of audio a second for each caller.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table
from s2s_daemon.bench.ports import free_port

REPO = Path(__file__).resolve().parents[1]
TEXTS = (
    "The kettle is boiling in the kitchen, come and make the tea.",
    "Someone is at the front door, would you please answer it?",
    "The lights in the hall and on the stairs are switched off now.",
    "Good night, sleep well, I will see you again in the morning.",
)
"""One sentence each that the daemon speaks as one utterance (at most ``FIRST_SENTENCE_CHARS``:
a longer first sentence is spoken from its first clause, an utterance of its own). Random weights
never end an utterance, so each runs to ``--frames``: a request spoken as two would bring twice
the audio and its caller alone would set the round's end."""

HEADER = ("callers", "wall s", "audio s", "audio s per s, all", "slowest caller x real time", "first audio s, median",
          "slowest")  # fmt: skip


def write_config(folder: Path, args: argparse.Namespace, http_port: int) -> Path:
    import yaml

    config = {
        "site_id": "bench",
        "mqtt": {"broker": "embedded", "port": free_port()},
        "tts": {
            "engine": "torch",
            "model": str(Path(args.model).resolve()),
            "torch": {"device": "cpu", "quantization": args.quantization},
            "options": {"max_frames": str(args.frames)},
        },
        "audio": {"sink": "discard"},
        "http": {"enabled": True, "port": http_port},
        "journal": {"path": str(folder / "journal.sqlite3")},
        "log": {"format": "json", "level": "info"},
    }
    path = folder / "daemon.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def audio_seconds(data: bytes, response_format: str) -> float:
    """The length of an answer's audio: PCM by its bytes (24 kHz, 16 bits), the rest decoded."""
    if response_format == "pcm":
        return len(data) / 48000
    import soundfile

    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    return float(len(samples) / rate)


async def one_caller(client: Any, text: str, response_format: str, sent: float) -> tuple[float, float, float]:
    """(seconds to its first audio, seconds to its last, seconds of audio) of one streamed request."""
    first: float | None = None
    data = b""
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=text, response_format=response_format
    ) as answer:
        async for piece in answer.iter_bytes():
            if first is None and piece:
                first = time.perf_counter() - sent
            data += piece
    done = time.perf_counter() - sent
    return first if first is not None else done, done, audio_seconds(data, response_format)


async def round_of(port: int, callers: int, response_format: str) -> list[tuple[float, float, float]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=600)
    async with client:
        sent = time.perf_counter()
        return list(
            await asyncio.gather(
                *(one_caller(client, TEXTS[i % len(TEXTS)], response_format, sent) for i in range(callers))
            )
        )


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the daemon was not ready in {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a random 0.6B CustomVoice from make_checkpoint)")
    parser.add_argument("--quantization", default="auto", help="tts.torch.quantization: auto, none, int8, int4")
    parser.add_argument("--callers", default="1,4", help="callers at once, comma-separated")
    parser.add_argument("--frames", type=int, default=60, help="codec frames a request at most (80 ms each)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--response-format", default="mp3", help="the API's response_format (its default: mp3)")
    parser.add_argument("--ready-timeout", type=float, default=300)
    add_doc_arguments(parser, "callers")
    args = parser.parse_args()
    doc = doc_target(args)
    counts = [int(c) for c in args.callers.split(",")]

    results: dict[int, list[list[tuple[float, float, float]]]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory(prefix="bench-callers-") as tmp:
        port = free_port()
        config = write_config(Path(tmp), args, port)
        # the daemon's settings are the config's (an S2S_ variable would set one), but where prepared
        # weights are kept
        env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_") or k == "S2S_PREPARED_CACHE"}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        log = (Path(tmp) / "daemon.log").open("wb")
        command = [sys.executable, "-m", "s2s_daemon", "run", "-c", str(config)]
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_ready(port, proc, args.ready_timeout)
            except SystemExit:
                log.flush()
                sys.stderr.write((Path(tmp) / "daemon.log").read_text(errors="replace")[-4000:])
                raise
            asyncio.run(round_of(port, 1, args.response_format))  # the first request's own costs out of the way
            print(machine_line(f"callers {args.callers}", f"{args.frames} frames a request", args.response_format))
            for _ in range(args.rounds):
                for n in counts:
                    results[n].append(asyncio.run(round_of(port, n, args.response_format)))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    rows = []
    for n, rounds in results.items():
        # per round: its wall time (the last answer's end), its audio, the slowest first audio
        walls = [max(done for _, done, _ in r) for r in rounds]
        audio = [sum(seconds for _, _, seconds in r) for r in rounds]
        aggregate = statistics.median(a / w for a, w in zip(audio, walls, strict=True))
        own = min(seconds / done for r in rounds for _, done, seconds in r)
        firsts = [first for r in rounds for first, _, _ in r]
        print(f"{n} callers: {aggregate:.2f} s of audio a second in aggregate; the slowest caller {own:.2f}x real"
              f" time; first audio median {statistics.median(firsts):.2f} s, slowest {max(firsts):.2f} s;"
              f" wall {statistics.median(walls):.2f} s for {statistics.median(audio):.1f} s of audio")  # fmt: skip
        rows.append([
            n, f"{statistics.median(walls):.2f}", f"{statistics.median(audio):.1f}", f"{aggregate:.2f}", f"{own:.2f}",
            f"{statistics.median(firsts):.2f}", f"{max(firsts):.2f}",
        ])  # fmt: skip
    if doc is not None:
        doc.publish(
            "Callers at once through the daemon's OpenAI API",
            markdown_table(HEADER, rows),
            f"The daemon as a subprocess (`s2s-daemon run`: the torch engine, quantization {args.quantization}, the"
            f" other settings the shipped defaults), N streamed requests at once through the official openai SDK,"
            f" response_format {args.response_format}; {args.frames} frames at most an utterance (the daemon's text"
            f" stage may speak a request's sentences or clauses as utterances of their own); {args.rounds} rounds,"
            " medians; first audio counted from when the requests went out. Real time for one caller: 1 s of audio"
            " a second.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
