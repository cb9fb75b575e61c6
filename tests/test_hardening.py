"""What a stranger or a careless client must not get or do beside the HTTP port's own guards (issue
42, item 8): the voice library's recording served from the file that was checked, two edits of the
same voice at once, a retained say spoken at every start, the embedded broker's packet and retained
bounds, the machine and the model's path shown to strangers, the journal readable by every user, a
short or readable API key. Real parts: the daemon (in this process or as a subprocess), mosquitto,
the embedded broker, aiohttp, paho (aiomqtt) and the ``voices`` command."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import aiomqtt
import psutil
import pytest
from structlog.testing import capture_logs

from s2s_daemon.cli import main
from s2s_daemon.intake.http.voice_admin import VoiceAdmin
from s2s_daemon.intake.wyoming import describe
from s2s_daemon.mqtt import broker as embedded
from s2s_daemon.mqtt.broker import EmbeddedBroker
from s2s_daemon.pipeline import voice_edits
from s2s_daemon.pipeline.journal import RequestJournal
from s2s_daemon.pipeline.vocabulary import EngineInfo
from s2s_daemon.pipeline.voice_edits import VoiceEditError, add_voice, read_audio
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import DaemonProcess, daemon_in_process, write_config
from tests.support.mqtt import recorder
from tests.support.wait import until
from tests.test_http_speech import speech_api, wait_ready
from tests.test_http_voices import REF_WAV
from tests.test_web_api import _audio_file, _error, _form, recording, web_api

__all__ = ["recording"]  # the recording engine's fixture, used here as in tests/test_web_api.py

SAY = "s2s/kitchen/tts/say"


# -- the recording's download --------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("swap", ["file", "folder"])
async def test_a_recording_swapped_for_a_link_after_its_check_is_not_served(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any], monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    """Someone who may write the voices folder swaps ``ref.wav`` (or the voice's folder) for a link
    to a file outside it between the daemon's check and its opening of the file."""
    secret = tmp_path / "outside" / "ref.wav"
    secret.parent.mkdir()
    secret.write_bytes(b"RIFF secret outside the voices folder")
    found = VoiceAdmin._find_blocking

    def find_then_swap(self: VoiceAdmin, name: str) -> Any:
        voice = found(self, name)  # the check passed: a file inside the folder
        folder = tmp_path / "voices" / "alice"
        if swap == "file":
            (folder / "ref.wav").unlink()
            (folder / "ref.wav").symlink_to(secret)
        else:
            folder.rename(tmp_path / "voices" / ".alice-moved")
            folder.symlink_to(secret.parent, target_is_directory=True)
        return voice

    async with web_api(tmp_path, mosquitto) as (_, session):
        async with session.post("/api/voices", data=_form(_audio_file(), name="alice")) as added:
            assert added.status == 201, await added.text()
        async with session.get("/api/voices/alice/reference") as served:
            assert served.status == 200 and (await served.read())[:4] == b"RIFF"
        monkeypatch.setattr(VoiceAdmin, "_find_blocking", find_then_swap)
        async with session.get("/api/voices/alice/reference") as refused:
            body = await refused.read()
            assert b"secret" not in body
            assert refused.status == 404, body
            assert (await _error(refused))["code"] == "no_reference"


# -- two edits of one voice at once --------------------------------------------------------------


def _cli_adds_meanwhile(monkeypatch: pytest.MonkeyPatch, root: Path, name: str) -> None:
    """While the next ``add_voice`` writes its recording, ``s2s-daemon voices add`` adds ``name``."""
    original = voice_edits.write_wav

    def racing(path: Path, audio: Any) -> None:
        monkeypatch.setattr(voice_edits, "write_wav", original)
        assert main(["voices", "add", name, "--ref-audio", str(REF_WAV), "--dir", str(root)]) == 0
        original(path, audio)

    monkeypatch.setattr(voice_edits, "write_wav", racing)


def test_a_voice_added_by_another_edit_meanwhile_is_a_conflict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "voices"
    audio = read_audio(REF_WAV)
    _cli_adds_meanwhile(monkeypatch, root, "bob")
    with pytest.raises(VoiceEditError) as lost:
        add_voice(root, "bob", audio=audio)
    assert lost.value.code == "voice_exists" and "at the same time" in str(lost.value)
    # the command line losing the race: a message and its exit status, not a traceback
    _cli_adds_meanwhile(monkeypatch, root, "carol")
    assert main(["voices", "add", "carol", "--ref-audio", str(REF_WAV), "--dir", str(root)]) == 64
    assert "at the same time" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["bob", "carol"]  # nothing staged left


@pytest.mark.integration
async def test_the_page_and_the_command_adding_one_voice_at_once_is_409(
    tmp_path: Path, mosquitto: Mosquitto, recording: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with web_api(tmp_path, mosquitto) as (_, session):
        _cli_adds_meanwhile(monkeypatch, tmp_path / "voices", "dora")
        async with session.post("/api/voices", data=_form(_audio_file(), name="dora")) as added:
            error = await _error(added)
            assert (added.status, error["code"], error["param"]) == (409, "voice_exists", "name"), error
        async with session.get("/api/voices/dora") as listed:  # the command's voice is there
            assert listed.status == 200


# -- MQTT: a retained say, the embedded broker ---------------------------------------------------


@pytest.mark.integration
async def test_a_retained_say_is_not_spoken_again_at_start(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
        await client.publish(SAY, '{"text": "Kept by the broker.", "id": "retained"}', qos=1, retain=True)
    path = write_config(tmp_path / "daemon.yaml", mosquitto.port)

    def online(count: int) -> bool:  # the daemon says online once subscribed: the retained say came
        return sum(m.payload == b"online" for m in rec.on("/kitchen/status")) >= count

    async with recorder(mosquitto.port) as rec:
        async with daemon_in_process(path):
            await rec.wait_for(lambda: online(1), 30)
            await rec.say(SAY, {"text": "Sent now.", "id": "now"})
            await rec.say(SAY, {"text": "Sent now, retained.", "id": "now-retained"}, retain=True)
            finished = await rec.wait_finished(["now", "now-retained"], timeout_s=30)
        assert "retained" not in finished and "retained" not in [p["id"] for p in rec.payloads("/tts/started")]
        assert finished["now-retained"]["status"] == "completed"  # sent to us live: spoken once
        async with daemon_in_process(path):  # restarted: neither retained say again
            await rec.wait_for(lambda: online(2), 30)
            await rec.say(SAY, {"text": "After the restart.", "id": "after"})
            finished = await rec.wait_finished(["after"], timeout_s=30)
    started = [p["id"] for p in rec.payloads("/tts/started")]
    assert started.count("now-retained") == 1 and "retained" not in started


def _packet(kind: int, body: bytes) -> bytes:
    """An MQTT packet: its type and flags, its remaining length (a varint), its body."""
    length, encoded = len(body), bytearray()
    while True:
        length, digit = divmod(length, 128)
        encoded.append(digit | (0x80 if length else 0))
        if not length:
            return bytes([kind]) + bytes(encoded) + body


async def _publish_raw(port: int, topic: str, payload: bytes) -> None:
    """CONNECT and PUBLISH (QoS 0) over a raw socket, as any client may, then DISCONNECT; a broker
    that closes the connection meanwhile ends it early."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_packet(0x10, b"\x00\x04MQTT\x04\x02\x00\x3c\x00\x03big"))
        assert (await asyncio.wait_for(reader.readexactly(4), 10))[:2] == b"\x20\x02"  # CONNACK
        name = topic.encode()
        writer.write(_packet(0x30, len(name).to_bytes(2, "big") + name + payload))
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(writer.drain(), 10)
            writer.write(_packet(0xE0, b""))  # DISCONNECT
            await asyncio.wait_for(writer.drain(), 10)
            await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def _embedded() -> Any:
    port = free_port()
    broker = EmbeddedBroker(port)
    await broker.start()
    try:
        yield port, broker
    finally:
        await broker.stop()


# amqtt leaves the transport of a session it closed to the garbage collector (tests/test_messages.py).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning")
async def test_the_embedded_broker_bounds_packets_and_retained_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "MAX_RETAINED", 5)
    v311 = aiomqtt.ProtocolVersion.V311
    async with _embedded() as (port, broker):
        async with aiomqtt.Client("127.0.0.1", port, protocol=v311, identifier="watcher") as watcher:
            await watcher.subscribe("big/#")
            with capture_logs() as logs:
                await _publish_raw(port, "big/one", b"x" * (embedded.MAX_PACKET_BYTES + 1))
            async with aiomqtt.Client("127.0.0.1", port, protocol=v311, identifier="small") as small:
                await small.publish("big/small", b"fits", qos=1)
            async with asyncio.timeout(10):
                message = await anext(aiter(watcher.messages))
            assert (str(message.topic), message.payload) == ("big/small", b"fits")  # not the big one
        refused = [e["limit"] for e in logs if e["event"] == "embedded_broker_packet_refused"]
        assert refused == [embedded.MAX_PACKET_BYTES]
        async with aiomqtt.Client("127.0.0.1", port, protocol=v311) as client:
            for i in range(8):
                await client.publish(f"kept/{i}", b"x", qos=1, retain=True)
            await client.publish("kept/0", b"updated", qos=1, retain=True)  # an update of a kept topic
        kept = broker._broker.retained_messages
        assert sorted(kept) == [f"kept/{i}" for i in range(5)] and kept["kept/0"].data == b"updated"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning")
async def test_a_subscriber_joining_while_retained_messages_arrive_gets_each_once() -> None:
    """amqtt keeps a retained message as it arrives and sends it on from a queue; a client that
    subscribed in between got it twice (once kept, once sent on). Seven subscribers join during a
    burst of retained messages, each when the broker has kept a further share of them."""
    v311 = aiomqtt.ProtocolVersion.V311
    count, joins = 900, range(100, 900, 130)  # under MAX_RETAINED
    async with _embedded() as (port, broker):
        kept = broker._broker.retained_messages
        async with contextlib.AsyncExitStack() as stack:
            publisher = await stack.enter_async_context(aiomqtt.Client("127.0.0.1", port, protocol=v311))

            async def burst() -> None:
                for i in range(count):
                    await publisher.publish(f"burst/{i}", b"x", retain=True)
                await publisher.publish("burst/end", b"end", qos=1)  # after all of them, not retained

            def kept_at_least(share: int) -> bool:
                return len(kept) >= share

            sending = asyncio.create_task(burst())
            subscribers = []
            for share in joins:
                await until(functools.partial(kept_at_least, share), 30, f"{share} kept", 0.001)
                subscriber = await stack.enter_async_context(aiomqtt.Client("127.0.0.1", port, protocol=v311))
                await subscriber.subscribe("burst/#")
                subscribers.append(subscriber)
            await sending
            mixed = 0
            for subscriber in subscribers:
                topics, retained = [], 0
                async with asyncio.timeout(30):
                    async for message in subscriber.messages:
                        if str(message.topic) == "burst/end":
                            break
                        topics.append(str(message.topic))
                        retained += message.retain
                assert sorted(topics) == sorted(f"burst/{i}" for i in range(count)), len(topics)
                mixed += 0 < retained < count  # it joined during the burst: some kept, some sent on live
            assert mixed  # the test saw the window it is about


# -- what strangers see --------------------------------------------------------------------------


def test_wyoming_info_names_a_local_model_by_its_folder_not_its_path() -> None:
    info = EngineInfo(
        engine="torch",
        model="/home/alice/models/Qwen3-TTS-12Hz-0.6B-CustomVoice",
        device="cpu",
        sample_rate=24000,
        voices=("Ryan",),
        languages=("english",),
    )
    description = describe(info, "kitchen").tts[0].description
    assert description is not None and "Qwen3-TTS-12Hz-0.6B-CustomVoice" in description
    assert "/home/alice" not in description


def _outside_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


@pytest.mark.integration
async def test_the_machine_is_shown_only_to_this_machine_or_a_key_holder(tmp_path: Path, mosquitto: Mosquitto) -> None:
    outside = _outside_address()
    if outside is None:
        pytest.skip("this machine has no address but loopback")
    async with speech_api(tmp_path, mosquitto, api_key=None, http={"host": "0.0.0.0"}) as api:
        for host, shown in (("127.0.0.1", True), (outside, False)):
            async with (
                aiohttp.ClientSession(f"http://{host}:{api.port}") as session,
                session.get("/api/status") as status,
            ):
                assert status.status == 200
                machine = (await status.json())["machine"]
                assert (machine is not None) is shown, (host, machine)
                if shown:
                    assert machine["hostname"] == socket.gethostname()


# -- private files, the key ----------------------------------------------------------------------


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_the_journal_is_private_whatever_the_umask(tmp_path: Path, umask_022: None) -> None:
    fresh = RequestJournal(tmp_path / "fresh.sqlite3", 16)
    fresh.open()
    fresh.close()
    assert stat.S_IMODE((tmp_path / "fresh.sqlite3").stat().st_mode) == 0o600
    old = tmp_path / "old.sqlite3"  # left world-readable by an earlier version
    old.touch(mode=0o644)
    old.chmod(0o644)
    journal = RequestJournal(old, 16)
    journal.open()
    journal.close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o600


@pytest.mark.integration
async def test_a_short_key_is_refused_and_a_readable_key_file_is_warned_about(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    key = tmp_path / "api.key"
    key.write_text("x\n")
    port = free_port()
    config = write_config(tmp_path / "daemon.yaml", mosquitto.port, http={"enabled": True, "port": port,
                                                                         "api_key_file": str(key)})  # fmt: skip
    short = DaemonProcess(config, log_path=tmp_path / "short.log")
    short.start()
    try:
        assert await short.wait(30) == 78
    finally:
        short.cleanup()
    assert "http.api_key_file" in short.log() and "at least 16" in short.log()
    key.write_text("sk-0123456789abcdef\n")
    key.chmod(0o644)
    readable = DaemonProcess(config, log_path=tmp_path / "readable.log")
    readable.start()
    try:
        await wait_ready(port, 30)
        assert "api_key_file_readable" in readable.log()
        readable.signal(signal.SIGTERM)
        assert await readable.wait(30) == 0
    finally:
        readable.cleanup()
