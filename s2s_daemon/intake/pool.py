"""A pool daemon's drain: its queued pool requests go back to the pool instead of being cancelled.

Several daemons share ``<p>/pool/tts/say`` (``mqtt.shared_group``: ``$share/<group>/...``). When
one of them stops, it first leaves the group (UNSUBSCRIBE; the broker then sends new pool
requests to the others), then publishes each pool request it had queued but not started back
to the pool topic (QoS 1, the same id and fields, the ttl that remains, the requester's v5
response topic and correlation data): another member takes it and answers it. The daemon that
hands a request back publishes no terminal event for it. With the journal its entry is
finished only once the broker acknowledged the republish (PUBACK): a crash during the
hand-back leaves it open, and the next start serves it. Pool requests still arriving while it
drains (sent before the broker processed the UNSUBSCRIBE) are handed back too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import structlog

from s2s_daemon.intake.schemas import IntakeRules, parse_say
from s2s_daemon.mqtt.packets import InMessage, OutMessage
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.jobs import Ledger
from s2s_daemon.pipeline.journal import JournalError
from s2s_daemon.pipeline.messages import ErrorCode, SayRequest, Status
from s2s_daemon.pipeline.outbox import DurableRequests

log = structlog.get_logger(__name__)

POOL_ORIGIN = "pool"


def hand_back_payload(request: SayRequest, now: float | None = None) -> bytes:
    """The say payload that hands ``request`` back to the pool: its id and fields as this daemon
    validated them (voice and language in their canonical names), ``ttlMs`` what is left of its
    ttl (0 once it has run out: the taker answers it ``expired``)."""
    data: dict[str, Any] = {"id": request.id, "text": request.text}
    if request.voice is not None:
        data["voice"] = request.voice
    data["language"] = request.language
    if request.instruct is not None:
        data["instruct"] = request.instruct
    if request.session_id is not None:
        data["sessionId"] = request.session_id
    data["priority"] = request.priority
    data["interrupt"] = request.interrupt
    if request.ttl_ms is not None:
        elapsed_ms = ((time.monotonic() if now is None else now) - request.received_at) * 1000.0
        data["ttlMs"] = max(0, int(request.ttl_ms - elapsed_ms))
    data["volume"] = request.volume
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def hand_back_message(request: SayRequest, topics: Topics, now: float | None = None) -> OutMessage:
    """The QoS 1 publish to ``<p>/pool/tts/say`` that hands ``request`` back (``on_sent`` unset)."""
    reply = request.reply_to
    return OutMessage(
        topics.pool_say,
        hand_back_payload(request, now),
        qos=1,
        correlation_data=reply.correlation_data if reply is not None else None,
        response_topic=reply.topic if reply is not None else None,
    )


class PoolHandBack:
    """Hands the pool's requests back while the daemon drains.

    ``begin()`` takes the queued pool requests out of the queue and holds them; from then on a
    pool request that arrives is held too (``arrived``, called by the MQTT intake instead of
    submitting it). ``release()``, once the broker confirmed the UNSUBSCRIBE (or it timed out),
    publishes what is held; later arrivals are published at once.
    """

    def __init__(
        self,
        ledger: Ledger,
        rules: IntakeRules,
        topics: Topics,
        publish: Callable[[OutMessage], None],
        durable: DurableRequests | None = None,
    ) -> None:
        self.ledger = ledger
        self.rules = rules
        self.topics = topics
        self._publish = publish
        self.durable = durable
        self.active = False
        """The drain has begun: pool requests are handed back, not served."""
        self.handed_back = 0
        """Requests published back to the pool."""
        self.acknowledged = 0
        """Of those, how many the broker acknowledged."""
        self._held: list[tuple[SayRequest, int | None]] | None = None
        """Requests (and their journal seq) waiting for ``release``; None once released."""
        self._ids: set[str] = set()
        """Ids handed back: a redelivery of one is handed back again, not rejected as a duplicate."""

    def begin(self) -> int:
        """Take the queued, not yet started pool requests out of the queue (no terminal event); how many."""
        self.active = True
        self._held = []
        for job in self.ledger.hand_back(lambda r: r.origin == POOL_ORIGIN and r.feed is None):
            seq = self.durable.release(job) if self.durable is not None else None
            self._held.append((job.request, seq))
        return len(self._held)

    def release(self) -> int:
        """Publish what is held; later arrivals are published at once. How many were held."""
        held, self._held = self._held or [], None
        for request, seq in held:
            self._send(request, seq)
        return len(held)

    def arrived(self, message: InMessage) -> SayRequest:
        """A pool request that came while draining: handed back (or answered when it is invalid or a
        duplicate of one this daemon answered, as it would be when served)."""
        parsed = parse_say(
            message.payload, self.rules, origin=POOL_ORIGIN, reply_to=message.reply_to, received_at=message.received_at
        )
        request = parsed.request
        if parsed.error is not None:
            self.ledger.reject(request, parsed.error.code, parsed.error.message)
            return request
        if request.id not in self._ids and self.ledger.seen(request.id):
            self.ledger.reject(request, ErrorCode.DUPLICATE, f"request id {request.id!r} was already received")
            return request
        self.ledger.remember([request.id])
        seq = None
        if self.durable is not None:  # acknowledged once journaled, finished once republished
            wall = time.time() - (time.monotonic() - message.received_at)
            with contextlib.suppress(JournalError):  # logged by the journal; handed back regardless
                seq = self.durable.journal.admit(request, wall, lambda: None)
        if self._held is not None:
            self._held.append((request, seq))
        else:
            self._send(request, seq)
        return request

    def _send(self, request: SayRequest, seq: int | None) -> None:
        message = hand_back_message(request, self.topics)
        message = OutMessage(
            message.topic,
            message.payload,
            message.qos,
            correlation_data=message.correlation_data,
            response_topic=message.response_topic,
            on_sent=functools.partial(self._acknowledged, seq),
            on_refused=functools.partial(self._refused, request, seq),
        )
        self._ids.add(request.id)
        self.handed_back += 1
        log.debug("pool_request_handed_back", request_id=request.id)
        if self.durable is not None:  # after its admission is committed
            self.durable.journal.then(functools.partial(self._publish, message))
        else:
            self._publish(message)

    def _acknowledged(self, seq: int | None) -> None:
        self.acknowledged += 1
        if seq is not None and self.durable is not None:
            with contextlib.suppress(JournalError):  # closed already: the next start serves it (at least once)
                self.durable.journal.done(seq)

    def _refused(self, request: SayRequest, seq: int | None, reason: str) -> None:
        """The broker refused the hand-back (its ACL) or nobody is in the pool to take it (v5 "no
        matching subscribers"): with the journal its entry stays open and the next start serves it;
        without, it is answered ``cancelled`` here, as a daemon outside a pool would."""
        kept = seq is not None
        log.warning(
            "pool_hand_back_unheard",
            request_id=request.id,
            reason=reason,
            consequence="served at the next start (journal)" if kept else "answered cancelled",
        )
        if not kept:
            self.ledger.unserved(request, Status.CANCELLED)
