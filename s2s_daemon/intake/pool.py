"""A pool daemon's drain: its queued pool requests go back to the pool instead of being cancelled.

Several daemons share ``<p>/pool/tts/say`` (``mqtt.shared_group``: ``$share/<group>/...``). When
one of them stops, it first leaves the group (UNSUBSCRIBE; the broker then sends new pool
requests to the others), then publishes each pool request it had queued but not started back
to the pool topic (QoS 1, the same id and fields, the ttl that remains, the requester's v5
response topic and correlation data, and a ``handBack`` token): another member takes it and
answers it. The daemon that hands a request back publishes no terminal event for it.

The broker's PUBACK only says that someone matched the publish: a watcher on ``<p>/#`` is
enough, and it is no member. So the member that takes a handed-back request says so: once its
own journal has committed the request (or its answer), it publishes a receipt on
``<p>/pool/tts/taken`` (``{"id", "handBack", "siteId"}``). With the journal, the handing
member's entry is finished on that receipt only; one that no receipt names by the end of the
drain (``shutdown.drain_timeout_s``) stays open, and the next start serves it. Pool requests
still arriving while it drains (sent before the broker processed the UNSUBSCRIBE) are handed
back too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog

from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.schemas import decode_json_object, parse_say
from s2s_daemon.mqtt.packets import InMessage, OutMessage
from s2s_daemon.mqtt.topics import Topics
from s2s_daemon.pipeline.jobs import Ledger
from s2s_daemon.pipeline.journal import JournalError
from s2s_daemon.pipeline.messages import ErrorCode, SayRequest, Status
from s2s_daemon.pipeline.outbox import DurableRequests

log = structlog.get_logger(__name__)

POOL_ORIGIN = "pool"


def hand_back_payload(request: SayRequest, now: float | None = None, token: str | None = None) -> bytes:
    """The say payload that hands ``request`` back to the pool: its id and fields as this daemon
    validated them (voice and language in their canonical names), ``ttlMs`` what is left of its
    ttl (0 once it has run out: the taker answers it ``expired``), and ``handBack``: the token
    the taker's receipt names."""
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
    if token is not None:
        data["handBack"] = token
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def hand_back_message(
    request: SayRequest, topics: Topics, now: float | None = None, token: str | None = None
) -> OutMessage:
    """The QoS 1 publish to ``<p>/pool/tts/say`` that hands ``request`` back (``on_sent`` unset)."""
    reply = request.reply_to
    return OutMessage(
        topics.pool_say,
        hand_back_payload(request, now, token),
        qos=1,
        correlation_data=reply.correlation_data if reply is not None else None,
        response_topic=reply.topic if reply is not None else None,
    )


def hand_back_token(payload: bytes) -> tuple[str, str] | None:
    """``(id, token)`` of a pool request that another member handed back; None for any other."""
    data, _ = decode_json_object(payload)
    if data is None:
        return None
    token, rid = data.get("handBack"), data.get("id")
    if not isinstance(token, str) or not token or isinstance(rid, bool) or not isinstance(rid, str | int):
        return None
    return str(rid), token


def receipt_message(request_id: str, token: str, topics: Topics) -> OutMessage:
    """The taker's receipt on ``<p>/pool/tts/taken``: it has the handed-back request (QoS 1)."""
    data = {"id": request_id, "handBack": token, "siteId": topics.site_id}
    return OutMessage(topics.pool_taken, json.dumps(data, separators=(",", ":")).encode("utf-8"), qos=1)


