"""The web page's live feed (``intake/http/live.py``): ``MqttEvents`` hands it each event's payload
as it publishes it (the object its MQTT message encodes, never decoded back), the feed keeps the
state, the latency and the memory events and hands them to the page's subscriptions; a slow page
loses its oldest events, never blocks the daemon; closing ends every subscription."""

from __future__ import annotations

import ast
import asyncio
import json
import time
from pathlib import Path

from s2s_daemon.events.publisher import MqttEvents
from s2s_daemon.intake.http import live
from s2s_daemon.intake.http.live import LATENCY_KEPT, MEMORY_KEPT_S, LiveEvent, LiveFeed, Subscription
from s2s_daemon.mqtt.packets import OutMessage
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.jobs import Job, Timeline
from s2s_daemon.pipeline.messages import SayRequest, Status
from s2s_daemon.pipeline.vocabulary import EngineInfo
from tests.support.wait import loop_turns

TOPICS = Topics("s2s", "kitchen")


async def test_the_feed_gets_what_mqtt_events_publish_without_decoding_it() -> None:
    feed = LiveFeed()
    sent: list[OutMessage] = []
    info = EngineInfo("tone", "m", "cpu", 24000, voices=("Ryan",))
    events = MqttEvents(sent.append, TOPICS, info, 1, False, lambda: None, live=feed.add)
    job = Job(SayRequest("a", "hi", "Ryan", "auto", "kitchen"), Timeline(received=time.monotonic()))
    job.timeline.first_sample_out = job.timeline.last_sample_played = time.monotonic()
    now_ms = time.time() * 1000.0
    with feed.subscribe() as subscription:
        events.started(job)
        job.status = Status.COMPLETED
        events.finished(job)
        events.memory({"ts": now_ms - (MEMORY_KEPT_S + 5) * 1000.0, "rssMiB": 1.0})  # too old to keep
        events.memory({"ts": now_ms, "rssMiB": 2.0})
        events.vad(True, 12.0)  # not the live view's
        got = [await subscription.get() for _ in range(5)]
    kinds = {"started": TOPICS.started, "finished": TOPICS.finished, "latency": TOPICS.latency}
    kinds["memory"] = TOPICS.memory
    assert [event.kind for event in got if event is not None] == ["started", "finished", "latency", "memory", "memory"]
    published = [(m.topic, json.loads(m.payload)) for m in sent]
    for event in got:  # the page sees the payloads an MQTT subscriber sees
        assert event is not None and (kinds[event.kind], event.payload) in published, event
    history = feed.history()
    assert [p["id"] for p in history["latency"]] == ["a"]
    assert [m["rssMiB"] for m in history["memory"]] == [2.0]
    assert feed.subscribers == 0
    source = Path(live.__file__).read_text(encoding="utf-8")  # noqa: ASYNC240  (a small file, read once)
    imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import)]
    assert "json" not in {alias.name for node in imports for alias in node.names}  # nothing to decode


def test_latency_history_is_bounded() -> None:
    feed = LiveFeed()
    for i in range(LATENCY_KEPT + 10):
        feed.add("latency", {"id": str(i)})
    kept = feed.history()["latency"]
    assert len(kept) == LATENCY_KEPT and kept[0]["id"] == "10"


async def test_a_slow_subscription_drops_its_oldest_events() -> None:
    subscription = Subscription(maxsize=3)
    for queue in range(5):
        subscription.put(LiveEvent("state", {"state": "idle", "queue": queue, "currentId": None}))
    assert subscription.dropped == 2
    got = [await subscription.get() for _ in range(3)]
    assert [event.payload["queue"] for event in got if event is not None] == [2, 3, 4]


async def test_close_ends_a_waiting_subscription() -> None:
    feed = LiveFeed()
    with feed.subscribe() as subscription:
        waiting = asyncio.create_task(subscription.get())
        await loop_turns()  # it waits in get()
        feed.close()
        assert await asyncio.wait_for(waiting, 1) is None
