"""Three Wyoming clients at once against the daemon as a subprocess (the tone engine at real time,
a real mosquitto), through the wyoming package's own client as Home Assistant uses it: each gets
its own complete audio group, byte for byte what a lone request for its text gets; with
``tts.max_streams`` of 4 all three are synthesized together, with 2 two at a time, with 1 one
after another; the daemon serves on afterwards and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize, SynthesizeVoice

from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, write_config
from tests.support.mqtt import recorder
from tests.test_wyoming import RATE, Group, read_answer, tone_samples, wait_listening

pytestmark = pytest.mark.integration

MS_PER_CHAR = 40.0
CHUNK_FRAMES = 3
"""240 ms of audio a chunk: a synthesis that starts when another ends sends its first chunk that
long after the other's ``audio-stop``, a margin against a busy machine reordering the two."""
CLIENTS = [
    ("Ryan", "the kettle in the kitchen is on."),  # 32 characters: 16 frames, 1.28 s
    ("Vivian", "please dim the lights in the living room a bit."),  # 47: 24 frames, 1.92 s
    ("Ryan", "remind me to water the tomatoes in the garden when I come home."),  # 63: 32 frames, 2.56 s
]
"""Texts of different lengths (one sentence each: one segment) and voices, so that audio
delivered to the wrong client, or two clients' audio mixed, cannot add up to the right bytes.
Each is written as the text stage speaks it (its full stop), so the stage leaves it as it is."""
LINGER_S = 0.3
"""After its ``audio-stop``, how long a client listens for anything more (there must be nothing)."""


@dataclass
class Heard:
    """What one client got for one ``synthesize``."""

    group: Group
    first_chunk_at: float
    stopped_at: float
    """When the client read ``audio-stop`` (monotonic, this process)."""

    @property
    def audio(self) -> bytes:
        return b"".join(c.audio for c in self.group.chunks)


async def synthesize(port: int, voice: str, text: str) -> Heard:
    """One client, one plain ``synthesize``: its one audio group, checked for shape."""
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name=voice)).event())
        answer = await read_answer(client, streaming=False, timeout_s=30)
        stopped_at = time.monotonic()
        with contextlib.suppress(TimeoutError):  # nothing after audio-stop (or the end): no one else's audio
            extra = await asyncio.wait_for(client.read_event(), LINGER_S)
            assert extra is None, f"{text!r}: an event after audio-stop: {extra}"
    letters = {"audio-start": "S", "audio-chunk": "c", "audio-stop": "E"}
    sequence = "".join(letters.get(e.type, "?") for e in answer.events)
    assert not answer.errors and re.fullmatch(r"Sc+E", sequence), (text, sequence, answer.errors)
    group = answer.groups[0]
    assert (group.start.rate, group.start.width, group.start.channels) == (RATE, 2, 1)
    assert all((c.rate, c.width, c.channels) == (RATE, 2, 1) for c in group.chunks)
    return Heard(group, group.arrived[0], stopped_at)


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (one that ends as another begins does not count)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_streams", [4, 2, 1])
async def test_clients_at_once_each_get_their_own_audio(tmp_path: Path, mosquitto: Mosquitto, max_streams: int) -> None:
    port = free_port()
    wyoming = {"enabled": True, "host": "127.0.0.1", "port": port, "zeroconf": False}
    tts = {
        "max_streams": max_streams,
        "chunk_frames": CHUNK_FRAMES,
        "options": {"speed": "1", "ms_per_char": str(MS_PER_CHAR)},
    }
    proc = DaemonProcess(write_config(tmp_path / "d.yaml", mosquitto.port, wyoming=wyoming, tts=tts))
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await wait_listening(port, 30)

            # all three at once, each on its own connection
            began = time.monotonic()
            together = await asyncio.gather(*(synthesize(port, voice, text) for voice, text in CLIENTS))
            took = time.monotonic() - began

            # each got its own text's audio, whole: the tone engine's length for it ...
            for (_, text), heard in zip(CLIENTS, together, strict=True):
                assert heard.group.samples == tone_samples(text, MS_PER_CHAR), (text, heard.group.samples)

            # ... streamed as it was made (real time: its first chunk came long before its stop) ...
            audio_s = [tone_samples(text, MS_PER_CHAR) / RATE for _, text in CLIENTS]
            intervals = [(h.first_chunk_at, h.stopped_at) for h in together]
            spans = [(round(a - began, 2), round(b - began, 2)) for a, b in intervals]
            assert all(b - a > s / 2 for (a, b), s in zip(intervals, audio_s, strict=True)), spans
            # ... and synthesized side by side up to max_streams, never more
            assert peak_overlap(intervals) == min(max_streams, len(CLIENTS)), (max_streams, spans)
            if max_streams >= len(CLIENTS):  # all together: less than one after another takes
                assert took < sum(audio_s), (took, spans)
            elif max_streams == 1:  # one after another: at least as long as all of them
                assert took >= sum(audio_s) * 0.95, (took, spans)

            # the daemon serves on: each text again, alone, gives the very same bytes
            for (voice, text), heard in zip(CLIENTS, together, strict=True):
                alone = await synthesize(port, voice, text)
                assert alone.audio == heard.audio, (
                    f"{text!r}: {len(heard.audio)} bytes at once, {len(alone.audio)} alone"
                )

            # and reported each request completed, with the audio its client got
            finished = await rec.wait_for(lambda: len(rec.finished()) == 2 * len(CLIENTS) and rec.finished(), 10)
            assert {p["status"] for p in finished.values()} == {"completed"}, finished
            heard_ms = sorted(round(1000 * h.group.samples / RATE, 1) for h in together)
            assert sorted(p["audioMs"] for p in finished.values()) == sorted(heard_ms * 2)
            assert proc.proc is not None and proc.proc.poll() is None
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0, proc.log()
    finally:
        proc.cleanup()
