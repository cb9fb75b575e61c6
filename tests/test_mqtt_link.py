"""MqttLink against a real mosquitto: the send queue (order, acknowledgement, survival of a
restart) and the inbox (bounded, acknowledged only once handled, in order).

The link drives paho-mqtt on the event loop (``PahoConnection``) and tracks PUBACKs both
ways itself, without a task per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from paho.mqtt import client as paho
from paho.mqtt.enums import CallbackAPIVersion

from s2s_daemon.config import MqttConfig, TlsConfig
from s2s_daemon.mqtt import connection
from s2s_daemon.mqtt.connection import MqttProtocol
from s2s_daemon.mqtt.link import PUBLISH_WINDOW, MqttLink, _Acknowledgements
from s2s_daemon.mqtt.packets import InMessage, OutMessage
from s2s_daemon.mqtt.topics import Topics
from tests.support.broker import Mosquitto
from tests.support.mqtt import recorder
from tests.support.wait import until

pytestmark = pytest.mark.timeout(60)

TOPIC = "s2s/kitchen/tts/finished"


async def poll(condition: Callable[[], bool], timeout_s: float) -> None:
    """The link has no event for these conditions; check every millisecond."""
    await until(condition, timeout_s, interval_s=0.001)


MARKER = b"marker"


async def run_until_marked(link: MqttLink, payloads: Callable[[], list[bytes]], port: int) -> list[bytes]:
    """Run the link until a marker published after it connected reaches it, then close it: what the
    broker had to redeliver on this session came before the marker. The payloads before it."""
    runner = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.connected.wait(), 10)
        async with recorder(port, subscribe=()) as rec:
            await rec.say("s2s/kitchen/tts/say", MARKER)
        await poll(lambda: MARKER in payloads(), 10)
    finally:
        await link.close([])
        await runner
    got = payloads()
    return got[: got.index(MARKER)]


async def through_the_broker(link: MqttLink) -> None:
    """Until a QoS 1 message the link publishes now is acknowledged: the broker has then read what
    the link sent before it (a PUBACK)."""
    sent = asyncio.Event()
    link.publish(OutMessage("s2s-test/marker", MARKER, qos=1, on_sent=sent.set))
    await asyncio.wait_for(sent.wait(), 10)


def make_link(
    port: int,
    client_id: str = "s2s-link-test",
    on_message: Callable[[InMessage], None] = lambda message: None,
    **kwargs: object,
) -> MqttLink:
    config = MqttConfig(broker="external", host="127.0.0.1", port=port)
    link = MqttLink(
        config,
        Topics("s2s", "kitchen"),
        client_id,
        on_message=on_message,
        on_connect=list,
        protocol=MqttProtocol.V5,
        **kwargs,  # type: ignore[arg-type]
    )
    link.prepare()
    return link


def test_the_installed_paho_has_what_the_link_needs() -> None:
    """If this fails, paho changed the public API the connection is built on: the
    external-loop calls, the socket callbacks, manual acknowledgements, VERSION2 callbacks."""
    assert "manual_ack" in inspect.signature(paho.Client).parameters
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="probe", manual_ack=True)
    for method in ("connect", "socket", "loop_read", "loop_write", "loop_misc", "want_write", "ack", "disconnect"):
        assert callable(getattr(client, method)), method
    for callback in ("on_socket_open", "on_socket_close", "on_socket_register_write", "on_socket_unregister_write"):
        setattr(client, callback, None)
    assert client.socket() is None  # the constructor does no I/O


def test_acknowledgements_leave_in_arrival_order() -> None:
    sent: list[int] = []
    acks = _Acknowledgements(lambda mid, qos: sent.append(mid))
    first, second, third = (acks.owe(mid, 1) for mid in (7, 8, 9))
    third.ack()
    assert sent == []  # 9 waits for 7 and 8
    first.ack()
    assert sent == [7]
    first.ack()  # idempotent
    second.ack()
    assert sent == [7, 8, 9]
    late = acks.owe(10, 1)
    acks.close()  # the connection ended
    late.ack()
    assert sent == [7, 8, 9]


async def run_until(link: MqttLink, condition: Callable[[], bool], timeout_s: float = 20) -> None:
    """Run the link until ``condition``, then close it."""
    runner = asyncio.create_task(link.run())
    try:
        await poll(condition, timeout_s)
    finally:
        await link.close([])
        await runner


@pytest.mark.integration
async def test_the_send_queue_is_delivered_in_order_and_acknowledged(mosquitto: Mosquitto) -> None:
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
    assert len(link.sending) == 0


@pytest.mark.integration
async def test_unacknowledged_publishes_survive_a_broker_restart(tmp_path: Path) -> None:
    """Whatever the broker had not acknowledged goes back to the send queue and is sent again
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
        await poll(lambda: len(link.sending) <= n - 200, 10)
        assert len(link.sending) > 0, "everything was sent before the restart: the test proves nothing"
        broker.restart(down_s=0.3)
        await poll(lambda: not link.connected.is_set(), 10)
        await asyncio.wait_for(link.connected.wait(), 20)
        await poll(lambda: len(link.sending) == 0, 30)
        await link.close([], timeout_s=30)
        await runner
        assert len(link.sending) == 0
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