class PoolHandBack:
    """Hands the pool's requests back while the daemon drains.

    ``begin()`` takes the queued pool requests out of the queue and holds them; from then on a
    pool request that arrives is held too (``arrived``, called by the MQTT intake instead of
    submitting it). ``release()``, once the broker confirmed the UNSUBSCRIBE (or it timed out),
    publishes what is held; later arrivals are published at once. ``taken()`` hears the receipts;
    ``wait_taken()`` waits for them (bounded), then says which no member took.

    Every member, draining or not, answers a handed-back request it receives with a receipt
    (``receipt``), once its journal committed it.
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
        """Of those, how many the broker acknowledged (someone matched them: not yet a member)."""
        self.taken_count = 0
        """Of those, how many a member took (its receipt came)."""
        self._waiting: dict[str, tuple[SayRequest, int | None]] = {}
        """Hand-backs by token whose receipt has not come (and whose journal seq stays open)."""
        self._all_taken = asyncio.Event()
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

    def receipt(self, message: InMessage) -> None:
        """A pool request came (to serve it or to hand it back again): when another member handed it
        back, say that this one has it, once what handling it wrote to the journal is committed."""
        found = hand_back_token(message.payload)
        if found is None:
            return
        out = receipt_message(found[0], found[1], self.topics)
        if self.durable is not None:
            self.durable.journal.then(functools.partial(self._publish, out))
        else:
            self._publish(out)

    def taken(self, payload: bytes) -> None:
        """A receipt on ``<p>/pool/tts/taken``: the hand-back it names is another member's now."""
        data, _ = decode_json_object(payload)
        token = data.get("handBack") if data is not None else None
        if not isinstance(token, str) or token not in self._waiting:
            return  # another member's hand-back, or a receipt that came twice
        request, seq = self._waiting.pop(token)
        self.taken_count += 1
        log.debug("pool_request_taken", request_id=request.id, by=data.get("siteId") if data else None)
        if seq is not None and self.durable is not None:
            with contextlib.suppress(JournalError):  # closed already: the next start serves it (at least once)
                self.durable.journal.done(seq)
        self._settled()

    async def wait_taken(self, timeout_s: float) -> list[str]:
        """Wait (at most ``timeout_s``) until every hand-back is taken; the ids of those still
        untaken. Those in the journal stay open (the next start serves them; a receipt that still
        comes before the link closes finishes them); the others are answered ``cancelled``, as a
        daemon outside a pool would."""
        if self._waiting and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._all_taken.wait()
        untaken = list(self._waiting.items())
        kept = [request.id for _, (request, seq) in untaken if seq is not None]
        answered = [request.id for _, (request, seq) in untaken if seq is None]
        if untaken:
            log.warning("pool_hand_back_untaken", kept=kept, cancelled=answered, timeout_s=timeout_s)
        for token, (request, seq) in untaken:
            if seq is None:  # nothing keeps it for a next start: its requester hears of it now
                del self._waiting[token]
                self.ledger.unserved(request, Status.CANCELLED)
        return [request.id for _, (request, _) in untaken]

    def _settled(self) -> None:
        if not self._waiting:
            self._all_taken.set()

    def _send(self, request: SayRequest, seq: int | None) -> None:
        token = uuid.uuid4().hex
        message = hand_back_message(request, self.topics, token=token)
        message = OutMessage(
            message.topic,
            message.payload,
            message.qos,
            correlation_data=message.correlation_data,
            response_topic=message.response_topic,
            on_sent=self._acknowledged,
            on_refused=functools.partial(self._refused, request, token),
        )
        self._waiting[token] = (request, seq)
        self._all_taken.clear()
        self._ids.add(request.id)
        self.handed_back += 1
        log.debug("pool_request_handed_back", request_id=request.id)
        if self.durable is not None:  # after its admission is committed
            self.durable.journal.then(functools.partial(self._publish, message))
        else:
            self._publish(message)

    def _acknowledged(self) -> None:
        self.acknowledged += 1

    def _refused(self, request: SayRequest, token: str, reason: str) -> None:
        """The broker refused the hand-back (its ACL) or nobody is in the pool to take it (v5 "no
        matching subscribers"): with the journal its entry stays open and the next start serves it;
        without, it is answered ``cancelled`` here, as a daemon outside a pool would."""
        held = self._waiting.pop(token, None)
        if held is None:
            return  # taken already
        self._settled()
        kept = held[1] is not None
        log.warning(
            "pool_hand_back_unheard",
            request_id=request.id,
            reason=reason,
            consequence="served at the next start (journal)" if kept else "answered cancelled",
        )
        if not kept:
            self.ledger.unserved(request, Status.CANCELLED)
