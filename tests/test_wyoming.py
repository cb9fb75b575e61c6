"""The Wyoming TTS server, through the wyoming package's own client as Home Assistant uses it,
against the daemon in this process with a real mosquitto and the tone engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from s2s_daemon.app import Daemon
from s2s_daemon.config import load_config
from s2s_daemon.errors import UnavailableError
from s2s_daemon.intake.wyoming import event_bytes, language_codes
from s2s_daemon.pipeline.segment import split_sentences
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import REPO, daemon_in_process, write_config
from tests.support.mqtt import Recorder, recorder
from tests.support.wait import until

pytestmark = pytest.mark.timeout(30)

RATE = 24_000
FRAME = 1920
"""Samples in one 80 ms codec frame of the tone engine."""


def tone_samples(text: str, ms_per_char: float) -> int:
    """What the tone engine makes for ``text`` (tests/support/tone_engine.py)."""
    return max(1, round(len(text) * ms_per_char / 80.0)) * FRAME


@dataclass
class Running:
    port: int
    rec: Recorder


@contextlib.asynccontextmanager
async def daemon(
    tmp_path: Path, broker: Mosquitto, options: dict[str, str] | None = None, **sections: Any
) -> AsyncIterator[Running]:
    port = free_port()
    wyoming = {"enabled": True, "host": "127.0.0.1", "port": port, "zeroconf": False, **sections.pop("wyoming", {})}
    tts = {"chunk_frames": 1, "options": {"speed": "0", **(options or {})}, **sections.pop("tts", {})}
    path = write_config(tmp_path / "daemon.yaml", broker.port, wyoming=wyoming, tts=tts, **sections)
    async with recorder(broker.port) as rec, daemon_in_process(path):
        await wait_listening(port)
        yield Running(port, rec)


async def accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def wait_listening(port: int, timeout_s: float = 10.0) -> None:
    await until(lambda: accepts(port), timeout_s, f"a listener on {port}")


@dataclass
class Group:
    """One audio-start ... audio-stop."""

    start: AudioStart
    chunks: list[AudioChunk] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    stopped: bool = False

    @property
    def samples(self) -> int:
        return sum(len(c.audio) for c in self.chunks) // 2


@dataclass
class Answer:
    groups: list[Group] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    synthesize_stopped: bool = False
    errors: list[Error] = field(default_factory=list)


async def read_answer(client: AsyncTcpClient, streaming: bool, timeout_s: float = 10.0) -> Answer:
    """Events until ``audio-stop`` (plain synthesize) or ``synthesize-stopped`` (streaming), an error,
    or the end of the connection."""
    answer = Answer()
    async with asyncio.timeout(timeout_s):
        while (event := await client.read_event()) is not None:
            answer.events.append(event)
            if AudioStart.is_type(event.type):
                answer.groups.append(Group(AudioStart.from_event(event)))
            elif AudioChunk.is_type(event.type):
                answer.groups[-1].chunks.append(AudioChunk.from_event(event))
                answer.groups[-1].arrived.append(time.monotonic())
            elif AudioStop.is_type(event.type):
                answer.groups[-1].stopped = True
                if not streaming:
                    break
            elif SynthesizeStopped.is_type(event.type):
                answer.synthesize_stopped = True
                break
            elif Error.is_type(event.type):
                answer.errors.append(Error.from_event(event))
    return answer


def frequency_hz(group: Group) -> float:
    samples = np.frombuffer(b"".join(c.audio for c in group.chunks), dtype="<i2").astype(np.float32)
    crossings = np.count_nonzero(np.diff(np.signbit(samples)))
    return crossings / 2 / (len(samples) / RATE)


# -- text, no daemon ---------------------------------------------------------------------------


def test_sentences_are_cut_at_their_ends_only() -> None:
    assert split_sentences("Hello there. How are you? I am", 100) == (["Hello there.", "How are you?"], " I am")
    assert split_sentences("Pi is 3.14 and", 100) == ([], "Pi is 3.14 and")  # no space after the dot
    assert split_sentences("Done.", 100) == ([], "Done.")  # the next delta may be "5 percent"
    assert split_sentences('He said "Hi." Then', 100) == (['He said "Hi."'], " Then")
    cjk = split_sentences("你好。今天很好！明", 100)  # noqa: RUF001 -- full-width marks are the point
    assert cjk == (["你好。", "今天很好！"], "明")  # noqa: RUF001 -- full-width marks are the point
    assert split_sentences("... Hello. ", 100) == (["... Hello."], " ")
    sentences, rest = split_sentences("word " * 30, 20)
    assert all(len(s) <= 20 for s in sentences) and len(rest.strip()) <= 20
    assert language_codes(("auto", "chinese", "english", "german", "sichuan_dialect")) == ["zh", "en", "de"]


# -- the protocol ------------------------------------------------------------------------------


@pytest.mark.integration
async def test_describe_lists_the_voices_and_streaming(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with daemon(tmp_path, mosquitto) as d, AsyncTcpClient("127.0.0.1", d.port) as client:
        await client.write_event(Describe().event())
        event = await asyncio.wait_for(client.read_event(), 5)
        assert event is not None and Info.is_type(event.type)
        info = Info.from_event(event)
        assert len(info.tts) == 1
        program = info.tts[0]
        assert program.installed and program.supports_synthesize_streaming
        assert program.name == "s2s kitchen" and program.version and program.attribution.url
        assert [v.name for v in program.voices] == ["Ryan", "Vivian"]
        assert all(v.installed and v.languages == ["en", "zh", "de"] for v in program.voices)


@pytest.mark.integration
async def test_synthesize_streams_audio_as_it_is_made(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = "The kettle is boiling now."  # 26 characters: 1.04 s of tone
    async with daemon(tmp_path, mosquitto, {"speed": "1", "ms_per_char": "40"}) as d:
        async with AsyncTcpClient("127.0.0.1", d.port) as client:
            began = time.monotonic()
            await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="vivian")).event())
            answer = await read_answer(client, streaming=False)
        assert not answer.errors and len(answer.groups) == 1
        group = answer.groups[0]
        assert (group.start.rate, group.start.width, group.start.channels) == (RATE, 2, 1)
        assert group.stopped and len(group.chunks) >= 2
        assert all((c.rate, c.width, c.channels) == (RATE, 2, 1) for c in group.chunks)
        assert abs(group.samples - tone_samples(text, 40)) <= FRAME
        first, last = group.arrived[0] - began, group.arrived[-1] - began
        assert first < last / 2, (first, last)  # streamed while synthesizing, not after
        assert abs(frequency_hz(group) - 660.0) < 20  # Vivian's tone, not Ryan's 440 Hz
        # reported like any other request
        fin = await d.rec.wait_for(lambda: [p for p in d.rec.payloads("/tts/finished")], timeout_s=5)
        assert fin[0]["status"] == "completed" and fin[0]["audioMs"] == pytest.approx(1000 * group.samples / RATE)
        lat = await d.rec.wait_for(lambda: d.rec.payloads("/metrics/latency"), timeout_s=5)
        assert lat[0]["id"] == fin[0]["id"] and lat[0]["ttfaMs"] is not None
        assert fin[0]["origin"] == lat[0]["origin"] == "wyoming" and lat[0]["output"] == "caller"


@pytest.mark.integration
async def test_streamed_text_comes_back_one_group_per_sentence(tmp_path: Path, mosquitto: Mosquitto) -> None:
    sentences = ["Hi there.", "This one is a bit longer!", "And the third sentence is the longest of them?"]
    message = " ".join(sentences)
    deltas = [message[i : i + 4] for i in range(0, len(message), 4)]
    async with daemon(tmp_path, mosquitto, {"ms_per_char": "80"}) as d:
        async with AsyncTcpClient("127.0.0.1", d.port) as client:
            sent_last: list[float] = []

            async def llm() -> None:  # as Home Assistant writes an LLM's deltas, beside reading the audio
                await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="Ryan")).event())
                for delta in deltas:
                    await client.write_event(SynthesizeChunk(text=delta).event())
                    await asyncio.sleep(0.03)  # the scenario: an LLM's pace
                sent_last.append(time.monotonic())
                await client.write_event(Synthesize(text=message, voice=SynthesizeVoice(name="Ryan")).event())
                await client.write_event(SynthesizeStop().event())

            writer = asyncio.create_task(llm())
            answer = await read_answer(client, streaming=True)
            await writer
    assert not answer.errors and answer.synthesize_stopped
    assert [g.samples for g in answer.groups] == [tone_samples(s, 80) for s in sentences]  # in order, no copy
    assert all(g.stopped and (g.start.rate, g.start.width, g.start.channels) == (RATE, 2, 1) for g in answer.groups)
    assert answer.groups[0].arrived[0] < sent_last[0]  # the first sentence spoke before the text ended
    letters = {"audio-start": "S", "audio-chunk": "c", "audio-stop": "E", "synthesize-stopped": "!"}
    sequence = "".join(letters.get(e.type, "?") for e in answer.events)
    assert re.fullmatch(r"(Sc+E){3}!", sequence), sequence  # whole groups, never interleaved
    fin = await d.rec.wait_for(lambda: len(d.rec.finished()) == 3 and d.rec.finished(), timeout_s=5)
    assert {p["status"] for p in fin.values()} == {"completed"}
    assert len({p["sessionId"] for p in fin.values()}) == 1  # one stream, one session


@pytest.mark.integration
async def test_a_client_that_leaves_frees_the_engine(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with daemon(tmp_path, mosquitto, {"speed": "1", "ms_per_char": "400"}) as d:
        async with AsyncTcpClient("127.0.0.1", d.port) as first:
            await first.write_event(Synthesize(text="z" * 50).event())  # 20 s of audio
            while (event := await asyncio.wait_for(first.read_event(), 5)) is not None:
                if AudioChunk.is_type(event.type):
                    break
        began = time.monotonic()
        async with AsyncTcpClient("127.0.0.1", d.port) as second:
            await second.write_event(Synthesize(text="ok").event())  # 0.8 s
            answer = await read_answer(second, streaming=False, timeout_s=5)
        assert answer.groups and answer.groups[0].stopped and not answer.errors
        assert time.monotonic() - began < 3.0
        fin = await d.rec.wait_for(lambda: len(d.rec.finished()) == 2 and d.rec.finished(), timeout_s=5)
        statuses = sorted(p["status"] for p in fin.values())
        assert statuses[0] == "completed" and statuses[1] in ("interrupted", "cancelled"), fin


@pytest.mark.integration
async def test_bad_requests_get_an_error_and_the_server_carries_on(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async def exchange(port: int, *events: Event | bytes) -> Answer:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            for item in events:
                if isinstance(item, bytes):
                    assert client._writer is not None
                    client._writer.write(item)
                else:
                    await client.write_event(item)
            return await read_answer(client, streaming=False, timeout_s=5)

    def code(answer: Answer) -> str | None:
        assert len(answer.errors) == 1, answer.events
        return answer.errors[0].code

    async with daemon(tmp_path, mosquitto, tts={"max_text_chars": 50}) as d:
        assert code(await exchange(d.port, b"this is not JSON\n")) == "bad_payload"
        assert code(await exchange(d.port, b'{"type": "synthesize", "payload_length": -3}\n')) == "bad_payload"
        assert code(await exchange(d.port, Event("synthesize", {"voice": {"name": "Ryan"}}))) == "bad_payload"
        assert code(await exchange(d.port, Synthesize(text="   ").event())) == "empty_text"
        assert code(await exchange(d.port, Synthesize(text="x" * 51).event())) == "text_too_long"
        unknown = SynthesizeVoice(name="Nobody")
        assert code(await exchange(d.port, Synthesize(text="Hello.", voice=unknown).event())) == "unknown_voice"
        assert code(await exchange(d.port, SynthesizeStart(voice=unknown).event())) == "unknown_voice"
        assert code(await exchange(d.port, SynthesizeChunk(text="no start").event())) == "bad_payload"
        # an unknown event is dropped (as Wyoming servers do) and the connection goes on
        ok = await exchange(d.port, Event("frobnicate", {"x": 1}), Synthesize(text="Still here.").event())
        assert not ok.errors and ok.groups and ok.groups[0].stopped
        # and a new client is served
        again = await exchange(d.port, Synthesize(text="Hello again.").event())
        assert not again.errors and again.groups[0].samples == tone_samples("Hello again.", 40)

        def rejected() -> list[str]:
            return sorted(p["error"]["code"] for p in d.rec.payloads("/tts/finished") if p["status"] == "rejected")

        await d.rec.wait_for(lambda: len(rejected()) >= 2)  # answered on MQTT too, once it is connected
        await d.rec.settle()
        assert rejected() == ["empty_text", "text_too_long"]


# -- limits: sizes, timeouts, connections ------------------------------------------------------


async def raw_events(port: int, data: bytes, timeout_s: float = 5.0) -> tuple[list[Event], float]:
    """Send ``data`` as it is (no more), read events until the server hangs up: the events and
    when (seconds after sending) the connection ended."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    events: list[Event] = []
    try:
        if data:
            writer.write(data)
            await writer.drain()
        began = time.monotonic()
        async with asyncio.timeout(timeout_s):
            while (event := await async_read_event(reader)) is not None:
                events.append(event)
        return events, time.monotonic() - began
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.integration
async def test_an_event_longer_than_the_limit_is_refused_before_its_body(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """A 2 MiB chunk held the event loop for over a minute; any event past ``wyoming.max_event_bytes``
    is now refused from its header, without waiting for (or holding) its body."""
    async with daemon(tmp_path, mosquitto, wyoming={"max_event_bytes": 65_536}) as d:
        start = event_bytes(SynthesizeStart().event())
        header = json.dumps({"type": "synthesize-chunk", "data_length": 4 * 1024 * 1024}).encode() + b"\n"
        events, _ = await raw_events(d.port, start + header)  # the 4 MiB never follow
        errors = [Error.from_event(e) for e in events if Error.is_type(e.type)]
        assert [e.code for e in errors] == ["bad_payload"], events
        assert "longer than 65536 (wyoming.max_event_bytes)" in (errors[0].text or "")
        events, _ = await raw_events(d.port, b'{"type": "describe", "pad": "' + b"x" * 70_000 + b'"}\n')
        assert [Error.from_event(e).code for e in events if Error.is_type(e.type)] == ["bad_payload"]
        again = await read_answer_of(d.port, Synthesize(text="Still here.").event())
        assert not again.errors and again.groups and again.groups[0].stopped


async def read_answer_of(port: int, *events: Event, streaming: bool = False) -> Answer:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        for event in events:
            await client.write_event(event)
        return await read_answer(client, streaming=streaming, timeout_s=10)


@pytest.mark.integration
async def test_a_streamed_text_past_the_text_limit_ends_with_text_too_long(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """A stream's chunks were added to its buffer without a limit: they count against
    ``tts.max_text_chars`` together, as an MQTT stream's pieces do."""
    async with daemon(tmp_path, mosquitto, tts={"max_text_chars": 50}) as d:
        chunks = [SynthesizeChunk(text="Ab. " * 10).event(), SynthesizeChunk(text="Cd. " * 10).event()]
        answer = await read_answer_of(d.port, SynthesizeStart().event(), *chunks, streaming=True)
        assert [e.code for e in answer.errors] == ["text_too_long"], answer.events
        assert "grew past 50 characters (tts.max_text_chars)" in (answer.errors[0].text or "")
        # the sentences before it, but the last one of the first chunk: the text stage held it back
        # (the sentence being written: the next word could still have joined it)
        assert len(answer.groups) == 9 and all(g.stopped for g in answer.groups)
        long = await read_answer_of(d.port, Synthesize(text="x" * 51).event())
        assert [e.code for e in long.errors] == ["text_too_long"]


@pytest.mark.integration
async def test_idle_and_half_sent_events_are_closed_but_a_busy_client_is_not(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Idle connections stayed open for good and a half-sent event held its buffer: now a client
    with nothing in flight is closed after ``idle_timeout_s``, an event not whole within
    ``event_timeout_s`` is answered ``bad_payload`` and closed, and a client waiting for its audio
    is never idle."""
    wyoming = {"idle_timeout_s": 0.5, "event_timeout_s": 0.5}
    async with daemon(tmp_path, mosquitto, {"speed": "1", "ms_per_char": "40"}, wyoming=wyoming) as d:
        events, after_s = await raw_events(d.port, b"")
        assert events == [] and 0.4 < after_s < 4.0
        events, _ = await raw_events(d.port, b'{"type": "synth')
        errors = [Error.from_event(e) for e in events if Error.is_type(e.type)]
        assert [e.code for e in errors] == ["bad_payload"] and "within 0.5 s" in (errors[0].text or "")
        # 1.6 s of audio at real time, three idle times: delivered whole
        answer = await read_answer_of(d.port, Synthesize(text="x" * 40).event())
        assert not answer.errors and answer.groups[0].stopped
        assert answer.groups[0].samples == tone_samples("x" * 40, 40)


@pytest.mark.integration
async def test_connections_past_the_cap_are_refused_at_accept(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Any number of idle connections were kept (each a file descriptor: at the process's limit the
    daemon died); past ``wyoming.max_connections`` one is answered an error event and closed."""
    async with daemon(tmp_path, mosquitto, wyoming={"max_connections": 3}) as d:
        held = [await asyncio.open_connection("127.0.0.1", d.port) for _ in range(3)]
        try:
            events, _ = await raw_events(d.port, b"")
            errors = [Error.from_event(e) for e in events if Error.is_type(e.type)]
            assert [e.code for e in errors] == ["too_many_connections"], events
            assert "3 at once (wyoming.max_connections)" in (errors[0].text or "")
        finally:
            for _, writer in held:
                writer.close()
        # their places free up as they close
        async with asyncio.timeout(10):
            while True:
                with contextlib.suppress(OSError):  # refused while the server has not seen them go
                    answer = await read_answer_of(d.port, Synthesize(text="Hello.").event())
                    if not answer.errors:
                        break
                await asyncio.sleep(0.05)
        assert answer.groups[0].stopped


@pytest.mark.integration
async def test_drain_finishes_the_running_synthesis(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = "x" * 24 + "."  # one second of audio at real time (a sentence: the text stage leaves it)
    port = free_port()
    wyoming = {"enabled": True, "host": "127.0.0.1", "port": port, "zeroconf": False}
    tts = {"chunk_frames": 1, "options": {"speed": "1", "ms_per_char": "40"}}
    path = write_config(tmp_path / "daemon.yaml", mosquitto.port, wyoming=wyoming, tts=tts)
    async with daemon_in_process(path) as running:
        await wait_listening(port)
        samples, kinds = 0, []
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Synthesize(text=text).event())
            while (event := await asyncio.wait_for(client.read_event(), 8)) is not None:
                kinds.append(event.type)
                if AudioChunk.is_type(event.type):
                    if not samples:
                        running.request_stop()  # SIGTERM's path: drain, with this synthesis running
                    samples += len(AudioChunk.from_event(event).audio) // 2
                if AudioStop.is_type(event.type):
                    break
        assert kinds[0] == "audio-start" and kinds[-1] == "audio-stop"
        assert samples == tone_samples(text, 40)

        async def refused() -> bool:
            return not await accepts(port)

        await until(refused, 5, "the listener closed")  # no longer accepting


@pytest.mark.integration
async def test_a_taken_port_is_unavailable(tmp_path: Path, mosquitto: Mosquitto) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        wyoming = {"enabled": True, "host": "127.0.0.1", "port": port, "zeroconf": False}
        path = write_config(tmp_path / "daemon.yaml", mosquitto.port, wyoming=wyoming)
        with pytest.raises(
            UnavailableError, match=f"wyoming.port: cannot listen on 127.0.0.1:{port}: the port is in use"
        ):
            await asyncio.wait_for(Daemon(load_config(path, environ={})).run(), 10)


@pytest.mark.integration
def test_enabled_without_the_package_exits_69_naming_the_extra(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "wyoming.py").write_text("raise ImportError('wyoming hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}
    path = tmp_path / "c.yaml"
    path.write_text(
        json.dumps({"mqtt": {"port": free_port()}, "audio": {"sink": "discard"}, "wyoming": {"enabled": True}})
    )
    result = subprocess.run(
        [sys.executable, "-m", "s2s_daemon", "run", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 69, result.stderr
    assert "s2s-daemon[wyoming]" in result.stderr


# -- zeroconf ----------------------------------------------------------------------------------


def multicast_route() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("224.0.0.251", 5353))
        except OSError:
            return False
    return True


@pytest.mark.integration
@pytest.mark.skipif(not multicast_route(), reason="no IPv4 route for mDNS multicast (224.0.0.251) on this host")
async def test_zeroconf_advertises_the_server(tmp_path: Path, mosquitto: Mosquitto) -> None:
    from zeroconf import ServiceStateChange, Zeroconf
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

    found: asyncio.Queue[str] = asyncio.Queue()

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added:
            found.put_nowait(name)

    async with daemon(tmp_path, mosquitto, wyoming={"host": "0.0.0.0", "zeroconf": True}) as d:
        browser_zc = AsyncZeroconf()
        browser = AsyncServiceBrowser(browser_zc.zeroconf, ["_wyoming._tcp.local."], handlers=[on_change])
        try:
            async with asyncio.timeout(8):
                while (name := await found.get()) and not name.startswith("s2s-kitchen"):
                    pass
            info = AsyncServiceInfo("_wyoming._tcp.local.", name)
            assert await info.async_request(browser_zc.zeroconf, 3000)
            assert info.port == d.port and info.parsed_addresses()
        finally:
            await browser.async_cancel()
            await browser_zc.async_close()


@pytest.mark.integration
async def test_zeroconf_on_loopback_is_skipped_without_a_warning(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """The documented case (Home Assistant on this machine, Wyoming on 127.0.0.1): nothing to
    advertise and nothing wrong, so an info line, not a warning (issue 41, item 12)."""
    with structlog.testing.capture_logs() as logs:
        async with daemon(tmp_path, mosquitto, wyoming={"host": "127.0.0.1", "zeroconf": True}):
            pass
    skipped = [e for e in logs if e["event"] == "wyoming_zeroconf_skipped"]
    assert [e["log_level"] for e in skipped] == ["info"]
    assert not [e for e in logs if e["event"].startswith("wyoming_zeroconf") and e["log_level"] == "warning"]
