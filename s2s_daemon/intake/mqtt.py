"""Routes incoming MQTT messages: say, stream, stop, pool, Hermes. Never raises on bad input.

With the journal, every message is acknowledged (PUBACK) only once the loop turn's journal
writes are committed: an accepted request is on disk before the broker forgets it, and its
terminal event is journaled and published once committed (``pipeline/outbox.py``), then
forgotten once the broker acknowledged it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.pool import POOL_ORIGIN, PoolHandBack
from s2s_daemon.intake.schemas import StopPayload, decode_json_object, parse_say
from s2s_daemon.intake.streams import StreamIntake
from s2s_daemon.mqtt.packets import InMessage
from s2s_daemon.mqtt.topics import HERMES_SAY, Topics
from s2s_daemon.pipeline.jobs import Job, Ledger, Phase
from s2s_daemon.pipeline.messages import SayRequest
from s2s_daemon.pipeline.outbox import DurableRequests

log = structlog.get_logger(__name__)

HERMES_DEFAULT_SITE = "default"


class MqttIntake:
    def __init__(
        self,
        ledger: Ledger,
        rules: IntakeRules,
        topics: Topics,
        hermes: bool,
        ha_birth: tuple[str, Callable[[bytes], None]] | None = None,
        durable: DurableRequests | None = None,
        pool: PoolHandBack | None = None,
    ) -> None:
        self.ledger = ledger
        self.durable = durable
        """The journal's side of admission; None: nothing is journaled (the link acknowledges)."""
        self.rules = rules
        self.topics = topics
        self.hermes = hermes
        self.ha_birth = ha_birth
        """Home Assistant's birth topic and what to do with its payload (discovery on)."""
        self.pool = pool
        """A pool daemon's hand-back (``mqtt.shared_group``): while it is active, pool requests go
        back to the pool instead of being served (the drain)."""
        self.streams = StreamIntake(ledger, rules, self._journal_stream)
        """Streamed says (``tts/stream``)."""

    def handle(self, message: InMessage) -> None:
        try:
            self._route(message)
        finally:
            if self.durable is not None:
                self.durable.journal.then(message.ack)  # after the commit, in arrival order
            if self.pool is not None and message.topic == self.topics.pool_say:
                self.pool.receipt(message)  # a handed-back one: its receipt, after the commit too

    def _route(self, message: InMessage) -> None:
        topic = message.topic
        if message.retained and topic in (
            self.topics.say,
            self.topics.pool_say,
            self.topics.stream,
            self.topics.stop,
            HERMES_SAY,
        ):
            # A request published with retain=true is kept by the broker and sent again at every
            # subscription: it would be spoken again at every start, and a kept stop would cut
            # whatever is speaking at every reconnect. A request acts once, when it is sent; the
            # broker's copy is left alone (an empty retained message clears it).
            log.warning("retained_request_ignored", topic=topic, hint="publish requests without retain")
            return
        if topic == self.topics.say:
            self.say(message, "mqtt")
        elif topic == self.topics.pool_say:
            self.say(message, "pool")
        elif self.pool is not None and topic == self.topics.pool_taken:
            self.pool.taken(message.payload)
        elif topic == self.topics.stream:
            self.streams.piece(message)
        elif topic == self.topics.stop:
            self.stop(message.payload)
        elif self.hermes and topic == HERMES_SAY:
            self.hermes_say(message)
        elif self.ha_birth is not None and topic == self.ha_birth[0]:
            self.ha_birth[1](message.payload)
        else:
            log.debug("message_ignored", topic=topic)

    def say(self, message: InMessage, origin: str) -> SayRequest:
        if origin == POOL_ORIGIN and self.pool is not None and self.pool.active:
            return self.pool.arrived(message)  # draining: another member of the pool answers it
        # Latency counts from the moment the message came off the socket, not from here.
        parsed = parse_say(
            message.payload, self.rules, origin=origin, reply_to=message.reply_to, received_at=message.received_at
        )
        if parsed.error is not None:
            log.debug(
                "request_rejected",
                request_id=parsed.request.id,
                code=str(parsed.error.code),
                reason=parsed.error.message,
            )
            self.ledger.reject(parsed.request, parsed.error.code, parsed.error.message)
        elif message.redelivered and self.ledger.seen(parsed.request.id):
            # The broker sent it again (its acknowledgement was lost with a connection): the
            # first copy is, or was, answered; a second answer would break "exactly one".
            log.info("redelivery_ignored", request_id=parsed.request.id)
        else:
            job = self.ledger.submit(parsed.request)
            if self.durable is not None and job.phase is not Phase.DONE:
                wall = time.time() - (time.monotonic() - message.received_at)
                self.durable.admit(job, wall)
        return parsed.request

    def _journal_stream(self, job: Job, message: InMessage) -> None:
        if self.durable is not None:
            self.durable.admit(job, time.time() - (time.monotonic() - message.received_at))

    def hermes_say(self, message: InMessage) -> None:
        data, _ = decode_json_object(message.payload)
        site = data.get("siteId", HERMES_DEFAULT_SITE) if data is not None else None
        if data is not None and site != self.rules.site_id:
            return  # another site's request
        self.say(message, "hermes")

    def stop(self, payload: bytes) -> None:
        data, why = decode_json_object(payload)
        if data is None:
            log.warning("stop_rejected", reason=why)
            return
        try:
            stop = StopPayload.model_validate(data)
        except ValueError as exc:
            log.warning("stop_rejected", reason=str(exc))
            return
        if stop.all:
            count = self.ledger.stop_all()
            log.info("stop_all", stopped=count)
        elif stop.id is not None:
            found = self.ledger.stop_id(stop.id)
            log.info("stop_id", target=stop.id, found=found)
        else:
            found = self.ledger.stop_current()
            log.info("stop_current", found=found)


MQTT_ORIGINS = frozenset({"mqtt", "pool", "hermes"})
"""Origins of the requests the MQTT intake makes: the ones journaled."""
