"""Nothing accepted is ever lost (issue 15): the daemon as a real subprocess behind a real
mosquitto, under faults. Every request the broker delivered gets exactly one ``tts/finished``,
and the daemon serves the next request afterwards: an engine that stalls or wedges its thread,
SIGSTOP / SIGCONT mid-burst, a burst of 1,000 requests a fifth of them bad, and (with a real
PulseAudio server) the audio device vanishing mid-utterance and coming back."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from s2s_daemon.errors import EXIT_SOFTWARE
from tests.support.broker import Mosquitto
from tests.support.daemon import DaemonProcess, write_config
from tests.support.mqtt import BARRIER_ID, Recorder, recorder
from tests.support.pulse import SPEAKER_RATE_HZ, SPEAKER_SINK, PulseServer, pulse_available

pytestmark = pytest.mark.integration

SAY = "s2s/kitchen/tts/say"


async def online(rec: Recorder, timeout_s: float = 30) -> None:
    await rec.wait_for(lambda: rec.on("/status") and rec.on("/status")[-1].payload == b"online", timeout_s)


def open_rows(journal: Path) -> int:
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT COUNT(*) FROM requests WHERE done = 0").fetchone()[0])
    finally:
        db.close()


def answers(rec: Recorder, rid: str) -> list[dict[str, Any]]:
    return [p for p in rec.payloads("/tts/finished") if p["id"] == rid]


# -- an engine that hangs -----------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_stalled_engine_fails_its_request_once_and_the_daemon_serves_the_next(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    config = write_config(tmp_path / "d.yaml", mosquitto.port, tts={"stall_timeout_s": 1.5})
    proc = DaemonProcess(config)
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            # Stuck for 2.5 s mid-utterance: failed after 1.5 s, back within the 1.5 s grace.
            await rec.say(SAY, {"id": "stalls", "text": "this one gets stuck half way #stall=2.5"})
            await rec.say(SAY, {"id": "after", "text": "and this one is spoken"})
            fin = await rec.wait_finished(["stalls", "after"], timeout_s=20)
            assert fin["stalls"]["status"] == "error"
            assert fin["stalls"]["error"]["code"] == "engine_error"
            assert "no audio for 1.5 s" in fin["stalls"]["error"]["message"]
            assert fin["after"]["status"] == "completed"
            await rec.say(SAY, {"id": "later", "text": "one more, much later"})
            assert (await rec.wait_finished(["later"]))["later"]["status"] == "completed"
            await rec.barrier(SAY)
            for rid in ("stalls", "after", "later"):
                assert len(answers(rec, rid)) == 1, rec.payloads("/tts/finished")
            assert proc.proc is not None and proc.proc.poll() is None  # still serving
            assert "engine_recovered" in proc.log() and "engine_wedged" not in proc.log()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0
    finally:
        proc.cleanup()


@pytest.mark.timeout(90)
async def test_a_wedged_engine_thread_exits_70_and_a_restart_answers_the_queued_requests(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    config = write_config(tmp_path / "d.yaml", mosquitto.port, tts={"stall_timeout_s": 1})
    journal = config.with_suffix(".journal.sqlite3")
    proc = DaemonProcess(config)
    queued = [f"q{i}" for i in range(4)]
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            await rec.say(SAY, {"id": "wedges", "text": "this one never comes back #hang"})
            for rid in queued:
                await rec.say(SAY, {"id": rid, "text": f"waiting behind it, {rid}"})
            began = time.monotonic()
            code = await proc.wait(20)
            assert code == EXIT_SOFTWARE, proc.log()
            assert time.monotonic() - began < 1 + 1 + 5  # the stall, the grace, the drain
            log = proc.log()
            assert "engine_wedged" in log and "exiting_engine_wedged" in log
            fin = await rec.wait_finished(["wedges"])
            assert fin["wedges"]["status"] == "error" and fin["wedges"]["error"]["code"] == "engine_error"
            assert [rid for rid in queued if answers(rec, rid)] == []  # left for the restart
            assert open_rows(journal) == len(queued)
            await rec.wait_for(lambda: rec.on("/status")[-1].payload == b"offline")
            proc.start()  # what systemd's Restart=on-failure does
            fin = await rec.wait_finished(queued, timeout_s=30)
            assert {fin[rid]["status"] for rid in queued} == {"completed"}
            await rec.say(SAY, {"id": "fresh", "text": "served after the restart"})
            assert (await rec.wait_finished(["fresh"]))["fresh"]["status"] == "completed"
            await rec.barrier(SAY)
            for rid in ["wedges", *queued, "fresh"]:
                assert len(answers(rec, rid)) == 1, (rid, rec.payloads("/tts/finished"))
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0
        assert open_rows(journal) == 0
    finally:
        proc.cleanup()


# -- SIGSTOP / SIGCONT -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stopped_s", [0.5, 13.0])
async def test_sigstop_mid_burst_then_sigcont_answers_each_once(
    tmp_path: Path, mosquitto: Mosquitto, stopped_s: float
) -> None:
    """0.5 s: under the keepalive, the connection survives. 13 s: past mosquitto's 1.5 x keepalive
    (mosquitto 2.0 checks every few seconds: it dropped a stopped client after about 10 s here; it
    keeps the session) and past the stall timeout (the engine thread was stopped too: no stall)."""
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={"options": {"speed": "1", "ms_per_char": "40"}, "stall_timeout_s": 2},
        mqtt={"keepalive_s": 5, "reconnect_max_s": 1},
        queue={"max_pending": 500},
    )
    proc = DaemonProcess(config)
    text = "about one second of speech"
    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            before = [f"s{i}" for i in range(6)]
            for rid in before:
                await rec.say(SAY, {"id": rid, "text": text})
            await rec.wait_for(lambda: rec.payloads("/tts/started"))
            await asyncio.sleep(0.3)  # the scenario: stopped mid-utterance
            proc.signal(signal.SIGSTOP)
            during = [f"d{i}" for i in range(3)]
            for rid in during:  # the broker holds them (the session, or the socket's buffer)
                await rec.say(SAY, {"id": rid, "text": text})
            await asyncio.sleep(stopped_s)  # the scenario: stopped for this long
            proc.signal(signal.SIGCONT)
            everyone = before + during
            fin = await rec.wait_finished(everyone, timeout_s=30)
            assert {rid: fin[rid]["status"] for rid in everyone} == dict.fromkeys(everyone, "completed")
            await rec.say(SAY, {"id": "next", "text": "served afterwards"})
            assert (await rec.wait_finished(["next"]))["next"]["status"] == "completed"
            await rec.barrier(SAY)
            if stopped_s > 12:
                assert "mqtt_disconnected" in proc.log()  # the long stop did cost the connection
            # What the broker had sent into the stopped daemon's socket was read, journaled and
            # spoken, but after a long stop its PUBACK found the connection gone: the broker sends
            # it again (DUP), and that copy is acknowledged without a second answer.
            for rid in [*everyone, "next"]:
                assert len(answers(rec, rid)) == 1, (rid, rec.payloads("/tts/finished"))
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.signal(signal.SIGCONT)
        proc.cleanup()


# -- a burst of 1,000 requests, a fifth of them bad ------------------------------------------------

MAX_CHARS = 100
BAD: list[tuple[str, Any, str | None]] = [
    # (kind, payload: bytes, or a dict to dump with its id, the code), None: the id cannot be read
    ("invalid JSON", b'{"id": "x", "text": "unclosed', None),
    ("empty text", {"text": "   "}, "empty_text"),
    ("unknown voice", {"text": "hello", "voice": "Nobody"}, "unknown_voice"),
    ("too long", {"text": "x" * (MAX_CHARS + 1)}, "text_too_long"),
    ("text of the wrong type", {"text": 42}, "bad_payload"),
    ("not UTF-8", b"\xff\xfe{\x00 garbage \xc3\x28", None),
    ("unsupported language", {"text": "hello", "language": "klingon"}, "unsupported_language"),
    ("priority of the wrong type", {"text": "hello", "priority": "high"}, "bad_payload"),
    ("NUL in the text", {"text": "a\x00b"}, "bad_payload"),
    ("volume out of range", {"text": "hello", "volume": 5}, "bad_payload"),
]


def reply_props(index: int) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic = "test/replies"
    props.CorrelationData = str(index).encode()
    return props


@pytest.mark.timeout(120)
async def test_a_burst_of_1000_with_a_fifth_bad_answers_each_once(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={"max_text_chars": MAX_CHARS},
        queue={"max_pending": 2000},  # every good one is spoken: none is queue_full
    )
    proc = DaemonProcess(config)
    expected: dict[int, tuple[str | None, str, str | None]] = {}  # index -> (id, status, code)
    payloads: list[bytes] = []
    for index in range(1000):
        rid = f"r{index}"
        if index % 5 == 4:
            _kind, body, code = BAD[(index // 5) % len(BAD)]
            if isinstance(body, dict):
                payloads.append(json.dumps({"id": rid, **body}).encode())
                expected[index] = (rid, "rejected", code)
            else:
                payloads.append(body)
                expected[index] = (None, "rejected", "bad_payload")
        else:
            payloads.append(json.dumps({"id": rid, "text": f"good request {index}"}).encode())
            expected[index] = (rid, "completed", None)
    try:
        topics = ("s2s/kitchen/status", "s2s/kitchen/tts/finished", "test/replies")
        async with recorder(mosquitto.port, subscribe=topics) as rec:
            proc.start()
            await online(rec)
            async with aiomqtt.Client("127.0.0.1", mosquitto.port, protocol=aiomqtt.ProtocolVersion.V5) as producer:
                await asyncio.gather(
                    *(producer.publish(SAY, p, qos=1, properties=reply_props(i)) for i, p in enumerate(payloads))
                )

            def replies() -> dict[int, list[dict[str, Any]]]:
                out: dict[int, list[dict[str, Any]]] = {}
                for m in rec.on("test/replies"):
                    out.setdefault(int(m.properties.CorrelationData), []).append(m.json())
                return out

            # Cheap to ask on every message: the last one in is usually the newest reply.
            await rec.wait_for(lambda: len(rec.messages) >= 2000 and len(replies()) == 1000, timeout_s=60)
            await rec.barrier(SAY)  # anything doubled would be here by now
            got = replies()
            assert sorted(got) == list(range(1000))
            for index, (want_id, status, want_code) in expected.items():
                [reply] = got[index]  # exactly one answer per request
                assert reply["status"] == status, (index, reply)
                assert reply.get("error", {}).get("code") == want_code, (index, reply)
                if want_id is not None:
                    assert reply["id"] == want_id
            finished = [p for p in rec.payloads("/tts/finished") if not p["id"].startswith(BARRIER_ID)]
            assert len(finished) == 1000  # and on the site topic, once each
            with_id = [rid for rid, _, _ in expected.values() if rid is not None]
            assert sorted(p["id"] for p in finished if p["id"] in set(with_id)) == sorted(with_id)
            await rec.say(SAY, {"id": "one-more", "text": "still serving"})
            assert (await rec.wait_finished(["one-more"]))["one-more"]["status"] == "completed"
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0
    finally:
        proc.cleanup()


# -- the audio device vanishing mid-utterance --------------------------------------------------------


def sink_module(server: PulseServer) -> str:
    for line in server.pactl("list", "short", "modules").stdout.splitlines():
        index, name, *args = line.split("\t")
        if name == "module-null-sink" and f"sink_name={SPEAKER_SINK}" in " ".join(args):
            return index
    raise AssertionError("no spk null sink loaded")


def clock_keeper(server: PulseServer) -> subprocess.Popen[bytes]:
    """A 10 ms reader of the spk monitor: the null sink's clock (see tests/support/pulse.py)."""
    return subprocess.Popen(
        ["parec", "-d", f"{SPEAKER_SINK}.monitor", "--raw", "--latency-msec=10"],
        env=server.env(),
        stdout=subprocess.DEVNULL,
    )