@pytest.mark.integration
async def test_requests_queued_while_away_arrive_in_order(mosquitto: Mosquitto) -> None:
    """A persistent session delivers what was published while the link was away right
    after the CONNACK, before the subscriptions are even confirmed: nothing is lost and
    the order is kept."""
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


@pytest.mark.integration
async def test_a_message_paho_refuses_is_dropped_and_the_link_keeps_going(mosquitto: Mosquitto) -> None:
    """A topic paho cannot publish to (a v5 response topic with a wildcard comes from a client)
    must neither crash the link nor block the send queue behind it."""
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


@pytest.mark.integration
async def test_a_message_is_acknowledged_only_once_its_owner_says_so(persistent_mosquitto: Mosquitto) -> None:
    """Without ``ack()`` the broker keeps a QoS 1 request and sends it again on the next
    connection of the session; once acknowledged, it is gone."""
    port = persistent_mosquitto.port
    first = make_link(port, "s2s-ack-test")
    await run_until(first, first.connected.is_set)  # the session and its subscriptions exist
    async with recorder(port, subscribe=()) as rec:
        for i in range(5):
            await rec.say("s2s/kitchen/tts/say", str(i).encode())
    expected = [str(i).encode() for i in range(5)]

    held: list[InMessage] = []
    unacked = make_link(port, "s2s-ack-test", held.append, auto_ack=False)
    await run_until(unacked, lambda: len(held) >= 5)
    assert [m.payload for m in held] == expected

    again: list[InMessage] = []
    owner = make_link(port, "s2s-ack-test", again.append, auto_ack=False)
    runner = asyncio.create_task(owner.run())
    await poll(lambda: len(again) >= 5, 20)
    assert [m.payload for m in again] == expected, "what was never acknowledged comes again"
    # Acknowledged out of order on purpose: 4 and 0 now, 1-3 never. PUBACKs leave in the
    # order the PUBLISHes came, so only 0's goes out (4's waits behind 1, 2 and 3).
    again[4].ack()
    again[0].ack()
    await through_the_broker(owner)  # 0's PUBACK
    await owner.close([])
    await runner

    last: list[InMessage] = []
    check = make_link(port, "s2s-ack-test", last.append)
    assert await run_until_marked(check, lambda: [m.payload for m in last], port) == expected[1:]


