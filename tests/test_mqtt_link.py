"""MqttLink's outbox against a real mosquitto: order, acknowledgement, survival of a restart.

The link hands packets to the paho client that aiomqtt wraps and tracks PUBACKs itself
(``_AckTracker``), without a task per message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import aiomqtt
import pytest

from s2s_daemon.config import MqttConfig
from s2s_daemon.intake.mqtt import PUBLISH_WINDOW, InMessage, MqttLink, OutMessage, _AckTracker
from s2s_daemon.intake.topics import Topics
from tests.support.broker import Mosquitto
from tests.support.mqtt import recorder

pytestmark = pytest.mark.timeout(60)

TOPIC = "s2s/kitchen/tts/finished"


async def poll(condition: Callable[[], bool], timeout_s: float) -> None:
    """The link has no event for these conditions; check every millisecond."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


def make_link(
    port: int, client_id: str = "s2s-link-test", on_message: Callable[[InMessage], None] = lambda message: None
) -> MqttLink:
    config = MqttConfig(broker="external", host="127.0.0.1", port=port)
    link = MqttLink(
        config,
        Topics("s2s", "kitchen"),
        client_id,
        on_message=on_message,
        on_connect=list,
        protocol=aiomqtt.ProtocolVersion.V5,
    )
    link.prepare()
    return link


async def test_the_installed_aiomqtt_has_what_the_link_needs() -> None:
    """If this fails, aiomqtt changed the internals the link publishes through: update
    ``_AckTracker`` (or pin aiomqtt)."""
    client = aiomqtt.Client("127.0.0.1", 1)
    assert isinstance(_AckTracker.attach(client), _AckTracker)


async def test_outbox_is_delivered_in_order_and_acknowledged(mosquitto: Mosquitto) -> None:
    n = 5 * PUBLISH_WINDOW
    async with recorder(mosquitto.port, subscribe=(TOPIC,)) as rec:
        link = make_link(mosquitto.port)
        runner = asyncio.create_task(link.run())
        for i in range(n):
            link.publish(OutMessage(TOPIC, str(i).encode(), qos=1))
        await rec.wait_for(lambda: len(rec.on(TOPIC)) >= n, 20)
        await link.close([OutMessage(TOPIC, b"last", qos=1)])
        await runner
        await rec.wait_for(lambda: rec.on(TOPIC)[-1].payload == b"last", 5)
    payloads = [m.payload for m in rec.on(TOPIC)]
    assert payloads == [str(i).encode() for i in range(n)] + [b"last"]
    assert len(link.outbox) == 0


async def test_unacknowledged_publishes_survive_a_broker_restart(tmp_path: Path) -> None:
    """Whatever the broker had not acknowledged goes back to the outbox and is sent again
    after the reconnect: every message arrives at least once, none is lost.

    The subscriber is a persistent session that is offline while the link publishes (an
    online subscriber's client acknowledges what it has not handed to the test yet, which
    would look like a loss when it disconnects), and collects everything at the end.
    """
    broker = Mosquitto(tmp_path, persistence=True)
    broker.start()
    n = 9000  # below OUTBOX_SIZE: nothing may be dropped
    try:
        async with recorder(broker.port, subscribe=(TOPIC,), identifier="link-sub", persistent=True):
            pass  # the session and its subscription now exist
        link = make_link(broker.port)
        link.config = link.config.model_copy(update={"reconnect_max_s": 0.5})
        runner = asyncio.create_task(link.run())
        await asyncio.wait_for(link.connected.wait(), 10)
        for i in range(n):
            link.publish(OutMessage(TOPIC, str(i).encode(), qos=1))
        await poll(lambda: len(link.outbox) <= n - 200, 10)
        assert len(link.outbox) > 0, "everything was sent before the restart: the test proves nothing"
        broker.restart(down_s=0.3)
        await poll(lambda: not link.connected.is_set(), 10)
        await asyncio.wait_for(link.connected.wait(), 20)
        await poll(lambda: len(link.outbox) == 0, 30)
        await link.close([], timeout_s=30)
        await runner
        assert len(link.outbox) == 0
        async with recorder(broker.port, subscribe=(TOPIC,), identifier="link-sub", persistent=True) as rec:
            expected = {str(i).encode() for i in range(n)}
            with contextlib.suppress(TimeoutError):
                # Counting first: a set of 9000 payloads per arriving message would be quadratic.
                await rec.wait_for(
                    lambda: len(rec.on(TOPIC)) >= n and {m.payload for m in rec.on(TOPIC)} >= expected, 30
                )
            missing = sorted(int(p) for p in expected - {m.payload for m in rec.on(TOPIC)})
            assert not missing, f"{len(missing)} never arrived: {missing[:10]}"
    finally:
        broker.stop()


async def test_requests_queued_while_away_arrive_in_order(mosquitto: Mosquitto) -> None:
    """A persistent session delivers what was published while the link was away right
    after the CONNACK, before the link switched to paho's callback: nothing is lost and
    the order is kept across the switch."""
    got: list[bytes] = []

    def make() -> MqttLink:
        return make_link(mosquitto.port, "s2s-order-test", lambda message: got.append(message.payload))

    first = make()
    runner = asyncio.create_task(first.run())
    await asyncio.wait_for(first.connected.wait(), 10)  # the session and its subscriptions exist
    await first.close([])
    await runner
    n = 500
    async with recorder(mosquitto.port, subscribe=()) as rec:
        for i in range(n):
            await rec.say("s2s/kitchen/tts/say", str(i).encode())
    link = make()
    runner = asyncio.create_task(link.run())
    await poll(lambda: len(got) >= n, 20)
    await link.close([])
    await runner
    assert got == [str(i).encode() for i in range(n)]


async def test_a_message_paho_refuses_is_dropped_and_the_link_keeps_going(mosquitto: Mosquitto) -> None:
    """A topic paho cannot publish to (a v5 response topic with a wildcard comes from a client)
    must neither crash the link nor block the outbox behind it."""
    async with recorder(mosquitto.port, subscribe=(TOPIC,)) as rec:
        link = make_link(mosquitto.port)
        runner = asyncio.create_task(link.run())
        await asyncio.wait_for(link.connected.wait(), 10)
        link.publish(OutMessage("replies/#", b"never", qos=1))
        link.publish(OutMessage(TOPIC, b"after", qos=1))
        await rec.wait_for(lambda: any(m.payload == b"after" for m in rec.on(TOPIC)), 10)
        assert not runner.done()
        await link.close([])
        await runner
