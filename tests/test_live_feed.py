"""The web page's live feed (``events/live.py``): what MqttEvents publishes passes through to the
link unchanged and is kept and handed to the page's subscriptions; a slow page loses its oldest
events, never blocks the daemon; closing ends every subscription."""

from __future__ import annotations

import asyncio
import json
import time

from s2s_daemon.intake.http.live import LATENCY_KEPT, MEMORY_KEPT_S, LiveEvent, LiveFeed, Subscription
from s2s_daemon.mqtt.packets import OutMessage
from s2s_daemon.mqtt.topics import Topics
from tests.support.wait import loop_turns

TOPICS = Topics("s2s", "kitchen")


def _message(topic: str, payload: dict[str, object]) -> OutMessage:
    return OutMessage(topic, json.dumps(payload).encode(), 1)


async def test_tap_passes_every_message_on_and_keeps_state_latency_and_memory() -> None:
    feed = LiveFeed(TOPICS)
    sent: list[OutMessage] = []
    publish = feed.tap(sent.append)
    now_ms = time.time() * 1000.0
    messages = [
        _message(TOPICS.state, {"state": "speaking", "queue": 2, "currentId": "a"}),
        _message(TOPICS.latency, {"id": "a", "ttfaMs": 12.5, "rtf": 0.4}),
        _message(TOPICS.memory, {"ts": now_ms - (MEMORY_KEPT_S + 5) * 1000.0, "rssMiB": 1.0}),  # too old
        _message(TOPICS.memory, {"ts": now_ms, "rssMiB": 2.0}),
        _message("hermes/tts/sayFinished", {"id": "a"}),  # not the live view's
        OutMessage(TOPICS.status, b"online", 1, True),  # not JSON: passed on, not kept
    ]
    with feed.subscribe() as subscription:
        for message in messages:
            publish(message)
        got = [await subscription.get() for _ in range(4)]
    kinds = [event.kind for event in got if event is not None]
    assert sent == messages
    assert kinds == ["state", "latency", "memory", "memory"]
    assert feed.state == {"state": "speaking", "queue": 2, "currentId": "a"}
    history = feed.history()
    assert history["latency"] == [{"id": "a", "ttfaMs": 12.5, "rtf": 0.4}]
    assert [m["rssMiB"] for m in history["memory"]] == [2.0]
    assert feed.subscribers == 0


def test_latency_history_is_bounded() -> None:
    feed = LiveFeed(TOPICS)
    for i in range(LATENCY_KEPT + 10):
        feed.observe(_message(TOPICS.latency, {"id": str(i)}))
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
    feed = LiveFeed(TOPICS)
    with feed.subscribe() as subscription:
        waiting = asyncio.create_task(subscription.get())
        await loop_turns()  # it waits in get()
        feed.close()
        assert await asyncio.wait_for(waiting, 1) is None
