"""An in-process MQTT broker (amqtt) bound to loopback, for a first run without mosquitto.

amqtt speaks MQTT 3.1.1 only: the link falls back to 3.1.1 and v5 features (response
topic, correlation data, session expiry) are unavailable. Production uses an external
broker.

amqtt 0.12 sends every connecting client the retained messages of *every* subscription
held in the broker, not only its own (a publisher that never subscribed receives
``status``/``info``/``state``, and a second subscriber to ``s2s/#`` gets them twice). Worse,
a client such as ``mosquitto_pub -m`` sends PUBLISH and DISCONNECT and closes at once;
writing those unsolicited messages to its closed socket draws a TCP reset, and the reset
discards the PUBLISH still unread in the broker's receive buffer: the request is lost
without a trace. ``_LoopbackBroker`` sends retained messages only for a subscription the
client has just made, as MQTT 3.1.1 says ([MQTT-3.3.1-6]). It also keeps back a retained message
still waiting in amqtt's broadcast queue: amqtt keeps a message when it arrives and sends it to the
subscriptions of the moment it leaves that queue, so a client that subscribed in between got it twice
(a subscriber joining as the daemon connects saw ``status`` ``online`` twice).

amqtt also reads a packet of any declared length (up to MQTT's 256 MB) whole, and keeps every
retained message in the daemon's memory. ``_LoopbackBroker`` closes a connection that announces a
packet over ``MAX_PACKET_BYTES`` before reading it, and keeps at most ``MAX_RETAINED`` retained
topics of ``MAX_RETAINED_BYTES`` together (a retained message past them is delivered, not kept).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

import structlog

from s2s_daemon.errors import UnavailableError
from s2s_daemon.holders import describe, port_holder

log = structlog.get_logger(__name__)

_subscribing: contextvars.ContextVar[object | None] = contextvars.ContextVar("s2s_subscribing", default=None)
"""The session whose SUBSCRIBE is being handled in this connection's task, if any."""


MAX_PACKET_BYTES = 4 * 1024 * 1024 + 64 * 1024
"""The largest packet read: the largest request payload the intake takes (``intake.schemas.MAX_PAYLOAD_BYTES``),
its topic and headers."""
MAX_RETAINED = 1000
"""Retained topics kept (the daemon's own: its status, info and state, Home Assistant's discovery)."""
MAX_RETAINED_BYTES = 16 * 1024 * 1024
"""Retained payloads kept, together."""

_HOOKS = (
    "_handle_subscription",
    "_publish_retained_messages_for_subscription",
    "_get_handler",
    "_matches",
    "retain_message",
    "stream_connected",
    "_client_connected",
)
"""amqtt's internals that ``_LoopbackBroker`` overrides or calls (pyproject pins the releases that have them)."""


