"""The broker connection: subscribe, receive, publish through a bounded outbox, reconnect.

Persistent session (a stable client id, ``clean_start=False`` and a session expiry on
MQTT v5, ``clean_session=False`` on 3.1.1) so QoS 1 requests published while we are
away are delivered when we come back. Events wait in the outbox while disconnected and
a publish is only taken off the outbox once the broker acknowledged it (at least once).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import aiomqtt
import structlog
from paho.mqtt import client as mqtt_client
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from s2s_daemon.config import MqttConfig
from s2s_daemon.errors import ConfigError
from s2s_daemon.intake.topics import HERMES_SAY, Topics
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.messages import ReplyTo

log = structlog.get_logger(__name__)

OUTBOX_SIZE = 10_000
"""Events held while disconnected; past that the oldest are dropped and counted."""
PUBLISH_WINDOW = 64
"""Publishes awaiting the broker's acknowledgement at once (QoS 1 pipelining)."""


@dataclass(frozen=True, slots=True)
class OutMessage:
    topic: str
    payload: bytes
    qos: int
    retain: bool = False
    correlation_data: bytes | None = None
    """MQTT v5 Correlation Data echoed on a response topic."""


@dataclass(frozen=True, slots=True)
class InMessage:
    topic: str
    payload: bytes
    reply_to: ReplyTo | None
    received_at: float
    """Monotonic seconds when the message came off the socket."""


def _reply_to(message: Any) -> ReplyTo | None:
    props = message.properties
    if props is None:
        return None
    topic = getattr(props, "ResponseTopic", None)
    if not topic:
        return None
    data = getattr(props, "CorrelationData", None)
    return ReplyTo(str(topic), bytes(data) if data is not None else None)


def _payload_bytes(payload: object) -> bytes:
    if isinstance(payload, bytes | bytearray):
        return bytes(payload)
    if isinstance(payload, str):
        return payload.encode()
    if payload is None:
        return b""
    return str(payload).encode()


ACK_TIMEOUT_S = 10.0
"""A broker that acknowledges nothing for this long is treated as a lost connection."""


def _internals(client: aiomqtt.Client) -> tuple[Any, dict[int, object], asyncio.Queue[Any]]:
    """The aiomqtt 2.x internals the link works through: the paho client, the table of
    pending publishes and the incoming-message queue (unchanged from 2.0 to 2.5)."""
    paho = getattr(client, "_client", None)
    pending = getattr(client, "_pending_publishes", None)
    queue = getattr(client, "_queue", None)
    usable = callable(getattr(paho, "publish", None)) and isinstance(pending, dict) and isinstance(queue, asyncio.Queue)
    if not usable:
        raise RuntimeError(
            "this aiomqtt lacks the internals the MQTT link works through "
            "(Client._client, Client._pending_publishes, Client._queue); install aiomqtt 2.x"
        )
    return paho, cast(dict[int, object], pending), cast(asyncio.Queue[Any], queue)


class _Ack:
    """Stands in for aiomqtt's per-publish ``asyncio.Event``: its ``set()`` is the PUBACK."""

    __slots__ = ("mid", "tracker")

    def __init__(self, tracker: _AckTracker, mid: int) -> None:
        self.tracker = tracker
        self.mid = mid

    def set(self) -> None:
        self.tracker.acknowledged(self.mid)


class _AckTracker:
    """Publishes straight through the paho client that aiomqtt wraps, without a task,
    an event and a timeout per message.

    aiomqtt's ``publish`` costs a task, an ``asyncio.Event``, a ``wait_for`` and (once
    more than 10 are pending) a warning log call per message; at hundreds of events per
    second that was a large part of the daemon's publishing cost. This hands the packet
    to paho and registers an ``_Ack`` in aiomqtt's table of pending publishes, which
    aiomqtt's own ``on_publish`` callback completes on the PUBACK. It relies on two
    aiomqtt 2.x internals (``_client`` and ``_pending_publishes``, the same from 2.0 to
    2.5); ``attach`` refuses an aiomqtt without them, and a test checks the installed one.
    """

    def __init__(self, paho: object, pending: dict[int, object]) -> None:
        self._paho = paho
        self._pending = pending
        self.inflight: collections.OrderedDict[int, OutMessage] = collections.OrderedDict()
        self._space = asyncio.Event()

    @classmethod
    def attach(cls, client: aiomqtt.Client) -> _AckTracker:
        paho, pending, _ = _internals(client)
        return cls(paho, pending)

    def publish(self, message: OutMessage, properties: Properties | None) -> None:
        info = self._paho.publish(  # type: ignore[attr-defined]
            message.topic, message.payload, message.qos, message.retain, properties
        )
        if info.rc != mqtt_client.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "Could not publish message")
        if message.qos > 0 and not info.is_published():
            self.inflight[info.mid] = message
            self._pending[info.mid] = _Ack(self, info.mid)

    def acknowledged(self, mid: int) -> None:
        self.inflight.pop(mid, None)
        self._space.set()

    async def wait_below(self, limit: int) -> None:
        """Wait until fewer than ``limit`` publishes are unacknowledged."""
        try:
            async with asyncio.timeout(ACK_TIMEOUT_S):
                while len(self.inflight) >= limit:
                    self._space.clear()
                    await self._space.wait()
        except TimeoutError:
            raise aiomqtt.MqttError(f"the broker acknowledged nothing for {ACK_TIMEOUT_S:.0f} s") from None

    def drain(self) -> list[OutMessage]:
        """The unacknowledged messages, oldest first; forgets them."""
        messages = list(self.inflight.values())
        for mid in self.inflight:
            self._pending.pop(mid, None)
        self.inflight.clear()
        return messages