@pytest.mark.integration
async def test_a_handler_that_raises_neither_stops_the_intake_nor_wedges_the_session(mosquitto: Mosquitto) -> None:
    """``auto_ack``: a message is acknowledged once its handler returned or raised (a bug
    must not make the broker resend it forever); the next ones are still handled."""
    got: list[bytes] = []

    def handler(message: InMessage) -> None:
        if message.payload == b"boom":
            raise RuntimeError("a bug in the handler")
        got.append(message.payload)

    link = make_link(mosquitto.port, "s2s-raise-test", handler)
    runner = asyncio.create_task(link.run())
    await asyncio.wait_for(link.connected.wait(), 10)
    async with recorder(mosquitto.port, subscribe=()) as rec:
        for payload in (b"a", b"boom", b"b"):
            await rec.say("s2s/kitchen/tts/say", payload)
    await poll(lambda: got == [b"a", b"b"], 10)
    await link.close([])
    await runner

    again: list[bytes] = []
    link = make_link(mosquitto.port, "s2s-raise-test", lambda message: again.append(message.payload))
    assert await run_until_marked(link, lambda: again, mosquitto.port) == [], "acknowledged messages came again"


@pytest.mark.integration
async def test_the_inbox_is_bounded_and_loses_nothing(mosquitto: Mosquitto) -> None:
    """A burst larger than the inbox, a slow handler: the socket stops being read at
    ``inbox_size`` (back-pressure), every message is handled once, in order.

    The burst comes from mosquitto_pub (another process: it lands in the socket while
    the handler blocks this loop), and events published meanwhile keep paho reading
    several packets per call, as in the daemon under load; otherwise one packet per
    event-loop turn never outruns the handler.
    """
    n, size = 600, 20
    got: list[bytes] = []
    depths: list[int] = []

    def slow(message: InMessage) -> None:
        depths.append(len(link.inbox))
        got.append(message.payload)
        time.sleep(0.001)  # a slow handler, on the event loop on purpose: the behaviour under test

    link = make_link(mosquitto.port, "s2s-inbox-test", slow, inbox_size=size)
    runner = asyncio.create_task(link.run())
    await asyncio.wait_for(link.connected.wait(), 10)
    for i in range(8000):
        link.publish(OutMessage(TOPIC, str(i).encode(), qos=1))
    burst = await asyncio.create_subprocess_exec(
        "mosquitto_pub",
        "-p",
        str(mosquitto.port),
        "-q",
        "0",
        "-t",
        "s2s/kitchen/tts/say",
        "-l",
        stdin=asyncio.subprocess.PIPE,
    )
    await burst.communicate("".join(f"{i}\n" for i in range(n)).encode())
    assert burst.returncode == 0
    await poll(lambda: len(got) >= n, 30)
    await link.close([])
    await runner
    assert got == [str(i).encode() for i in range(n)]
    assert link.reads_paused > 0, "the inbox never filled: the test proves nothing"
    assert max(depths) < size + PUBLISH_WINDOW


@pytest.mark.slow
async def test_connecting_never_blocks_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Name lookup, TCP connect and the TLS handshake (all blocking in paho) run in a
    thread: a broker that accepts and then says nothing stalls the link, not the loop."""
    monkeypatch.setattr(connection, "CONNECT_TIMEOUT_S", 1.0)
    writers: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda reader, writer: writers.append(writer), "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    config = MqttConfig(broker="external", host="127.0.0.1", port=port, tls=TlsConfig(), reconnect_max_s=0.2)
    link = MqttLink(config, Topics("s2s", "kitchen"), "s2s-silent", lambda message: None, list, MqttProtocol.V5)
    link.prepare()
    runner = asyncio.create_task(link.run())
    loop = asyncio.get_running_loop()
    try:
        started = last = loop.time()
        longest = 0.0
        while loop.time() - started < 2.5:  # two handshakes time out meanwhile
            await asyncio.sleep(0.01)  # the measurement: how late the loop wakes us
            longest, last = max(longest, loop.time() - last), loop.time()
        assert writers, "the link never connected: the test proves nothing"
        assert longest < 0.5, f"the event loop stalled for {longest:.2f} s"
        assert not link.connected.is_set()
    finally:
        await link.close([], timeout_s=3)
        await runner
        for writer in writers:
            writer.close()
        silent.close()
        await silent.wait_closed()
