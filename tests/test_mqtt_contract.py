"""The MQTT contract against a real mosquitto, with the daemon running in this process."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.support.broker import Mosquitto
from tests.support.daemon import daemon_in_process, write_config
from tests.support.mqtt import Recorder, recorder
from tests.support.wait import until

SAY = "s2s/kitchen/tts/say"
STOP = "s2s/kitchen/tts/stop"


async def online(rec: Recorder) -> None:
    await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")))


def cfg(tmp_path: Path, broker: Mosquitto, **sections: Any) -> Path:
    return write_config(tmp_path / "daemon.yaml", broker.port, **sections)


@pytest.mark.integration
async def test_say_started_finished_latency_memory(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        await rec.say(SAY, {"id": "r1", "text": "Hello kitchen", "sessionId": "s-1", "voice": "vivian"})
        await rec.say(SAY, "plain text is a say request too")
        done = await rec.wait_for(lambda: len(rec.finished()) == 2 and rec.on("/metrics/memory"))
        assert done
        fin = rec.finished()
        assert fin["r1"]["status"] == "completed"
        assert fin["r1"]["sessionId"] == "s-1"
        assert fin["r1"]["siteId"] == "kitchen"
        assert fin["r1"]["audioMs"] > 0
        plain = next(p for i, p in fin.items() if i != "r1")
        assert plain["status"] == "completed" and len(plain["id"]) == 32
        started = rec.payloads("/tts/started")
        assert started[0]["id"] == "r1"
        assert started[0]["sessionId"] == "s-1" and started[0]["queuedMs"] >= 0
        # started comes before finished for the same id
        order = [
            (m.topic.rsplit("/", 1)[1], m.json()["id"])
            for m in rec.messages
            if m.topic.endswith(("started", "finished"))
        ]
        assert order.index(("started", "r1")) < order.index(("finished", "r1"))
        lat = next(p for p in rec.payloads("/metrics/latency") if p["id"] == "r1")
        assert lat["engine"] == "tone" and lat["chunks"] >= 1
        assert 0 <= lat["ttfaMs"] <= lat["firstAudioOutMs"] <= lat["e2eMs"]
        assert lat["audioMs"] == pytest.approx(fin["r1"]["audioMs"], rel=0.01)
        mem = rec.payloads("/metrics/memory")[0]
        assert mem["rssMiB"] > 10 and mem["peakRssMiB"] >= mem["rssMiB"] and mem["deviceKind"] == "none"


@pytest.mark.integration
async def test_retained_status_info_state(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with daemon_in_process(cfg(tmp_path, mosquitto)):
        async with recorder(mosquitto.port) as warm:
            await online(warm)
        async with recorder(mosquitto.port) as rec:  # joins later: sees retained messages
            await rec.wait_for(lambda: rec.on("/status") and rec.on("/info") and rec.on("/state"))
            assert all(m.retain for m in rec.on("/status") + rec.on("/info") + rec.on("/state"))
            info = rec.payloads("/info")[0]
            assert info["engine"] == "tone" and info["voices"] == ["Ryan", "Vivian"] and info["sampleRate"] == 24000
            assert info["siteId"] == "kitchen" and info["version"]
            assert rec.payloads("/state")[-1]["state"] == "idle"
    async with recorder(mosquitto.port) as after:
        await after.wait_for(lambda: after.on("/status"))
        assert after.on("/status")[-1].payload == b"offline"


@pytest.mark.integration
async def test_stop_current_one_and_all(tmp_path: Path, mosquitto: Mosquitto) -> None:
    slow = {"tts": {"options": {"speed": "1", "ms_per_char": "100"}}}
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, **slow)):
        await online(rec)
        long_text = "a long sentence that takes a few seconds to speak at real time"
        for i in range(5):
            await rec.say(SAY, {"id": f"q{i}", "text": long_text})
        await rec.wait_for(lambda: any(p["id"] == "q0" for p in rec.payloads("/tts/started")))
        await rec.client.publish(STOP, b"{}", qos=1)  # stop the current utterance
        await rec.wait_finished(["q0"])
        await rec.client.publish(STOP, b'{"id": "q3"}', qos=1)  # cancel a queued one
        await rec.wait_finished(["q3"])
        await rec.wait_for(lambda: any(p["id"] == "q1" for p in rec.payloads("/tts/started")))
        await rec.client.publish(STOP, b'{"all": true}', qos=1)
        fin = await rec.wait_finished(["q0", "q1", "q2", "q3", "q4"])
        assert fin["q0"]["status"] == "interrupted"
        assert fin["q3"]["status"] == "cancelled"
        assert fin["q1"]["status"] == "interrupted"
        assert fin["q2"]["status"] in {"cancelled", "interrupted"}  # may be synthesizing ahead
        assert fin["q4"]["status"] == "cancelled"
        assert fin["q0"]["audioMs"] < 5000
        # the daemon is still serving
        await rec.say(SAY, {"id": "after", "text": "ok"})
        assert (await rec.wait_finished(["after"]))["after"]["status"] == "completed"


@pytest.mark.integration
async def test_stop_before_the_first_sample_is_cancelled_not_interrupted(tmp_path: Path, mosquitto: Mosquitto) -> None:
    # real time in chunks of 2 s: the first chunk takes 1.7-2 s to synthesize
    slow = {"tts": {"chunk_frames": 25, "options": {"speed": "1", "ms_per_char": "40"}}}
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, **slow)):
        await online(rec)
        await rec.say(SAY, {"id": "silent", "text": "stopped while it is still being synthesized"})
        await rec.wait_for(lambda: any(p["currentId"] == "silent" for p in rec.payloads("/state")))
        await rec.client.publish(STOP, b"{}", qos=1)
        fin = (await rec.wait_finished(["silent"]))["silent"]
        assert fin["status"] == "cancelled" and fin["audioMs"] == 0 and "error" not in fin
        assert not any(p["id"] == "silent" for p in rec.payloads("/tts/started"))
        # and once some of it was heard, a stop is an interruption with the audio heard so far
        long_text = "a sentence long enough to be cut short while it plays; " * 4  # 9 s, made at real time
        await rec.say(SAY, {"id": "heard", "text": long_text})
        await rec.wait_for(lambda: any(p["id"] == "heard" for p in rec.payloads("/tts/started")), 15)
        await rec.client.publish(STOP, b"{}", qos=1)
        fin = (await rec.wait_finished(["heard"]))["heard"]
        assert fin["status"] == "interrupted" and 0 < fin["audioMs"] < 4000
        lat = await rec.wait_for(
            lambda: next((p for p in rec.payloads("/metrics/latency") if p["id"] == "heard"), None)
        )
        assert lat["firstAudioOutMs"] is not None and lat["e2eMs"] is not None
        # a request that ended before anything was heard has no latency event
        assert not any(p["id"] == "silent" for p in rec.payloads("/metrics/latency"))


@pytest.mark.integration
async def test_dedup_expiry_priority_interrupt(tmp_path: Path, mosquitto: Mosquitto) -> None:
    slow = {"tts": {"options": {"speed": "1", "ms_per_char": "40"}}}
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, **slow)):
        await online(rec)
        await rec.say(SAY, {"id": "busy", "text": "keeps the speaker busy for about two seconds...."})
        await rec.wait_for(lambda: rec.payloads("/tts/started"))
        await rec.say(SAY, {"id": "busy", "text": "same id again"})
        await rec.say(SAY, {"id": "stale", "text": "too late", "ttlMs": 50})
        await rec.say(SAY, {"id": "low", "text": "low", "priority": 0})
        await rec.say(SAY, {"id": "high", "text": "high", "priority": 5})
        fin = await rec.wait_finished(["busy", "stale", "low", "high"], timeout_s=20)
        assert fin["busy"]["status"] == "completed"
        assert fin["stale"]["status"] == "expired"
        started = [p["id"] for p in rec.payloads("/tts/started")]
        assert started.index("high") < started.index("low")
        dups = [p for p in rec.payloads("/tts/finished") if p.get("error", {}).get("code") == "duplicate"]
        assert [(d["id"], d["status"]) for d in dups] == [("busy", "rejected")]

    # interrupt: a new request stops the current one and is served next
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto, **slow)):
        await online(rec)
        await rec.say(SAY, {"id": "first", "text": "a long first sentence that will be cut short"})
        await rec.say(SAY, {"id": "queued", "text": "waits its turn"})
        await rec.wait_for(lambda: rec.payloads("/tts/started"))
        await rec.say(SAY, {"id": "urgent", "text": "urgent", "interrupt": True, "priority": -5})
        fin = await rec.wait_finished(["first", "queued", "urgent"], timeout_s=20)
        assert fin["first"]["status"] == "interrupted"
        started = [p["id"] for p in rec.payloads("/tts/started")]
        assert started.index("urgent") < started.index("queued")


@pytest.mark.integration
async def test_response_topic_and_correlation(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with (
        recorder(mosquitto.port, subscribe=("s2s/#", "client/replies/#")) as rec,
        daemon_in_process(cfg(tmp_path, mosquitto)),
    ):
        await online(rec)
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = "client/replies/42"
        props.CorrelationData = b"\x00corr-7"
        await rec.say(SAY, {"id": "rr", "text": "reply to me"}, properties=props)
        await rec.wait_for(lambda: rec.on("client/replies/42"))
        reply = rec.on("client/replies/42")[0]
        assert reply.json()["id"] == "rr" and reply.json()["status"] == "completed"
        assert reply.properties.CorrelationData == b"\x00corr-7"


@pytest.mark.integration
async def test_hermes_round_trip(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = cfg(tmp_path, mosquitto, mqtt={"hermes": True})
    async with recorder(mosquitto.port, subscribe=("s2s/#", "hermes/#")) as rec, daemon_in_process(config):
        await online(rec)
        await rec.say("hermes/tts/say", {"text": "for another site", "id": "h0", "siteId": "garage"})
        await rec.say(
            "hermes/tts/say", {"text": "hello hermes", "lang": "en", "id": "h1", "siteId": "kitchen", "sessionId": "hs"}
        )
        await rec.say("hermes/tts/say", {"text": "", "id": "h2", "siteId": "kitchen", "sessionId": "hs"})
        await rec.wait_for(lambda: len(rec.payloads("hermes/tts/sayFinished")) >= 2)
        done = {p["id"]: p for p in rec.payloads("hermes/tts/sayFinished")}
        assert done["h1"] == {"id": "h1", "siteId": "kitchen", "sessionId": "hs"}
        assert "h2" in done and "h0" not in done
        err = rec.payloads("hermes/error/tts")
        assert len(err) == 1 and err[0]["siteId"] == "kitchen" and err[0]["sessionId"] == "hs"
        assert rec.finished()["h1"]["status"] == "completed"


BAD_INPUTS: list[tuple[str, bytes, str]] = [
    ("malformed_json", b'{"text": "unterminated', "bad_payload"),
    ("json_array", b'{"text": ["a"]}', "bad_payload"),
    ("wrong_type_priority", b'{"text": "hi", "priority": "high"}', "bad_payload"),
    ("wrong_type_volume", b'{"text": "hi", "volume": 7}', "bad_payload"),
    ("empty_text", b'{"text": ""}', "empty_text"),
    ("whitespace_text", b'{"text": "  \\n\\t "}', "empty_text"),
    ("empty_payload", b"", "empty_text"),
    ("too_long", ('{"text": "' + "x" * 2001 + '"}').encode(), "text_too_long"),
    ("invalid_utf8", b"\xff\xfe\xfa hello", "bad_payload"),
    ("binary_garbage", bytes(range(256)) * 4, "bad_payload"),
    ("one_megabyte", b"a" * (1024 * 1024), "text_too_long"),
    ("unknown_voice", b'{"text": "hi", "voice": "Nobody"}', "unknown_voice"),
    ("unsupported_language", b'{"text": "hi", "language": "klingon"}', "unsupported_language"),
]


@pytest.mark.integration
@pytest.mark.parametrize(("name", "payload", "code"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
async def test_bad_input_is_rejected_then_next_is_served(
    tmp_path: Path, mosquitto: Mosquitto, name: str, payload: bytes, code: str
) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        await rec.client.publish(SAY, payload, qos=1)
        await rec.say(SAY, {"id": "good", "text": "the next good request"})
        await rec.wait_for(lambda: len(rec.finished()) == 2)
        fin = rec.finished()
        assert fin.pop("good")["status"] == "completed"
        (bad,) = fin.values()
        assert bad["status"] == "rejected", name
        assert bad["error"]["code"] == code, bad
        assert bad["error"]["message"]


@pytest.mark.integration
async def test_bad_input_keeps_its_id(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        await rec.say(SAY, {"id": 17, "text": 5, "sessionId": "s"})
        fin = await rec.wait_finished(["17"])
        assert fin["17"]["error"]["code"] == "bad_payload" and fin["17"]["sessionId"] == "s"


@pytest.mark.parametrize(
    ("rid", "message"), [("", "id: must not be empty"), ("x" * 201, "id: must have at most 200 characters")]
)
@pytest.mark.integration
async def test_a_bad_id_is_said_in_words(tmp_path: Path, mosquitto: Mosquitto, rid: str, message: str) -> None:
    """Before: "id: Value should have at least 1 item after validation, not 0" (issue 41, item 12)."""
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        await rec.client.publish(SAY, json.dumps({"id": rid, "text": "hi"}).encode(), qos=1)
        await rec.wait_for(lambda: len(rec.finished()) == 1)
        (bad,) = rec.finished().values()
    assert bad["status"] == "rejected" and bad["error"] == {"code": "bad_payload", "message": message}


@pytest.mark.integration
async def test_queue_full(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = cfg(tmp_path, mosquitto, queue={"max_pending": 2}, tts={"options": {"speed": "1"}})
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await online(rec)
        ids = [f"f{i}" for i in range(8)]
        for i in ids:
            await rec.say(SAY, {"id": i, "text": "a sentence of some length"})
        fin = await rec.wait_finished(ids, timeout_s=30)
        codes = [fin[i].get("error", {}).get("code") for i in ids]
        assert codes.count("queue_full") >= 3
        assert [fin[i]["status"] for i in ids].count("completed") >= 3
        await rec.say(SAY, {"id": "later", "text": "served after the burst"})
        assert (await rec.wait_finished(["later"]))["later"]["status"] == "completed"


@pytest.mark.integration
async def test_an_interrupt_rejected_queue_full_interrupts_nothing(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Issue 41 item 3, as the issue tried it: ``queue.max_pending: 1``, a0 speaking, a1 queued."""
    config = cfg(tmp_path, mosquitto, queue={"max_pending": 1}, tts={"options": {"speed": "1"}})
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await online(rec)
        await rec.say(SAY, {"id": "a0", "text": "A long sentence that is still speaking."})  # 1.6 s
        await rec.wait_for(lambda: [p for p in rec.payloads("/tts/started") if p["id"] == "a0"])
        await rec.say(SAY, {"id": "a1", "text": "Queued."})
        await rec.say(SAY, {"id": "i-full", "text": "Interrupt when full.", "interrupt": True})
        fin = await rec.wait_finished(["i-full", "a0", "a1"], timeout_s=20)
        assert fin["i-full"]["status"] == "rejected"
        assert fin["i-full"]["error"] == {"code": "queue_full", "message": "1 request is already waiting"}
        assert fin["a0"]["status"] == "completed" and fin["a1"]["status"] == "completed", fin


