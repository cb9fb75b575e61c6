"""The broker link: subscribe, receive through a bounded inbox, publish through a bounded send queue, reconnect.

Persistent session (a stable client id, ``clean_start=False`` and a session expiry on
MQTT v5, ``clean_session=False`` on 3.1.1) so QoS 1 requests published while we are
away are delivered when we come back. Events wait in the send queue while disconnected and
a publish is only taken off the send queue once the broker acknowledged it (at least once).

A received QoS 1 message is acknowledged (PUBACK) only once it was handled: when
``on_message`` returned (``auto_ack``), or when its owner calls ``InMessage.ack()``. What
is not acknowledged when the connection drops, the broker sends again on the next one.
The connection itself is ``PahoConnection`` (paho-mqtt on this event loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import random
import ssl
from collections.abc import Callable, Sequence

import structlog
from paho.mqtt import client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from s2s_daemon.config import MqttConfig
from s2s_daemon.mqtt.connection import (
    ConnectOptions,
    MqttError,
    MqttProtocol,
    PahoConnection,
    read_password,
    tls_context,
)
from s2s_daemon.mqtt.packets import InMessage, OutMessage, Receipt
from s2s_daemon.mqtt.topics import HERMES_SAY, Topics
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.messages import ReplyTo

log = structlog.get_logger(__name__)

SEND_QUEUE_SIZE = 10_000
"""Events held while disconnected; past that the oldest are dropped and counted."""
PUBLISH_WINDOW = 64
"""Publishes awaiting the broker's acknowledgement at once (QoS 1 pipelining)."""
ACK_TIMEOUT_S = 10.0
"""A broker that acknowledges nothing for this long is treated as a lost connection."""
INBOX_SIZE = 1000
"""Messages read off the socket but not handled yet; past that the socket is not read."""
DISCONNECT_TIMEOUT_S = 2.0
"""How long a clean DISCONNECT may take once the send queue is flushed."""


def _reply_to(message: paho.MQTTMessage) -> ReplyTo | None:
    props = getattr(message, "properties", None)
    if props is None:
        return None
    topic = getattr(props, "ResponseTopic", None)
    if not topic:
        return None
    data = getattr(props, "CorrelationData", None)
    return ReplyTo(str(topic), bytes(data) if data is not None else None)


class _Publishes:
    """Our publishes the broker has not acknowledged yet, oldest first, by packet id."""

    def __init__(self) -> None:
        self.inflight: collections.OrderedDict[int, OutMessage | None] = collections.OrderedDict()
        """None: not the send queue's (an on-connect message), never put back."""
        self._space = asyncio.Event()

    def acknowledged(self, mid: int) -> None:
        message = self.inflight.pop(mid, None)
        self._space.set()
        if message is not None and message.on_sent is not None:
            message.on_sent()

    def refused(self, mid: int, reason: str) -> None:
        """The broker acknowledged ``mid`` with a failure or "no matching subscribers" (before
        ``acknowledged``): the message's ``on_refused`` instead of its ``on_sent``, when it has one."""
        message = self.inflight.get(mid)
        if message is not None and message.on_refused is not None:
            del self.inflight[mid]
            self._space.set()
            message.on_refused(reason)

    async def wait_below(self, limit: int, connection: PahoConnection) -> None:
        """Wait until fewer than ``limit`` publishes are unacknowledged.

        Raises MqttError when ACK_TIMEOUT_S pass without any acknowledgement while the
        socket is being read (a full inbox stops reading, and with it the PUBACKs).
        """
        while len(self.inflight) >= limit:
            self._space.clear()
            try:
                async with asyncio.timeout(ACK_TIMEOUT_S):
                    await self._space.wait()
            except TimeoutError:
                if connection.reading:
                    raise MqttError(f"the broker acknowledged nothing for {ACK_TIMEOUT_S:.0f} s") from None

    def drain(self) -> list[OutMessage]:
        """The unacknowledged queued messages, oldest first; forgets them all."""
        messages = [message for message in self.inflight.values() if message is not None]
        self.inflight.clear()
        return messages


