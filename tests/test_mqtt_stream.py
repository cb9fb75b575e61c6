# ruff: noqa: RUF001 -- full-width CJK marks are the point
"""Streamed says (``<p>/<site>/tts/stream``) through a real mosquitto: one request id, one
``tts/started`` and one ``tts/finished`` for the whole stream, whatever the order of its pieces."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest

from s2s_daemon.intake.streams import MAX_EARLY_STREAMS
from tests.support.broker import Mosquitto
from tests.support.daemon import DaemonProcess, daemon_in_process, write_config
from tests.support.mqtt import Recorder, recorder

pytestmark = pytest.mark.integration

SAY = "s2s/kitchen/tts/say"
STREAM = "s2s/kitchen/tts/stream"
STOP = "s2s/kitchen/tts/stop"
MS_PER_CHAR = 80
"""The tone engine makes one 80 ms frame per character: audioMs tells how many were spoken."""
PAUSE_MS = 150


async def online(rec: Recorder) -> None:
    await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")))


def cfg(tmp_path: Path, broker: Mosquitto, speed: str = "0", **sections: Any) -> Path:
    tts = {"options": {"speed": speed, "ms_per_char": str(MS_PER_CHAR)}, **sections.pop("tts", {})}
    return write_config(tmp_path / "daemon.yaml", broker.port, tts=tts, **sections)


async def piece(rec: Recorder, rid: str, seq: int, text: str = "", **fields: Any) -> None:
    await rec.say(STREAM, {"id": rid, "seq": seq, "text": text, **fields})


def spoken_ms(sentences: list[str]) -> float:
    return MS_PER_CHAR * sum(len(s) for s in sentences) + PAUSE_MS * (len(sentences) - 1)


async def test_pieces_repeated_and_out_of_order_make_one_request(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = ["今天天气", "很好。我们", "去公园吧！", "你觉得", "呢？"]
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        for seq in (1, 0, 2, 1, 3, 0):  # piece 1 overtakes piece 0; QoS 1 redeliveries of 1 and 0
            await piece(rec, "st", seq, text[seq], **({"voice": "vivian", "sessionId": "chat-7"} if seq == 0 else {}))
        await piece(rec, "st", 4, text[4], end=True)
        fin = await rec.wait_finished(["st"])
        await piece(rec, "st", 2, text[2])  # a redelivery after the end: no second answer
        await rec.say(SAY, {"id": "after", "text": "好。"})
        await rec.wait_finished(["after"])
        assert fin["st"]["status"] == "completed", fin
        assert fin["st"]["sessionId"] == "chat-7"
        sentences = ["今天天气很好。", "我们去公园吧！", "你觉得呢？"]
        assert fin["st"]["audioMs"] == pytest.approx(spoken_ms(sentences), abs=1)
        assert [p["id"] for p in rec.payloads("/tts/started")].count("st") == 1
        assert [p["id"] for p in rec.payloads("/tts/finished")].count("st") == 1
        lat = next(p for p in rec.payloads("/metrics/latency") if p["id"] == "st")
        assert lat["streamed"] is True
        assert 0 <= lat["firstTextMs"] <= lat["firstAudioOutMs"]
        assert lat["firstChunkAfterTextMs"] >= 0


async def test_the_first_sentence_plays_while_the_rest_is_written(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, speed="1")):
        await online(rec)
        await piece(rec, "live", 0, "你好。今天")
        await rec.wait_for(lambda: rec.payloads("/tts/started"), timeout_s=5)  # before the rest exists
        assert rec.finished() == {}
        await piece(rec, "live", 1, "很好。", end=True)
        fin = await rec.wait_finished(["live"])
        assert fin["live"]["status"] == "completed"
        assert fin["live"]["audioMs"] == pytest.approx(spoken_ms(["你好。", "今天很好。"]), abs=1)


async def test_a_stream_never_closed_ends_after_the_idle_time(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = cfg(tmp_path, mosquitto, tts={"stream_idle_s": 0.6})
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await online(rec)
        start = time.monotonic()
        await piece(rec, "quiet", 0, "我们走吧。然后")
        fin = await rec.wait_finished(["quiet"], timeout_s=10)
        assert time.monotonic() - start >= 0.6
        assert fin["quiet"]["status"] == "error"
        assert fin["quiet"]["error"]["code"] == "stream_idle"
        assert "0.6 s" in fin["quiet"]["error"]["message"]
        assert fin["quiet"]["audioMs"] == pytest.approx(
            spoken_ms(["我们走吧。", "然后。"]), abs=1
        )  # the text stage ends what came
        # pieces that come before a piece 0 that never comes: answered once, after the idle time
        await piece(rec, "headless", 3, "lost")
        await piece(rec, "headless", 5, "orphan")
        fin = await rec.wait_finished(["headless"], timeout_s=10)
        assert fin["headless"]["status"] == "rejected" and fin["headless"]["error"]["code"] == "bad_payload"
        assert "piece 0" in fin["headless"]["error"]["message"]
        assert "2 later pieces (10 characters)" in fin["headless"]["error"]["message"]


async def test_stop_and_interrupt_mid_stream(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, speed="1")):
        await online(rec)
        await piece(rec, "a", 0, "这是第一句话。这")
        await rec.wait_for(lambda: rec.payloads("/tts/started"))
        await rec.say(STOP, {"id": "a"})
        fin = await rec.wait_finished(["a"])
        assert fin["a"]["status"] == "interrupted"
        await piece(rec, "a", 1, "是第二句。", end=True)  # its writer did not know: no second answer
        await piece(rec, "b", 0, "这是第一句话。这")
        await rec.wait_for(lambda: len(rec.payloads("/tts/started")) == 2)
        await rec.say(SAY, {"id": "urgent", "text": "注意！", "interrupt": True})
        fin = await rec.wait_finished(["b", "urgent"])
        assert fin["b"]["status"] == "interrupted"
        assert fin["urgent"]["status"] == "completed"
        await piece(rec, "b", 1, "是。", end=True)
        await rec.barrier(SAY)
        assert set(rec.finished()) == {"a", "b", "urgent"}  # one answer each (finished() checks)


async def test_a_stream_beside_ordinary_says_keeps_its_place(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        await rec.say(SAY, {"id": "before", "text": "先说。"})
        await piece(rec, "mid", 0, "慢慢")
        await rec.say(SAY, {"id": "after", "text": "后说。"})
        for seq, text in enumerate(["地", "写。"], start=1):
            await asyncio.sleep(0.2)  # an LLM's pace: the scenario
            await piece(rec, "mid", seq, text, end=seq == 2)
        fin = await rec.wait_finished(["before", "mid", "after"])
        assert {fin[i]["status"] for i in fin} == {"completed"}
        order = [p["id"] for p in rec.payloads("/tts/finished")]
        assert order == ["before", "mid", "after"]
        assert fin["mid"]["audioMs"] == pytest.approx(spoken_ms(["慢慢地写。"]), abs=1)


async def test_bad_pieces_are_answered_with_a_code(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        await rec.say(STREAM, {"id": "noseq", "text": "hello"})
        await piece(rec, "voice", 0, "hello", voice="nobody")
        await piece(rec, "open", 0, "你好。我")
        await rec.say(STREAM, {"id": "open", "seq": "one", "text": "x"})
        await rec.say(STREAM, b"\xff not json")
        fin = await rec.wait_for(lambda: len(rec.finished()) == 4 and rec.finished(), timeout_s=10)
        assert fin["noseq"]["status"] == "rejected" and fin["noseq"]["error"]["code"] == "bad_payload"
        assert "seq" in fin["noseq"]["error"]["message"]
        assert fin["voice"]["status"] == "rejected" and fin["voice"]["error"]["code"] == "unknown_voice"
        assert fin["open"]["status"] == "error" and fin["open"]["error"]["code"] == "bad_payload"
        assert fin["open"]["audioMs"] == pytest.approx(
            spoken_ms(["你好。", "我。"]), abs=1
        )  # the text stage ends what came
        assert sum(1 for p in fin.values() if p["error"]["code"] == "bad_payload") == 3


async def test_pieces_before_piece_0_count_against_the_limit_and_few_streams_wait(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Pieces that wait for piece 0 were held uncounted, for any number of ids: now they count
    against ``tts.max_text_chars`` as they come (the stream is rejected at once past it), and at
    most ``MAX_EARLY_STREAMS`` ids wait; the daemon serves on."""
    config = cfg(tmp_path, mosquitto, tts={"max_text_chars": 100, "stream_idle_s": 30})
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await online(rec)
        for seq in range(1, 4):
            await piece(rec, "big", seq, "Ab. " * 10)  # 120 characters wait after the third
        await piece(rec, "big", 0, "Hello.")  # answered already: changes nothing
        fin = await rec.wait_finished(["big"], timeout_s=5)
        assert fin["big"]["status"] == "rejected" and fin["big"]["error"]["code"] == "text_too_long"
        assert "grew past 100 characters at piece 3" in fin["big"]["error"]["message"]
        waiting = [f"w{i}" for i in range(MAX_EARLY_STREAMS)]
        for rid in waiting:
            await piece(rec, rid, 1, "x")
        await piece(rec, "one-too-many", 1, "x")
        fin = await rec.wait_finished(["one-too-many"], timeout_s=10)
        assert fin["one-too-many"]["status"] == "rejected" and fin["one-too-many"]["error"]["code"] == "bad_payload"
        assert f"at most {MAX_EARLY_STREAMS}" in fin["one-too-many"]["error"]["message"]
        assert set(rec.finished()) == {"big", "one-too-many"}  # those waiting still wait
        await piece(rec, "w0", 0, "Hi there.", end=False)
        await piece(rec, "w0", 2, "", end=True)
        await rec.say(SAY, {"id": "after", "text": "Still here."})
        fin = await rec.wait_finished(["w0", "after"], timeout_s=10)
        assert fin["w0"]["status"] == "completed" and fin["after"]["status"] == "completed"