def _broker_class() -> type[Any]:
    from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
    from amqtt.broker import Broker

    class _BoundedReader(StreamReaderAdapter):  # type: ignore[misc]
        """Refuses a read longer than ``MAX_PACKET_BYTES`` (a packet's rest is read in one call) and
        every read after it: the connection is closed, and amqtt sees the end of its stream."""

        def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            super().__init__(reader)
            self._writer = writer
            self._refused = False

        async def read(self, n: int = -1) -> bytes:
            if n > MAX_PACKET_BYTES and not self._refused:
                self._refused = True
                peer = self._writer.get_extra_info("peername")
                log.warning("embedded_broker_packet_refused", bytes=n, limit=MAX_PACKET_BYTES, peer=str(peer))
                self._writer.transport.abort()
            if self._refused:
                raise asyncio.IncompleteReadError(b"", n if n > 0 else None)
            return bytes(await super().read(n))

    missing = [name for name in _HOOKS if not hasattr(Broker, name)]
    if missing:
        log.warning("embedded_broker_unpatched", missing=missing, effect="retained messages go to every client")

    class _LoopbackBroker(Broker):  # type: ignore[misc]
        async def _handle_subscription(self, client_session: Any, handler: Any, subscribe_waiter: Any) -> None:
            token = _subscribing.set(client_session)
            try:
                await super()._handle_subscription(client_session, handler, subscribe_waiter)
            finally:
                _subscribing.reset(token)

        async def _publish_retained_messages_for_subscription(self, subscription: Any, session: Any) -> None:
            # Called on SUBSCRIBE (send) and, for every filter in the broker, on each CONNECT (skip).
            if _subscribing.get() is not session:
                return
            handler = self._get_handler(session)
            if handler is None:
                return
            # A message is kept when it arrives but goes out later, from the broadcast queue, to the
            # subscriptions of that moment: one still queued reaches this new subscription from there.
            waiting = getattr(getattr(self, "_broadcast_queue", None), "_queue", ())
            queued = {(b["topic"], id(b["data"])) for b in waiting}
            topic_filter, qos = subscription
            sends = [
                handler.mqtt_publish(kept.topic, kept.data, min(qos, kept.qos or qos), retain=True)
                for topic, kept in list(self._retained_messages.items())
                if self._matches(topic, topic_filter) and (topic, id(kept.data)) not in queued
            ]
            if sends:
                await asyncio.wait([asyncio.ensure_future(send) for send in sends])

        async def stream_connected(
            self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener_name: str
        ) -> None:
            await self._client_connected(listener_name, _BoundedReader(reader, writer), StreamWriterAdapter(writer))

        async def retain_message(self, source_session: Any, topic_name: Any, data: Any, qos: Any = None) -> None:
            if data and topic_name is not None:
                kept: dict[str, Any] = self._retained_messages
                old = kept.get(topic_name)
                held = sum(len(m.data) for m in kept.values()) - (len(old.data) if old is not None else 0)
                if held + len(data) > MAX_RETAINED_BYTES or (old is None and len(kept) >= MAX_RETAINED):
                    log.warning(
                        "embedded_broker_retained_refused",
                        topic=topic_name,
                        bytes=len(data),
                        topics=len(kept),
                        limit_topics=MAX_RETAINED,
                        limit_bytes=MAX_RETAINED_BYTES,
                    )
                    return
            await super().retain_message(source_session, topic_name, data, qos)

    return _LoopbackBroker


class _PortProbes(logging.Filter):
    """amqtt logs an error and a warning for every TCP connection that closes without an MQTT packet:
    a port probe (a health check, ``nc -z``, a client's reachability test), not a failure."""

    PROBE = "No data to decode MQTT packet fixed header"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.PROBE not in record.getMessage()


class EmbeddedBroker:
    def __init__(self, port: int) -> None:
        self.port = port
        self._broker: Any = None

    async def start(self) -> None:
        try:
            broker_class = _broker_class()
        except ImportError as exc:
            raise UnavailableError(f"mqtt.broker 'embedded' needs the amqtt package: {exc}") from exc
        # amqtt logs every packet at INFO; keep it to warnings, and port probes out.
        logging.getLogger("amqtt").setLevel(logging.WARNING)
        broker_log = logging.getLogger("amqtt.broker")
        if not any(isinstance(f, _PortProbes) for f in broker_log.filters):
            broker_log.addFilter(_PortProbes())
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        broker = broker_class(config)
        quiet = logging.getLogger("amqtt.broker")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # its traceback of a failed start: ours below says it in one line
        try:
            await broker.start()
        except Exception as exc:  # amqtt wraps bind failures in its own BrokerError
            cause = exc.__cause__ or exc
            why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(exc)
            holder = port_holder(self.port)
            by = f" (held by {describe(holder)})" if holder is not None else ""
            raise UnavailableError(
                f"mqtt.port: the embedded broker cannot listen on 127.0.0.1:{self.port}: {why}{by};"
                " stop it, or set mqtt.port"
            ) from exc
        finally:
            quiet.setLevel(level)
        self._broker = broker
        log.info("embedded_broker_started", host="127.0.0.1", port=self.port, protocol="3.1.1")

    async def stop(self) -> None:
        if self._broker is not None:
            await self._broker.shutdown()
            self._broker = None
