"""Ask a Wyoming TTS server what it is (``describe``) and, optionally, to speak (``synthesize``).

    python scripts/wyoming_probe.py HOST PORT [--synthesize TEXT] [--timeout-s S]

Prints one line: the program, its voices and, after ``--synthesize``, the audio that came back
(format, chunks, milliseconds); exit 0 when the answers are what a Home Assistant client expects,
1 otherwise (the line says why). The client is the ``wyoming`` library's own, as Home Assistant's
integration uses it. scripts/container_check.sh and scripts/addon_check.sh run it against the
container images.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize


class ProbeError(Exception):
    """The server answered, but not as a TTS server should (the message says how)."""


async def describe(client: AsyncTcpClient, timeout_s: float) -> Info:
    await client.write_event(Describe().event())
    while True:
        event = await asyncio.wait_for(client.read_event(), timeout_s)
        if event is None:
            raise ProbeError("the server closed the connection before its info")
        if Info.is_type(event.type):
            return Info.from_event(event)


async def synthesize(client: AsyncTcpClient, text: str, timeout_s: float) -> tuple[AudioStart, int, int]:
    """(the audio-start event, chunks, audio bytes) of one plain ``synthesize``."""
    await client.write_event(Synthesize(text=text).event())
    start: AudioStart | None = None
    chunks = 0
    audio_bytes = 0
    while True:
        event = await asyncio.wait_for(client.read_event(), timeout_s)
        if event is None:
            raise ProbeError("the server closed the connection before audio-stop")
        if Error.is_type(event.type):
            error = Error.from_event(event)
            raise ProbeError(f"error event: {error.code}: {error.text}")
        if AudioStart.is_type(event.type):
            start = AudioStart.from_event(event)
        elif AudioChunk.is_type(event.type):
            if start is None:
                raise ProbeError("audio-chunk before audio-start")
            chunks += 1
            audio_bytes += len(AudioChunk.from_event(event).audio)
        elif AudioStop.is_type(event.type):
            if start is None:
                raise ProbeError("audio-stop before audio-start")
            return start, chunks, audio_bytes


async def probe(host: str, port: int, text: str | None, timeout_s: float) -> str:
    async with AsyncTcpClient(host, port) as client:
        info = await describe(client, timeout_s)
        if not info.tts or not any(program.installed for program in info.tts):
            raise ProbeError(f"describe: no installed TTS program in {info.to_dict()}")
        program = info.tts[0]
        voices = [voice.name for voice in program.voices]
        line = f"describe: {program.name!r}, {len(voices)} voices ({', '.join(voices[:4])})"
        if text is None:
            return line
        start, chunks, audio_bytes = await synthesize(client, text, timeout_s)
        frame_bytes = start.width * start.channels
        if chunks == 0 or audio_bytes == 0 or audio_bytes % frame_bytes:
            raise ProbeError(f"synthesize: {chunks} chunks, {audio_bytes} bytes")
        audio_ms = 1000 * audio_bytes // (frame_bytes * start.rate)
        audio = f"{start.rate} Hz x{start.channels} {8 * start.width}-bit, {chunks} chunks, {audio_ms} ms"
        return f"{line}; synthesize: {audio}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--synthesize", metavar="TEXT", help="also ask for speech and check the audio that comes back")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for each answer")
    args = parser.parse_args()
    try:
        print(asyncio.run(probe(args.host, args.port, args.synthesize, args.timeout_s)))
    except (ProbeError, OSError, TimeoutError) as exc:
        print(f"wyoming probe {args.host}:{args.port}: {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