async def test_a_stream_open_at_shutdown_speaks_what_came(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec:
        async with daemon_in_process(cfg(tmp_path, mosquitto, speed="1")) as daemon:
            await online(rec)
            await piece(rec, "open", 0, "第一句。第二")
            await rec.wait_for(lambda: rec.payloads("/tts/started"))
            daemon.request_stop()
            fin = await rec.wait_finished(["open"], timeout_s=10)
        assert fin["open"]["status"] == "error" and fin["open"]["error"]["code"] == "shutting_down"
        assert fin["open"]["audioMs"] == pytest.approx(
            spoken_ms(["第一句。", "第二。"]), abs=1
        )  # the text stage ends what came


@pytest.mark.timeout(60)
async def test_a_stream_cut_by_a_crash_is_answered_once_after_the_restart(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """The daemon as a subprocess, SIGKILLed mid-stream; the writer (paho) goes on."""
    config = cfg(tmp_path, mosquitto, speed="1")
    proc = DaemonProcess(config)
    writer = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    writer.connect("127.0.0.1", mosquitto.port)
    writer.loop_start()

    def send(seq: int, text: str, end: bool = False) -> None:
        payload = json.dumps({"id": "cut", "seq": seq, "text": text, "end": end})
        writer.publish(STREAM, payload, qos=1).wait_for_publish(5)

    try:
        async with recorder(mosquitto.port) as rec:
            proc.start()
            await online(rec)
            send(0, "第一句话。第二")
            await rec.wait_for(lambda: rec.payloads("/tts/started"), timeout_s=10)
            proc.signal(signal.SIGKILL)
            await proc.wait(10)
            send(1, "句话。")
            proc.start()
            fin = await rec.wait_finished(["cut"], timeout_s=30)
            assert fin["cut"]["status"] == "cancelled" and fin["cut"]["error"]["code"] == "restarted"
            send(2, "第三句。", end=True)
            await rec.say(SAY, {"id": "next", "text": "好。"})
            fin = await rec.wait_finished(["cut", "next"], timeout_s=15)
            assert fin["next"]["status"] == "completed"
            await rec.barrier(SAY)
            assert set(rec.finished()) == {"cut", "next"}  # one answer each
        proc.signal(signal.SIGTERM)
        assert await proc.wait(15) == 0
    finally:
        writer.loop_stop()
        writer.disconnect()
        proc.cleanup()
