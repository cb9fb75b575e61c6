"""One broker connection on paho-mqtt 2.x, driven by the asyncio event loop.

paho's documented external-loop API (``examples/loop_asyncio.py`` in paho): the socket is
registered with ``loop.add_reader`` (``loop_read``) and, while paho has bytes to send,
``loop.add_writer`` (``loop_write``; paho asks through ``on_socket_register_write`` and
``on_socket_unregister_write``); ``loop_misc`` runs once a second for the keepalive. Every
paho callback then runs on the event loop thread, inside one of those calls.

Only the opening is blocking in paho (``connect``: name lookup, TCP connect and the TLS
handshake, each bounded by ``connect_timeout``), so it runs in a worker thread before the
socket is handed to the loop: the socket callbacks are installed only afterwards, and
until then nothing but that thread touches the client.

Acknowledgements of received messages are ours (``manual_ack=True``): paho sends a
PUBACK only when ``ack()`` is called.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import structlog
from paho.mqtt import client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from s2s_daemon.config import MqttConfig, TlsConfig
from s2s_daemon.errors import ConfigError
from s2s_daemon.mqtt.packets import OutMessage

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT_S = 10.0
"""TCP connect, TLS handshake, then the CONNACK: each may take this long."""
NO_MATCHING_SUBSCRIBERS = 0x10
"""The v5 PUBACK reason code of a publish that the broker accepted but nobody subscribed to."""
MISC_INTERVAL_S = 1.0
"""How often paho's ``loop_misc`` checks the keepalive (PINGREQ, a missing PINGRESP)."""


class MqttProtocol(enum.Enum):
    V311 = "3.1.1"
    V5 = "5"


_PAHO_PROTOCOL = {MqttProtocol.V311: MQTTProtocolVersion.MQTTv311, MqttProtocol.V5: MQTTProtocolVersion.MQTTv5}


class MqttError(Exception):
    """The broker connection failed or ended; transient (the link reconnects)."""


