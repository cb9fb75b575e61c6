"""Packets the MQTT link sends and receives (``OutMessage``, ``InMessage``), and the acknowledgement a
received one owes the broker (``Receipt``). Not the pipeline's typed messages (``pipeline/messages.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Self

from s2s_daemon.pipeline.journal import Unsent
from s2s_daemon.pipeline.messages import ReplyTo


@dataclass(frozen=True, slots=True)
class OutMessage:
    topic: str
    payload: bytes
    qos: int
    retain: bool = False
    correlation_data: bytes | None = None
    """MQTT v5 Correlation Data echoed on a response topic."""
    response_topic: str | None = None
    """MQTT v5 Response Topic (a pool request handed back keeps its requester's)."""
    on_sent: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    """Called once the broker acknowledged it (QoS 1/2), paho took it (QoS 0) or paho refused it
    for good; not when the link's send queue dropped it (overflow) or the link closed with it unsent."""
    on_refused: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    """Called with the reason instead of ``on_sent`` when the broker acknowledged it with a failure
    (MQTT v5: not authorized) or with "no matching subscribers" (nobody got it); None: ``on_sent``
    is called then too (it is settled either way)."""

    def once_sent(self, on_sent: Callable[[], None]) -> Self:
        """The same message, calling ``on_sent`` once the broker acknowledged it."""
        return replace(self, on_sent=on_sent)

    @classmethod
    def restore(cls, stored: Unsent) -> OutMessage:
        """A terminal message the journal kept (``outbox``), to publish again after a restart."""
        return cls(stored.topic, stored.payload, stored.qos, correlation_data=stored.correlation_data)


class Publisher:
    """The link's ``publish`` for the parts built before the link (the events, the outbox, the pool
    hand-back): bound once, when the link exists; nothing publishes before that."""

    def __init__(self) -> None:
        self._publish: Callable[[OutMessage], None] | None = None

    def bind(self, publish: Callable[[OutMessage], None]) -> None:
        if self._publish is not None:
            raise RuntimeError("the publisher is bound already")
        self._publish = publish

    def __call__(self, message: OutMessage) -> None:
        if self._publish is None:
            raise RuntimeError("published before the link exists")
        self._publish(message)


class Receipt:
    """The PUBACK a received QoS 1 message owes the broker, released by ``ack()`` (once).

    Releasing does not send at once: the link sends acknowledgements in the order the
    PUBLISHes came, so a receipt acknowledged early waits for the ones before it.
    """

    __slots__ = ("_release", "acked", "mid", "qos")

    def __init__(self, mid: int, qos: int, release: Callable[[], None]) -> None:
        self.mid = mid
        """The packet identifier of the PUBLISH on the connection it came over."""
        self.qos = qos
        self.acked = False
        self._release = release

    def ack(self) -> None:
        if not self.acked:
            self.acked = True
            self._release()


@dataclass(frozen=True, slots=True)
class InMessage:
    topic: str
    payload: bytes
    reply_to: ReplyTo | None
    received_at: float
    """Monotonic seconds when the message came off the socket."""
    receipt: Receipt | None = None
    """The acknowledgement still owed for a QoS 1 message; None for QoS 0."""
    redelivered: bool = False
    """The broker's DUP flag: it may have sent this message before (a reconnect, a resumed session)."""
    retained: bool = False
    """The broker's RETAIN flag: a message kept from before our subscription, not one sent now."""

    def ack(self) -> None:
        """Let the broker forget this message (a PUBACK, in arrival order); idempotent.

        Until then a persistent session redelivers it after a reconnect. A no-op for QoS 0
        and for a message whose connection has ended (the broker will redeliver it). Call it
        on the event loop's thread.
        """
        if self.receipt is not None:
            self.receipt.ack()