class MqttLink:
    """Owns the client. ``run()`` connects, reconnects with jittered backoff, and stops on ``close()``."""

    def __init__(
        self,
        config: MqttConfig,
        topics: Topics,
        client_id: str,
        on_message: Callable[[InMessage], None],
        on_connect: Callable[[], list[OutMessage]],
        protocol: aiomqtt.ProtocolVersion | None = None,
        subscriptions: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.topics = topics
        self.extra_subscriptions = tuple(subscriptions)
        """Topics subscribed besides say, stop, pool and Hermes (Home Assistant's birth)."""
        self.client_id = client_id
        self.on_message = on_message
        self.on_connect = on_connect
        """Returns the retained messages (status, info, state) to publish on every connect."""
        self.outbox: Channel[OutMessage] = Channel(OUTBOX_SIZE, Overflow.DROP_OLDEST, "outbox")
        self.connected = asyncio.Event()
        self.protocol: aiomqtt.ProtocolVersion | None = protocol
        """The protocol in use: fixed by the caller, or found on first connect (v5, then 3.1.1)."""
        self._closing = asyncio.Event()
        self._closed = asyncio.Event()
        self._password: str | None = None
        self._inbox: collections.deque[tuple[Any, float]] = collections.deque()
        """Messages read by paho, not yet handled: (message, monotonic receipt time)."""
        self._draining = False

    # -- publishing --------------------------------------------------------------------

    def publish(self, message: OutMessage) -> None:
        """Queue an event; never blocks. Dropped (counted) only past OUTBOX_SIZE."""
        before = self.outbox.dropped
        self.outbox.put_nowait(message)
        if self.outbox.dropped != before:
            log.warning("outbox_overflow", dropped=self.outbox.dropped)

    # -- connection --------------------------------------------------------------------

    def _tls(self) -> ssl.SSLContext | None:
        tls = self.config.tls
        if tls is None:
            return None
        try:
            context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
            if tls.cert_file is not None:
                context.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"mqtt.tls: {exc}") from exc
        if tls.insecure:
            context.check_hostname = False
        return context

    def _read_password(self) -> str | None:
        if self.config.password_file is None:
            return None
        try:
            return self.config.password_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"mqtt.password_file: cannot read {self.config.password_file}: {exc}") from exc

    def prepare(self) -> None:
        """Read secrets and TLS files once at startup (config errors surface before running)."""
        self._password = self._read_password()
        self._tls_context = self._tls()

    def _client(self, protocol: aiomqtt.ProtocolVersion) -> aiomqtt.Client:
        cfg = self.config
        will = aiomqtt.Will(self.topics.status, b"offline", qos=1, retain=True)
        kwargs: dict[str, object] = {}
        if protocol is aiomqtt.ProtocolVersion.V5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = cfg.session_expiry_s
            kwargs.update(clean_start=False, properties=props)
        else:
            kwargs.update(clean_session=False)
        return aiomqtt.Client(
            cfg.host,
            cfg.port,
            username=cfg.username,
            password=self._password,
            identifier=self.client_id,
            protocol=protocol,
            will=will,
            keepalive=cfg.keepalive_s,
            timeout=10,
            tls_context=self._tls_context,
            # Small packets both ways: without TCP_NODELAY, Nagle and delayed ACKs cost ~40 ms.
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            **kwargs,  # type: ignore[arg-type]
        )

    def _subscriptions(self) -> list[str]:
        subs = [self.topics.say, self.topics.stop]
        if self.topics.pool_subscription is not None:
            subs.append(self.topics.pool_subscription)
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
        protocols = [aiomqtt.ProtocolVersion.V5, aiomqtt.ProtocolVersion.V311]
        while not self._closing.is_set():
            protocol = self.protocol or protocols[attempt % 2 if self.protocol is None else 0]
            try:
                async with self._client(protocol) as client:
                    self.protocol = protocol
                    attempt = 0
                    await self._serve(client)
                    return
            except aiomqtt.MqttError as exc:
                self.connected.clear()
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

    def _receive_directly(self, client: aiomqtt.Client) -> None:
        """Take incoming messages in paho's ``on_message`` callback, on the event loop.

        aiomqtt wraps each message in its own ``Message`` and hands it over through an
        ``asyncio.Queue`` with a task and an ``asyncio.wait`` per message; at hundreds of
        requests per second that was a tenth of the daemon's CPU. Messages aiomqtt queued
        before the switch (a persistent session delivers right after the CONNACK) are
        handled first, so the order is kept. aiomqtt's message iterator still runs
        (``_receive``): it ends the connection's task group when the broker goes away.
        """
        paho, _, queue = _internals(client)
        loop = asyncio.get_running_loop()
        while not queue.empty():
            self._inbox.append((queue.get_nowait(), loop.time()))

        def on_message(_client: object, _userdata: object, message: object) -> None:
            self._inbox.append((message, loop.time()))
            self._schedule_drain()

        paho.on_message = on_message
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if self._inbox and not self._draining:
            self._draining = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Handle one received message, then let other ready work run before the next.

        paho reads every packet waiting on the socket in one go; handling them all at once
        would fill the request queue before the TTS stage ever ran (a burst would be
        rejected while the engine idles). One message per event-loop turn keeps intake and
        synthesis interleaved, as aiomqtt's iterator did, for one callback instead of a task.
        """
        try:
            message, received_at = self._inbox.popleft()
            self._deliver(message, received_at)
        except Exception:  # a bug in a handler must not stop the intake
            log.exception("mqtt_message_handler_failed")
        finally:
            if self._inbox:
                asyncio.get_running_loop().call_soon(self._drain)
            else:
                self._draining = False

    def _deliver(self, message: Any, received_at: float) -> None:
        """One message from aiomqtt (``Message``) or paho (``MQTTMessage``)."""
        topic = message.topic
        self.on_message(
            InMessage(
                topic if isinstance(topic, str) else topic.value,
                _payload_bytes(message.payload),
                _reply_to(message),
                received_at,
            )
        )

    async def _serve(self, client: aiomqtt.Client) -> None:
        self._receive_directly(client)
        for topic in self._subscriptions():
            await client.subscribe(topic, qos=self.config.qos)
        for message in self.on_connect():
            await client.publish(message.topic, message.payload, qos=message.qos, retain=message.retain)
        self.connected.set()
        log.info(
            "mqtt_connected",
            host=self.config.host,
            port=self.config.port,
            protocol=self.protocol.name if self.protocol else None,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                receiver = tg.create_task(self._receive(client), name="s2s.mqtt.receive")
                await self._pump(client)
                receiver.cancel()
        except* aiomqtt.MqttError as group:
            raise group.exceptions[0] from None
        finally:
            self.connected.clear()

    async def _receive(self, client: aiomqtt.Client) -> None:
        """Messages that still come through aiomqtt; raises MqttError when the broker goes away."""
        loop = asyncio.get_running_loop()
        async for message in client.messages:
            self._deliver(message, loop.time())

    async def _next(self) -> OutMessage | None:
        """The next outbox message, or None once closing was requested.

        Nothing is taken from the outbox until it is returned: a cancellation while
        waiting (a disconnect) cannot lose a message.
        """
        if len(self.outbox):
            return self.outbox.get_nowait()
        ready = asyncio.ensure_future(self.outbox.wait_readable())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({ready, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            closing.cancel()
        return self.outbox.get_nowait() if len(self.outbox) else None

    async def _pump(self, client: aiomqtt.Client) -> None:
        """Publish the outbox, up to PUBLISH_WINDOW unacknowledged at once, in order.

        A message leaves the outbox for good only when the broker acknowledged it (QoS 1)
        or paho took it (QoS 0); on a failure or a disconnect every unacknowledged one goes
        back to the head of the outbox, in order.
        """
        acks = _AckTracker.attach(client)
        try:
            while True:
                if self._closing.is_set() and len(self.outbox) == 0:
                    break
                message = await self._next()
                if message is None:
                    continue
                try:
                    if len(acks.inflight) >= PUBLISH_WINDOW:
                        await acks.wait_below(PUBLISH_WINDOW)
                    acks.publish(message, self._properties(message))
                except ValueError as exc:
                    # paho refuses the message itself (e.g. a client's v5 response topic with a
                    # wildcard): it can never be sent, so it is dropped, not retried forever.
                    log.warning("mqtt_publish_refused", topic=message.topic[:200], error=str(exc))
                except BaseException:
                    self.outbox.put_front_nowait(message)
                    raise
            await acks.wait_below(1)
        finally:
            for message in reversed(acks.drain()):
                self.outbox.put_front_nowait(message)

    def _properties(self, message: OutMessage) -> Properties | None:
        if message.correlation_data is None or self.protocol is not aiomqtt.ProtocolVersion.V5:
            return None
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = message.correlation_data
        return props

    async def close(self, last: list[OutMessage], timeout_s: float = 5.0) -> None:
        """Flush the outbox, publish ``last`` (e.g. retained offline), then disconnect."""
        for message in last:
            self.publish(message)
        self._closing.set()
        try:
            async with asyncio.timeout(timeout_s):
                await self._closed.wait()
        except TimeoutError:
            log.warning("mqtt_flush_timeout", pending=len(self.outbox))