@pytest.mark.audio
@pytest.mark.timeout(90)
async def test_the_speaker_vanishing_mid_utterance_is_one_audio_error_then_it_speaks_again(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    if not pulse_available():
        pytest.skip("pulseaudio is not installed (apt-get install pulseaudio libportaudio2 libasound2-plugins)")
    own = PulseServer(tmp_path / "pulse")  # its own server: the session's is shared by other tests
    own.start()
    keeper: subprocess.Popen[bytes] | None = None
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={"options": {"speed": "1", "ms_per_char": "100"}},
        audio={"sink": "speaker", "device": "pulse"},
    )
    proc = DaemonProcess(config, env=own.env())
    try:
        # Only the speaker's sink: with another one there, PulseAudio would move the stream to it.
        own.pactl("unload-module", "module-null-sink")  # both null sinks ...
        own.pactl("load-module", "module-null-sink", f"sink_name={SPEAKER_SINK}", f"rate={SPEAKER_RATE_HZ}")
        own.pactl("set-default-sink", SPEAKER_SINK)
        keeper = clock_keeper(own)  # ... and the spk clock keeper (see tests/support/pulse.py)
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            await rec.say(SAY, {"id": "cut", "text": "a long utterance of about four seconds"})
            await rec.wait_for(lambda: rec.payloads("/tts/started"), 15)
            await asyncio.sleep(0.5)  # the scenario: the device vanishes mid-utterance
            await asyncio.to_thread(own.pactl, "unload-module", sink_module(own))  # the device vanishes
            fin = await rec.wait_finished(["cut"], timeout_s=15)
            assert fin["cut"]["status"] == "error", fin
            assert fin["cut"]["error"]["code"] == "audio_error"
            # While it is gone: answered too (audio_error), the daemon keeps running.
            await rec.say(SAY, {"id": "gone", "text": "nobody hears this"})
            assert (await rec.wait_finished(["gone"], timeout_s=15))["gone"]["status"] == "error"
            assert proc.proc is not None and proc.proc.poll() is None
            own.pactl("load-module", "module-null-sink", f"sink_name={SPEAKER_SINK}", f"rate={SPEAKER_RATE_HZ}")
            own.pactl("set-default-sink", SPEAKER_SINK)
            if keeper is not None:
                keeper.terminate()
                keeper.wait(5)
            keeper = clock_keeper(own)
            # Time is the behaviour here: the sink reopens no sooner than its backoff allows (at
            # most 2 x BACKOFF_FIRST_S after "gone" found it gone), and nothing says when that is.
            await asyncio.sleep(2.5)
            await rec.say(SAY, {"id": "back", "text": "heard again"})
            fin = await rec.wait_finished(["back"], timeout_s=15)
            assert fin["back"]["status"] == "completed", (fin["back"], proc.log()[-3000:])
            assert fin["back"]["audioMs"] > 0
            await rec.barrier(SAY)
            for rid in ("cut", "gone", "back"):
                assert len(answers(rec, rid)) == 1, (rid, rec.payloads("/tts/finished"))
            assert "speaker_lost" in proc.log() or "speaker_reopen_failed" in proc.log()
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0
    finally:
        proc.cleanup()
        if keeper is not None:
            keeper.terminate()
            keeper.wait(5)
        own.stop()