class _Acknowledgements:
    """PUBACKs in the order the PUBLISHes came, whatever the order of the ``ack()`` calls.

    MQTT wants a client's acknowledgements in the order it received the PUBLISHes (3.1.1
    §4.6, v5 §4.6); paho's manual ``ack()`` sends whatever it is given at once, so a
    receipt acknowledged early waits here for the ones before it. One per connection:
    closed when the connection ends, after which acknowledging does nothing (the broker
    redelivers what it did not get a PUBACK for).
    """

    def __init__(self, send: Callable[[int, int], None]) -> None:
        self._send = send
        self._owed: collections.deque[Receipt] = collections.deque()

    def owe(self, mid: int, qos: int) -> Receipt:
        receipt = Receipt(mid, qos, self._flush)
        self._owed.append(receipt)
        return receipt

    def _flush(self) -> None:
        owed = self._owed
        while owed and owed[0].acked:
            receipt = owed.popleft()
            self._send(receipt.mid, receipt.qos)

    def close(self) -> None:
        self._owed.clear()


class MqttLink:
    """Owns the connection. ``run()`` connects, reconnects with jittered backoff, and stops on ``close()``."""

    def __init__(
        self,
        config: MqttConfig,
        topics: Topics,
        client_id: str,
        on_message: Callable[[InMessage], None],
        on_connect: Callable[[], list[OutMessage]],
        protocol: MqttProtocol | None = None,
        subscriptions: Sequence[str] = (),
        auto_ack: bool = True,
        inbox_size: int = INBOX_SIZE,
        on_denied: Callable[[list[tuple[str, str]]], None] | None = None,
    ) -> None:
        self.config = config
        self.topics = topics
        self.extra_subscriptions = tuple(subscriptions)
        """Topics subscribed besides say, stop, pool and Hermes (Home Assistant's birth)."""
        self.client_id = client_id
        self.on_message = on_message
        self.on_connect = on_connect
        """Returns the retained messages (status, info, state) to publish on every connect."""
        self.auto_ack = auto_ack
        self.on_denied = on_denied
        """Called with ``(topic, reason)`` of each subscription the broker refused (its ACL): the
        daemon stops with exit 77. Until then the link publishes nothing that claims readiness
        (no ``online``); terminal events still go out."""
        self.denied: list[tuple[str, str]] = []
        """The subscriptions the broker refused on the last connect."""
        self._denied_publishes: set[str] = set()
        """Topics whose publish the broker refused (logged once each)."""
        self._leaving_pool = False
        """``leave_pool()`` was called: the pool subscription is not made again, and is undone on connect."""
        """True: a message is acknowledged once ``on_message`` returned (or raised); False: its
        owner calls ``InMessage.ack()`` (e.g. once the request is durably stored)."""
        self.sending: Channel[OutMessage] = Channel(SEND_QUEUE_SIZE, Overflow.DROP_OLDEST, "mqtt.sending")
        self.inbox: collections.deque[InMessage] = collections.deque()
        """Received, not handled yet. Bounded by back-pressure: at ``inbox_size`` the socket
        is no longer read until the inbox has drained to half (see ``_received``)."""
        self.inbox_size = inbox_size
        self.reads_paused = 0
        """How many times a full inbox stopped reading the socket."""
        self.connected = asyncio.Event()
        self.protocol: MqttProtocol | None = protocol
        """The protocol in use: fixed by the caller, or found on first connect (v5, then 3.1.1)."""
        self._closing = asyncio.Event()
        self._closed = asyncio.Event()
        self._password: str | None = None
        self._tls_context: ssl.SSLContext | None = None
        self._connection: PahoConnection | None = None
        self._acks = _Acknowledgements(lambda mid, qos: None)
        self._parked: list[InMessage] = []
        """Unacknowledged QoS 1 messages of a connection that ended, until the next CONNACK says
        whether the broker kept the session (it then sends them again) or not (we handle them)."""
        self._draining = False

    # -- publishing --------------------------------------------------------------------

    def publish(self, message: OutMessage) -> None:
        """Queue an event; never blocks. Dropped (counted) only past SEND_QUEUE_SIZE."""
        before = self.sending.dropped
        self.sending.put_nowait(message)
        if self.sending.dropped != before:
            log.warning("send_queue_overflow", dropped=self.sending.dropped)

    # -- connection --------------------------------------------------------------------

    def prepare(self) -> None:
        """Read secrets and TLS files once at startup (config errors surface before running)."""
        self._password = read_password(self.config)
        self._tls_context = tls_context(self.config.tls)

    def _options(self, protocol: MqttProtocol) -> ConnectOptions:
        cfg = self.config
        return ConnectOptions(
            cfg.host,
            cfg.port,
            self.client_id,
            protocol,
            keepalive_s=cfg.keepalive_s,
            persistent=True,
            session_expiry_s=cfg.session_expiry_s,
            username=cfg.username,
            password=self._password,
            tls=self._tls_context,
            will=OutMessage(self.topics.status, b"offline", qos=1, retain=True),
        )

    def _subscriptions(self) -> list[str]:
        subs = [self.topics.say, self.topics.stream, self.topics.stop]
        if self.topics.pool_subscription is not None:
            if not self._leaving_pool:
                subs.append(self.topics.pool_subscription)
            subs.append(self.topics.pool_taken)  # the receipts for what it hands back (kept while it drains)
        if self.config.hermes:
            subs.append(HERMES_SAY)
        subs.extend(self.extra_subscriptions)
        return subs

    async def run(self) -> None:
        """Connect and serve until ``close()``; transient broker failures are retried forever."""
        try:
            await self._connect_loop()
        finally:
            self.connected.clear()
            self._closed.set()

    async def _connect_loop(self) -> None:
        attempt = 0
        while not self._closing.is_set():
            protocol = self.protocol or (MqttProtocol.V5 if attempt % 2 == 0 else MqttProtocol.V311)
            publishes = _Publishes()
            connection = PahoConnection(
                self._options(protocol),
                self._received,
                publishes.acknowledged,
                self._session_started,
                functools.partial(self._publish_refused, publishes),
            )
            self._connection = connection
            self._acks = _Acknowledgements(connection.ack)
            try:
                await connection.open()
                self.protocol = protocol
                attempt = 0
                await self._serve(connection, publishes)
            except MqttError as exc:
                if self._closing.is_set():
                    return
                attempt += 1
                if self.protocol is None and attempt == 1:
                    # A 3.1.1-only broker refuses v5: try 3.1.1 straight away.
                    log.info("mqtt_protocol_fallback", error=str(exc))
                    continue
                delay = min(self.config.reconnect_max_s, 0.25 * 2 ** min(attempt, 8)) * random.uniform(0.5, 1.0)
                log.warning("mqtt_disconnected", error=str(exc), retry_in_s=round(delay, 2), attempt=attempt)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._closing.wait()
            else:
                return  # closed
            finally:
                connection.abort()  # nothing left to do once it was closed cleanly
                self._connection_ended()

    def _connection_ended(self) -> None:
        """Forget the connection; park the QoS 1 messages it still owes a PUBACK for."""
        self._connection = None
        self._acks.close()
        if any(message.receipt is not None for message in self.inbox):
            kept: collections.deque[InMessage] = collections.deque()
            for message in self.inbox:
                (kept if message.receipt is None else self._parked).append(message)
            self.inbox = kept

    def _session_started(self, present: bool) -> None:
        """At the CONNACK, before the session's first message is read."""
        parked, self._parked = self._parked, []
        if not parked:
            return
        if present:
            # The broker never had their PUBACK: it sends them again now, in order.
            log.info("mqtt_redelivery_expected", messages=len(parked))
            return
        log.warning("mqtt_session_lost", handling=len(parked))
        # Nothing to acknowledge any more: the broker forgot them with the session.
        self.inbox.extendleft(dataclasses.replace(message, receipt=None) for message in reversed(parked))
        self._schedule_drain()

    async def _serve(self, connection: PahoConnection, publishes: _Publishes) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(connection.run(), name="s2s.mqtt.keepalive")
                qos = min(self.config.qos, 1)  # see _received on QoS 2
                refused = await connection.subscribe([(t, qos) for t in self._subscriptions()], ACK_TIMEOUT_S)
                if self._leaving_pool and self.topics.pool_subscription is not None:
                    # A persistent session still holds it from before the drain began.
                    await connection.unsubscribe([self.topics.pool_subscription], ACK_TIMEOUT_S)
                self.denied = refused
                if refused:
                    for topic, reason in refused:
                        log.error(
                            "mqtt_subscription_denied",
                            topic=topic,
                            reason=reason,
                            consequence="requests on this topic are never received; grant it in the broker's ACL",
                        )
                    if self.on_denied is not None:
                        self.on_denied(refused)
                else:
                    for message in self.on_connect():
                        self._send(connection, publishes, message, requeue=False)
                    await publishes.wait_below(1, connection)
                    self.connected.set()
                    log.info(
                        "mqtt_connected",
                        host=self.config.host,
                        port=self.config.port,
                        protocol=self.protocol.value if self.protocol else None,
                    )
                await self._pump(connection, publishes)
                await connection.close(DISCONNECT_TIMEOUT_S)
        except* MqttError as group:
            raise group.exceptions[0] from None
        finally:
            self.connected.clear()

    def _publish_refused(self, publishes: _Publishes, mid: int, topic: str, reason: str, code: int) -> None:
        """The broker acknowledged a publish with a failure (v5; e.g. its ACL): loud once per topic.
        "No matching subscribers" is no failure: only the message's own ``on_refused`` hears of it."""
        publishes.refused(mid, reason)
        if code < 0x80:
            return
        if topic in self._denied_publishes:
            log.debug("mqtt_publish_denied", topic=topic, reason=reason)
            return
        self._denied_publishes.add(topic)
        log.error(
            "mqtt_publish_denied",
            topic=topic,
            reason=reason,
            consequence="the broker drops what the daemon publishes there; grant it in the broker's ACL",
        )

    async def leave_pool(self, timeout_s: float) -> bool:
        """Unsubscribe from the shared pool topic (a pool daemon's drain), so the broker sends new pool
        requests to the group's other members; True once the UNSUBACK came within ``timeout_s``.

        Not connected: False at once; the next connection then unsubscribes before it publishes
        anything (a persistent session kept the subscription). No pool: True.
        """
        pool = self.topics.pool_subscription
        if pool is None:
            return True
        self._leaving_pool = True
        connection = self._connection
        if connection is None or not connection.is_open:
            return False
        return await connection.unsubscribe([pool], timeout_s)

    # -- receiving ---------------------------------------------------------------------

    def _received(self, message: paho.MQTTMessage) -> None:
        """One PUBLISH off the socket (inside paho's ``loop_read``, on the event loop).

        The inbox is bounded by back-pressure rather than by dropping: at ``inbox_size`` the
        socket is no longer read, so what the broker sends next waits in the TCP buffers and
        then the broker (which also stops sending QoS 1 past its in-flight window, since we
        acknowledge only what was handled). Reading resumes once the inbox has drained to
        half. One read may bring a few more packets than that (paho reads up to one per
        publish in flight), never an unbounded number. While the socket is unread, PUBACKs
        wait too (the ack timeout is suspended); a handler so slow that it stays unread for a
        keepalive period would cost the connection, and the daemon's takes microseconds.

        Subscriptions are QoS 1 at most: with manual acknowledgements paho cannot answer a
        QoS 2 PUBREL that a broker re-sends after a reconnect (its PUBLISH died with the old
        client), which would hold one of the broker's in-flight slots for good. QoS 1 and
        the ledger's duplicate window serve the same purpose.
        """
        receipt = self._acks.owe(message.mid, message.qos) if message.qos > 0 else None
        try:
            topic = message.topic
        except UnicodeDecodeError:
            log.warning("mqtt_topic_not_utf8")
            if receipt is not None:
                receipt.ack()
            return
        payload = message.payload
        self.inbox.append(
            InMessage(
                topic,
                payload if isinstance(payload, bytes) else bytes(payload),
                _reply_to(message),
                asyncio.get_running_loop().time(),
                receipt,
                redelivered=bool(message.dup),
                retained=bool(message.retain),
            )
        )
        connection = self._connection
        if len(self.inbox) >= self.inbox_size and connection is not None and connection.reading:
            connection.pause_reading()
            self.reads_paused += 1
            log.debug("mqtt_inbox_full", messages=len(self.inbox))
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if self.inbox and not self._draining:
            self._draining = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Handle one received message, then let other ready work run before the next.

        paho reads every packet waiting on the socket in one go; handling them all at once
        would fill the request queue before the TTS stage ever ran (a burst would be
        rejected while the engine idles). One message per event-loop turn keeps intake and
        synthesis interleaved, for one callback instead of a task per message.
        """
        try:
            if not self.inbox:
                return
            message = self.inbox.popleft()
            connection = self._connection
            if connection is not None and not connection.reading and len(self.inbox) <= self.inbox_size // 2:
                connection.resume_reading()
            try:
                self.on_message(message)
            except Exception:  # a bug in a handler must not stop the intake (nor wedge the session)
                log.exception("mqtt_message_handler_failed", topic=message.topic[:200])
            if self.auto_ack:
                message.ack()
        finally:
            if self.inbox:
                asyncio.get_running_loop().call_soon(self._drain)
            else:
                self._draining = False

    # -- the send queue -----------------------------------------------------------------

    async def _next(self) -> OutMessage | None:
        """The next queued message, or None once closing was requested.

        Nothing is taken from the send queue until it is returned: a cancellation while
        waiting (a disconnect) cannot lose a message.
        """
        if len(self.sending):
            return self.sending.get_nowait()
        ready = asyncio.ensure_future(self.sending.wait_readable())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({ready, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            closing.cancel()
        return self.sending.get_nowait() if len(self.sending) else None

    def _send(
        self, connection: PahoConnection, publishes: _Publishes, message: OutMessage, requeue: bool = True
    ) -> None:
        """Hand one message to paho; a QoS 1 one is tracked until its PUBACK.

        A message paho refuses (ValueError: e.g. a client's v5 response topic with a
        wildcard) can never be sent: it is dropped with a warning, not retried forever.
        """
        try:
            mid = connection.publish(message, self._properties(message))
        except ValueError as exc:
            log.warning("mqtt_publish_refused", topic=message.topic[:200], error=str(exc))
            if message.on_sent is not None:
                message.on_sent()  # it can never be sent: settled
            return
        if mid is not None:
            publishes.inflight[mid] = message if requeue else None
        elif message.on_sent is not None:
            message.on_sent()  # QoS 0: paho has it, no acknowledgement comes

    async def _pump(self, connection: PahoConnection, publishes: _Publishes) -> None:
        """Publish the send queue, up to PUBLISH_WINDOW unacknowledged at once, in order.

        A message leaves the send queue for good only when the broker acknowledged it (QoS 1)
        or paho took it (QoS 0); on a failure or a disconnect every unacknowledged one goes
        back to the head of the send queue, in order.
        """
        try:
            while True:
                if self._closing.is_set() and len(self.sending) == 0:
                    break
                message = await self._next()
                if message is None:
                    continue
                try:
                    if len(publishes.inflight) >= PUBLISH_WINDOW:
                        await publishes.wait_below(PUBLISH_WINDOW, connection)
                    self._send(connection, publishes, message)
                except BaseException:
                    self.sending.put_front_nowait(message)
                    raise
            await publishes.wait_below(1, connection)
        finally:
            for message in reversed(publishes.drain()):
                self.sending.put_front_nowait(message)

    def _properties(self, message: OutMessage) -> Properties | None:
        if self.protocol is not MqttProtocol.V5 or (
            message.correlation_data is None and message.response_topic is None
        ):
            return None
        props = Properties(PacketTypes.PUBLISH)
        if message.response_topic is not None:
            props.ResponseTopic = message.response_topic
        if message.correlation_data is not None:
            props.CorrelationData = message.correlation_data
        return props

    async def close(self, last: list[OutMessage], timeout_s: float = 5.0) -> None:
        """Flush the send queue, publish ``last`` (e.g. retained offline), then disconnect."""
        for message in last:
            self.publish(message)
        self._closing.set()
        try:
            async with asyncio.timeout(timeout_s):
                await self._closed.wait()
        except TimeoutError:
            log.warning("mqtt_flush_timeout", pending=len(self.sending))