@pytest.mark.integration
async def test_the_state_topic_shows_every_state_of_a_quick_request(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Issue 41 item 8: every request shows ``synthesizing`` then ``speaking``, however quick (an
    engine at full speed: each state lasts less than the publishing interval), and no state twice."""
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        ids = ["q0", "q1", "q2"]
        for rid in ids:
            await rec.say(SAY, {"id": rid, "text": "A quick sentence."})
            await rec.wait_finished([rid])
        await rec.wait_for(lambda: rec.payloads("/state")[-1]["state"] == "idle")
        seen = [(p["state"], p["currentId"]) for p in rec.payloads("/state")]
        idle = ("idle", None)
        expected = [idle] + [s for rid in ids for s in (("synthesizing", rid), ("speaking", rid), idle)]
        assert seen == expected


@pytest.mark.integration
async def test_the_state_topic_has_no_idle_between_queued_requests(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Issue 41 item 8: a burst goes speaking b0, synthesizing b1, ...: no ``idle`` (with a queue)
    between two requests of it, and no message twice in a row (a change of the queue's length alone
    is a message of its own)."""
    config = cfg(tmp_path, mosquitto, tts={"options": {"speed": "1"}})
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await online(rec)
        ids = ["b0", "b1", "b2"]
        for rid in ids:  # b1 and b2 wait behind b0 (0.7 s each)
            await rec.say(SAY, {"id": rid, "text": "A short sentence."})
        await rec.wait_finished(ids)
        await rec.wait_for(lambda: rec.payloads("/state")[-1]["state"] == "idle")
        states = [(p["state"], p["currentId"], p["queue"]) for p in rec.payloads("/state")]
        assert all(a != b for a, b in itertools.pairwise(states)), states  # none repeated
        assert [s for s in states if s[0] == "idle" and s[2] > 0] == [], states
        assert [s for s in states if s[0] == "idle"] == [("idle", None, 0)] * 2, states  # before and after
        # Each request's states, in order (the queue's length may change within one).
        seen = [(state, current) for state, current, _ in states]
        changes = [b for a, b in zip([None, *seen], seen, strict=False) if a != b]
        assert changes == [("idle", None)] + [(s, rid) for rid in ids for s in ("synthesizing", "speaking")] + [
            ("idle", None)
        ], states


@pytest.mark.integration
async def test_engine_error_is_reported_and_daemon_continues(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with recorder(mosquitto.port) as rec, daemon_in_process(cfg(tmp_path, mosquitto)):
        await online(rec)
        await rec.say(SAY, {"id": "boom", "text": "please #fail now"})
        await rec.say(SAY, {"id": "fine", "text": "and then this"})
        fin = await rec.wait_finished(["boom", "fine"])
        assert fin["boom"]["status"] == "error" and fin["boom"]["error"]["code"] == "engine_error"
        assert fin["fine"]["status"] == "completed"


@pytest.mark.integration
async def test_shared_subscription_pool(tmp_path: Path, mosquitto: Mosquitto) -> None:
    a = write_config(tmp_path / "a.yaml", mosquitto.port, site_id="a", mqtt={"shared_group": "speakers"})
    b = write_config(tmp_path / "b.yaml", mosquitto.port, site_id="b", mqtt={"shared_group": "speakers"})
    async with recorder(mosquitto.port) as rec, daemon_in_process(a), daemon_in_process(b):
        await rec.wait_for(lambda: len([m for m in rec.on("/status") if m.payload == b"online"]) == 2)
        ids = [f"p{i}" for i in range(20)]
        for i in ids:
            await rec.say("s2s/pool/tts/say", {"id": i, "text": "pooled"})
        await rec.wait_for(lambda: all(i in {p["id"] for p in rec.payloads("/tts/finished")} for i in ids), 20)
        per_site: dict[str, list[str]] = {"a": [], "b": []}
        for m in rec.on("/tts/finished"):
            per_site[m.topic.split("/")[1]].append(m.json()["id"])
        assert sorted(per_site["a"] + per_site["b"]) == sorted(ids)  # each exactly once
        assert per_site["a"] and per_site["b"]  # both daemons took work


# amqtt leaves client transports to the garbage collector after shutdown.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_embedded_broker_speaks_311(tmp_path: Path) -> None:
    from tests.support.broker import free_port

    port = free_port()
    config = write_config(tmp_path / "e.yaml", port, mqtt={"broker": "embedded"})
    async with daemon_in_process(config):

        async def listening() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            await writer.wait_closed()
            return True

        await until(listening, 10, "the embedded broker listening")
        async with recorder(port, v5=False) as rec:
            await rec.wait_for(lambda: rec.on("/status"))
            await rec.say(SAY, {"id": "e1", "text": "embedded"})
            assert (await rec.wait_finished(["e1"]))["e1"]["status"] == "completed"
    gc.collect()