class MqttConnectError(MqttError):
    """No session came up: the broker is unreachable, the TLS handshake failed, or the CONNACK refused."""

    def __init__(self, reason: str, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused
        """The broker answered the CONNECT with a refusal (bad credentials, unsupported protocol)."""


class MqttConnectionLost(MqttError):
    """An established connection ended without our asking (socket closed, keepalive, ack timeout)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    host: str
    port: int
    client_id: str
    protocol: MqttProtocol
    keepalive_s: int = 60
    persistent: bool = False
    """Keep the session (subscriptions, queued QoS 1 messages) across connections:
    ``clean_start=False`` on v5, ``clean_session=False`` on 3.1.1."""
    session_expiry_s: int = 0
    """MQTT v5: how long the broker keeps a persistent session after a disconnect."""
    username: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None
    will: OutMessage | None = None


def _encrypted_key() -> bytes:
    """The password callback of ``load_cert_chain``: without it OpenSSL would prompt on the terminal."""
    raise ValueError("the key is encrypted; the daemon needs an unencrypted key file (openssl pkey -in KEY -out NEW)")


def _check_readable(key: str, path: Path | None) -> None:
    if path is None:
        return
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from exc


def tls_context(tls: TlsConfig | None) -> ssl.SSLContext | None:
    """The client TLS context for ``mqtt.tls`` (read once at startup); a bad file is a ConfigError
    (exit 78) naming the key and the file."""
    if tls is None:
        return None
    if tls.key_file is not None and tls.cert_file is None:
        raise ConfigError(
            f"mqtt.tls.key_file: {tls.key_file} is set without mqtt.tls.cert_file (the client certificate)"
        )
    _check_readable("mqtt.tls.ca_file", tls.ca_file)
    _check_readable("mqtt.tls.cert_file", tls.cert_file)
    _check_readable("mqtt.tls.key_file", tls.key_file)
    try:
        context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"mqtt.tls.ca_file: {tls.ca_file}: not a PEM certificate bundle ({exc})") from exc
    if tls.cert_file is not None:
        try:
            context.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None, _encrypted_key)
        except (OSError, ssl.SSLError, ValueError) as exc:
            where = f"mqtt.tls.cert_file {tls.cert_file}" + (
                f", mqtt.tls.key_file {tls.key_file}" if tls.key_file else ""
            )
            raise ConfigError(
                f"{where}: not a usable PEM certificate and private key that belong together ({exc})"
            ) from exc
    if tls.insecure:
        context.check_hostname = False  # paho then skips its own host name check too
    return context


def read_password(config: MqttConfig) -> str | None:
    if config.password_file is None:
        return None
    try:
        return config.password_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"mqtt.password_file: cannot read {config.password_file}: {exc}") from exc


class _TrackingContext:
    """The TLS context as paho sees it for one connection attempt: remembers the sockets it wraps.

    When the handshake (or paho's host name check) fails inside ``connect()``, paho drops
    the wrapped socket without closing it; this lets the attempt close it. Everything
    else is the real context's.
    """

    def __init__(self, context: ssl.SSLContext) -> None:
        self._context = context
        self.wrapped: list[ssl.SSLSocket] = []

    def wrap_socket(self, sock: socket.socket, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        wrapped = self._context.wrap_socket(sock, *args, **kwargs)
        self.wrapped.append(wrapped)
        return wrapped

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


# TLS 1.3: the broker checks the client certificate after the handshake and hangs up, either
# while CONNECT is written or just after it, before a CONNACK.
_TLS_HANG_UP_HINT = (
    " (the broker closed the TLS connection at once: it may require a client certificate,"
    " mqtt.tls.cert_file, or refuse this one)"
)


def _reason(code: ReasonCode | MQTTErrorCode | int) -> str:
    if isinstance(code, ReasonCode):
        return str(code)
    return paho.error_string(code)


class PahoConnection:
    """One paho client and one connection: ``open()``, then ``run()`` until it ends.

    The owner is called back on the event loop: ``on_message`` for every PUBLISH read,
    ``on_published`` with the packet id of every acknowledged QoS 1/2 publish, and
    ``on_session`` with the CONNACK's session-present flag before any message of that
    session is read, and ``on_refused`` with the packet id, the topic, the reason and its code of
    every publish the broker acknowledged with a failure (MQTT v5: not authorized, quota) or with
    "no matching subscribers" (0x10: nobody got it), just before its ``on_published``. The
    constructor does no I/O; a connection is never reused.
    """

    def __init__(
        self,
        options: ConnectOptions,
        on_message: Callable[[paho.MQTTMessage], None],
        on_published: Callable[[int], None],
        on_session: Callable[[bool], None] = lambda present: None,
        on_refused: Callable[[int, str, str, int], None] | None = None,
    ) -> None:
        self.options = options
        self._on_message = on_message
        self._on_published = on_published
        self._on_session = on_session
        self._on_refused = on_refused
        self._client: paho.Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        """The socket registered with the event loop; -1 once it is closed."""
        self._reading = False
        self._closing = False
        self._connack: asyncio.Future[str | None] | None = None
        """None once the session is up, else why it is not."""
        self._ended: asyncio.Future[str] | None = None
        """Why the connection ended."""
        self._session_present = False
        self._tls: _TrackingContext | None = None
        self._subscribes: dict[int, tuple[list[str], asyncio.Future[list[tuple[str, str]] | None]]] = {}
        """SUBSCRIBEs awaiting their SUBACK: the topics, and the refused ones with the reason (None: the
        connection ended)."""
        self._unsubscribes: dict[int, asyncio.Future[bool]] = {}
        """UNSUBSCRIBEs awaiting their UNSUBACK (False: the connection ended first)."""
        self._topics: dict[int, str] = {}
        """The topic of each QoS 1/2 publish awaiting its acknowledgement (to name a refused one)."""

    # -- opening -----------------------------------------------------------------------

    def _make_client(self) -> paho.Client:
        o = self.options
        v5 = o.protocol is MqttProtocol.V5
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=o.client_id,
            clean_session=None if v5 else not o.persistent,
            protocol=_PAHO_PROTOCOL[o.protocol],
            reconnect_on_failure=False,  # paho would retry (3.1, a random id) blocking, inside loop_read
            manual_ack=True,
        )
        client.connect_timeout = CONNECT_TIMEOUT_S
        if o.username is not None:
            client.username_pw_set(o.username, o.password)
        if o.tls is not None:
            self._tls = _TrackingContext(o.tls)
            client.tls_set_context(cast(ssl.SSLContext, self._tls))
        if o.will is not None:
            client.will_set(o.will.topic, o.will.payload, o.will.qos, o.will.retain)
        client.on_connect = self._connected
        client.on_disconnect = self._disconnected
        client.on_message = self._received
        client.on_publish = self._published
        client.on_subscribe = self._subscribed
        client.on_unsubscribe = self._unsubscribed
        # Small packets both ways: without TCP_NODELAY, Nagle and delayed ACKs cost ~40 ms.
        # Called in the connecting thread, before the CONNECT is written.
        client.on_socket_open = _no_delay
        return client

    def _connect_blocking(self, client: paho.Client) -> None:
        o = self.options
        try:
            if o.protocol is MqttProtocol.V5:
                props = Properties(PacketTypes.CONNECT)
                if o.persistent:
                    props.SessionExpiryInterval = o.session_expiry_s
                rc = client.connect(o.host, o.port, o.keepalive_s, clean_start=not o.persistent, properties=props)
            else:
                rc = client.connect(o.host, o.port, o.keepalive_s)
        except BaseException:
            for wrapped in self._tls.wrapped if self._tls is not None else ():
                wrapped.close()
            raise
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            hint = ""
            if o.tls is not None and rc == MQTTErrorCode.MQTT_ERR_CONN_LOST:
                hint = _TLS_HANG_UP_HINT
            raise MqttConnectError(f"cannot send CONNECT: {_reason(rc)}{hint}")

    async def open(self, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
        """Connect and wait for the CONNACK; the session-present flag. Raises MqttConnectError."""
        loop = self._loop = asyncio.get_running_loop()
        self._connack = loop.create_future()
        self._ended = loop.create_future()
        client = self._client = self._make_client()
        opening = loop.run_in_executor(None, self._connect_blocking, client)
        try:
            await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(lambda done: self._abandoned(done, client))
            raise
        except MqttConnectError:
            self._discard(client)
            raise
        except (OSError, ValueError) as exc:  # lookup, refused, timeout, TLS (ssl errors are both)
            self._discard(client)
            raise MqttConnectError(f"{self.options.host}:{self.options.port}: {exc or type(exc).__name__}") from exc
        self._attach(client)
        try:
            async with asyncio.timeout(timeout_s):
                refusal = await self._connack
        except TimeoutError:
            self.abort()
            raise MqttConnectError(f"no CONNACK within {timeout_s:.0f} s") from None
        except BaseException:
            self.abort()
            raise
        if refusal is not None:
            self.abort()
            raise MqttConnectError(refusal, refused=True)
        return self._session_present

    def _attach(self, client: paho.Client) -> None:
        """Hand the connected socket to the event loop (on the loop thread)."""
        sock = client.socket()
        assert sock is not None, "paho returned from connect() without a socket"
        self._fd = sock.fileno()
        client.on_socket_close = self._socket_closed
        client.on_socket_register_write = self._want_write
        client.on_socket_unregister_write = self._written
        self.resume_reading()
        if client.want_write():  # the CONNECT did not fit in the send buffer at once
            self._loop_().add_writer(self._fd, self._writable)

    def _abandoned(self, opening: asyncio.Future[None], client: paho.Client) -> None:
        """The connecting thread finished after open() was cancelled: close what it opened."""
        if not opening.cancelled() and opening.exception() is None:
            log.debug("mqtt_connect_abandoned", host=self.options.host)
        self._discard(client)

    @staticmethod
    def _discard(client: paho.Client) -> None:
        """Close the socket of a connection that never reached the event loop."""
        sock = client.socket()
        if sock is not None:
            sock.close()

    # -- the event loop's side -----------------------------------------------------------

    def _loop_(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "open() first"
        return self._loop

    def _paho(self) -> paho.Client:
        assert self._client is not None, "open() first"
        return self._client

    def _readable(self) -> None:
        if self._fd < 0:
            return
        client = self._paho()
        rc = client.loop_read()
        # TLS: records already decrypted into the SSL object are invisible to the selector.
        sock = client.socket()
        while rc == MQTTErrorCode.MQTT_ERR_SUCCESS and self._reading and isinstance(sock, ssl.SSLSocket):
            if not sock.pending():
                break
            rc = client.loop_read()
            sock = client.socket()

    def _writable(self) -> None:
        self._paho().loop_write()

    def _want_write(self, _client: paho.Client, _userdata: Any, _sock: Any) -> None:
        if self._fd >= 0:
            self._loop_().add_writer(self._fd, self._writable)

    def _written(self, _client: paho.Client, _userdata: Any, _sock: Any) -> None:
        if self._fd >= 0:
            self._loop_().remove_writer(self._fd)

    def _socket_closed(self, _client: paho.Client, _userdata: Any, _sock: Any) -> None:
        self._unregister()

    def _unregister(self) -> None:
        if self._fd >= 0:
            loop = self._loop_()
            loop.remove_reader(self._fd)
            loop.remove_writer(self._fd)
            self._fd = -1
        self._reading = False

    def pause_reading(self) -> None:
        """Stop reading the socket (back-pressure): the broker's sends wait in TCP buffers."""
        if self._reading and self._fd >= 0:
            self._loop_().remove_reader(self._fd)
        self._reading = False

    def resume_reading(self) -> None:
        if self._reading or self._fd < 0:
            return
        self._reading = True
        loop = self._loop_()
        loop.add_reader(self._fd, self._readable)
        sock = self._paho().socket()
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            loop.call_soon(self._readable)

    @property
    def reading(self) -> bool:
        return self._reading

    # -- paho's callbacks (on the loop, inside loop_read/loop_write/loop_misc) ----------

    def _connected(
        self, _client: paho.Client, _userdata: Any, flags: paho.ConnectFlags, reason: ReasonCode, _props: Any
    ) -> None:
        if self._connack is None or self._connack.done():
            return
        if reason.is_failure:
            self._connack.set_result(f"the broker refused the connection: {reason}")
            return
        self._session_present = bool(flags.session_present)
        self._on_session(self._session_present)
        self._connack.set_result(None)

    def _disconnected(
        self, _client: paho.Client, _userdata: Any, _flags: paho.DisconnectFlags, reason: ReasonCode, _props: Any
    ) -> None:
        hint = ""
        if self.options.tls is not None and self._connack is not None and not self._connack.done():
            hint = _TLS_HANG_UP_HINT  # the hang-up came after our CONNECT was written, before any CONNACK
        self._end(f"disconnected: {reason}{hint}")

    def _end(self, why: str) -> None:
        self._unregister()
        if self._connack is not None and not self._connack.done():
            self._connack.set_result(why)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(why)
        for _, waiter in self._subscribes.values():
            if not waiter.done():
                waiter.set_result(None)
        self._subscribes.clear()
        for unsubscribed in self._unsubscribes.values():
            if not unsubscribed.done():
                unsubscribed.set_result(False)
        self._unsubscribes.clear()

    def _received(self, _client: paho.Client, _userdata: Any, message: paho.MQTTMessage) -> None:
        self._on_message(message)

    def _published(self, _client: paho.Client, _userdata: Any, mid: int, reason: ReasonCode, _props: Any) -> None:
        topic = self._topics.pop(mid, "?")
        if reason.is_failure or reason.value == NO_MATCHING_SUBSCRIBERS:
            # A v5 broker may refuse a publish (not authorized, quota): it is settled, not retried.
            if self._on_refused is not None:
                self._on_refused(mid, topic, str(reason), reason.value)
            elif reason.is_failure:
                log.warning("mqtt_publish_refused_by_broker", topic=topic, reason=str(reason))
        self._on_published(mid)

    def _subscribed(
        self, _client: paho.Client, _userdata: Any, mid: int, reasons: list[ReasonCode], _props: Any
    ) -> None:
        entry = self._subscribes.pop(mid, None)
        if entry is None:
            return
        topics, waiter = entry
        if not waiter.done():
            refused = [(topic, str(r)) for topic, r in zip(topics, reasons, strict=False) if r.is_failure]
            if len(reasons) < len(topics):  # a SUBACK that does not answer every topic refused the rest
                refused += [(topic, "no reason code in the SUBACK") for topic in topics[len(reasons) :]]
            waiter.set_result(refused)

    def _unsubscribed(
        self, _client: paho.Client, _userdata: Any, mid: int, _reasons: list[ReasonCode], _props: Any
    ) -> None:
        waiter = self._unsubscribes.pop(mid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(True)  # a v5 "no subscription existed" is as good: we are not subscribed

    # -- what the owner does -------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._ended is not None and not self._ended.done()

    def publish(self, message: OutMessage, properties: Properties | None = None) -> int | None:
        """Hand a message to paho; the packet id whose acknowledgement is awaited, None for QoS 0.

        Raises ValueError for a message paho refuses (a wildcard topic), MqttConnectionLost
        once the connection has ended.
        """
        if not self.is_open:
            raise MqttConnectionLost("not connected")
        info = self._paho().publish(message.topic, message.payload, message.qos, message.retain, properties)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise MqttConnectionLost(f"cannot publish: {_reason(info.rc)}")
        if message.qos == 0:
            return None
        self._topics[info.mid] = message.topic
        return info.mid

    def ack(self, mid: int, qos: int) -> None:
        """Send the PUBACK (QoS 1) or PUBCOMP (QoS 2) for a received message; nothing once ended."""
        if self.is_open:
            self._paho().ack(mid, qos)

    async def subscribe(self, topics: Sequence[tuple[str, int]], timeout_s: float) -> list[tuple[str, str]]:
        """Subscribe in one SUBSCRIBE and wait for the SUBACK; the topics the broker refused, each
        with the reason (MQTT v5 ``Not authorized`` for an ACL's refusal; 3.1.1 ``Unspecified error``)."""
        if not topics:
            return []
        rc, mid = self._paho().subscribe(list(topics))
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise MqttConnectionLost(f"cannot subscribe: {_reason(rc)}")
        waiter: asyncio.Future[list[tuple[str, str]] | None] = self._loop_().create_future()
        self._subscribes[mid] = ([topic for topic, _ in topics], waiter)
        try:
            async with asyncio.timeout(timeout_s):
                refused = await waiter
        except TimeoutError:
            raise MqttConnectionLost(f"no SUBACK within {timeout_s:.0f} s") from None
        finally:
            self._subscribes.pop(mid, None)
        if refused is None:
            raise MqttConnectionLost(self._why())
        return refused

    async def unsubscribe(self, topics: Sequence[str], timeout_s: float) -> bool:
        """Unsubscribe in one UNSUBSCRIBE and wait for the UNSUBACK (at most ``timeout_s``): True once
        the broker confirmed it, False when it did not within the time or the connection ended."""
        if not self.is_open:
            return False
        rc, mid = self._paho().unsubscribe(list(topics))
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            return False
        waiter: asyncio.Future[bool] = self._loop_().create_future()
        self._unsubscribes[mid] = waiter
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            return False
        finally:
            self._unsubscribes.pop(mid, None)

    def _why(self) -> str:
        ended = self._ended
        return ended.result() if ended is not None and ended.done() else "connection lost"

    async def run(self) -> None:
        """Keep the connection alive until it ends; raises MqttConnectionLost unless ``close()`` ended it."""
        ended = self._ended
        assert ended is not None, "open() first"
        client = self._paho()
        while not ended.done():
            await asyncio.wait({ended}, timeout=MISC_INTERVAL_S)
            if not ended.done():
                client.loop_misc()  # may end the connection (no PINGRESP): on_disconnect
        if not self._closing:
            raise MqttConnectionLost(ended.result())

    async def close(self, timeout_s: float) -> None:
        """Send DISCONNECT (the broker then drops our Will) and wait until the socket is closed."""
        ended = self._ended
        if ended is None or ended.done():
            return
        self._closing = True
        self._paho().disconnect()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(ended)
        except TimeoutError:
            self.abort()

    def abort(self) -> None:
        """Close the socket at once, without DISCONNECT (the broker publishes our Will)."""
        if self._client is None:
            return
        self._unregister()
        sock = self._client.socket()
        if sock is not None:
            sock.close()
        self._end("closed")


def _no_delay(_client: paho.Client, _userdata: Any, sock: Any) -> None:
    if isinstance(sock, socket.socket):  # ssl.SSLSocket is one too
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def publish_all(options: ConnectOptions, messages: Sequence[OutMessage], close_timeout_s: float = 2.0) -> None:
    """Connect, publish ``messages``, wait until the broker acknowledged every one, disconnect.

    For one-shot commands (``s2s-daemon ha remove``); the caller bounds the whole with a
    timeout. Raises MqttError when the broker cannot be reached or the connection drops.
    """
    pending: set[int] = set()
    settled = asyncio.Event()

    def published(mid: int) -> None:
        pending.discard(mid)
        if not pending:
            settled.set()

    connection = PahoConnection(options, on_message=lambda message: None, on_published=published)
    await connection.open()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(connection.run(), name="s2s.mqtt.keepalive")
            for message in messages:
                mid = connection.publish(message)
                if mid is not None:
                    pending.add(mid)
            if pending:
                await settled.wait()
            await connection.close(close_timeout_s)
    except* MqttError as group:
        raise group.exceptions[0] from None
    finally:
        connection.abort()
