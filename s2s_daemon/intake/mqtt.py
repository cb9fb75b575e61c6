"""Routes incoming MQTT messages: say, stream, stop, pool, Hermes. Never raises on bad input.

With the journal, every message is acknowledged (PUBACK) only once the loop turn's journal
writes are committed: an accepted request is on disk before the broker forgets it, and its
terminal event is journaled and published once committed (``DurableEvents``), then forgotten
once the broker acknowledged it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import replace

import structlog

from s2s_daemon.intake.pool import POOL_ORIGIN, PoolHandBack
from s2s_daemon.intake.schemas import IntakeRules, StopPayload, decode_json_object, parse_say
from s2s_daemon.intake.streams import StreamIntake
from s2s_daemon.mqtt.packets import InMessage, OutMessage
from s2s_daemon.mqtt.topics import HERMES_SAY, Topics
from s2s_daemon.pipeline.jobs import Dispatcher, Job, JobEvents, Phase
from s2s_daemon.pipeline.journal import JournalError, Recovered, RequestJournal
from s2s_daemon.pipeline.messages import ErrorCode, RequestError, SayRequest, Status

log = structlog.get_logger(__name__)

HERMES_DEFAULT_SITE = "default"


class MqttIntake:
    def __init__(
        self,
        dispatcher: Dispatcher,
        rules: IntakeRules,
        topics: Topics,
        hermes: bool,
        ha_birth: tuple[str, Callable[[bytes], None]] | None = None,
        durable: DurableEvents | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.durable = durable
        """The journal's side of the events; None: nothing is journaled (the link acknowledges)."""
        self.rules = rules
        self.topics = topics
        self.hermes = hermes
        self.ha_birth = ha_birth
        """Home Assistant's birth topic and what to do with its payload (discovery on)."""
        self.pool: PoolHandBack | None = None
        """A pool daemon's hand-back (``mqtt.shared_group``): while it is active, pool requests go
        back to the pool instead of being served (the drain)."""
        self.streams = StreamIntake(dispatcher, rules, self._journal_stream)
        """Streamed says (``tts/stream``)."""

    def handle(self, message: InMessage) -> None:
        try:
            self._route(message)
        finally:
            if self.durable is not None:
                self.durable.journal.then(message.ack)  # after the commit, in arrival order

    def _route(self, message: InMessage) -> None:
        topic = message.topic
        if topic == self.topics.say:
            self.say(message, "mqtt")
        elif topic == self.topics.pool_say:
            self.say(message, "pool")
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
            self.dispatcher.reject(parsed.request, parsed.error.code, parsed.error.message)
        elif message.redelivered and self.dispatcher.seen(parsed.request.id):
            # The broker sent it again (its acknowledgement was lost with a connection): the
            # first copy is, or was, answered; a second answer would break "exactly one".
            log.info("redelivery_ignored", request_id=parsed.request.id)
        else:
            job = self.dispatcher.submit(parsed.request)
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
            count = self.dispatcher.stop_all()
            log.info("stop_all", stopped=count)
        elif stop.id is not None:
            found = self.dispatcher.stop_id(stop.id)
            log.info("stop_id", target=stop.id, found=found)
        else:
            found = self.dispatcher.stop_current()
            log.info("stop_current", found=found)


STREAM_CUT = RequestError(ErrorCode.RESTARTED, "the daemon restarted while this text was being streamed")
JOURNAL_LOST = RequestError(ErrorCode.JOURNAL_ERROR, "the request could not be stored (journal write failed)")


class DurableEvents:
    """``JobEvents`` in front of ``MqttEvents``: the terminal event of an MQTT request is journaled
    and published once committed; the journal forgets it once the broker acknowledged it.

    ``MqttEvents`` publishes through ``publish`` here: while it reports a terminal event, its
    messages are captured and held for the commit. Requests of connected callers (Wyoming,
    HTTP) are not journaled: their events go straight out.
    """

    def __init__(
        self,
        journal: RequestJournal,
        dispatcher: Callable[[], Dispatcher],
        link_publish: Callable[[OutMessage], None],
    ) -> None:
        self.journal = journal
        self._dispatcher = dispatcher
        self._link_publish = link_publish
        self.inner: JobEvents | None = None
        """The events it fronts (set once they exist: they publish through ``publish``)."""
        self._open: dict[Job, int] = {}
        """Journaled jobs not answered yet -> their journal seq."""
        self._captured: list[OutMessage] | None = None
        self._leaving_open = False

    def leave_open(self) -> None:
        """The daemon exits on a failure (a wedged engine): from now on a journaled request that
        ends ``cancelled`` or ``interrupted`` is not answered, its journal row stays open and the
        next start serves it (as after a crash). Completed, failed and expired ones are answered."""
        self._leaving_open = True

    # -- what MqttEvents publishes through -------------------------------------------------

    def publish(self, message: OutMessage) -> None:
        if self._captured is not None:
            self._captured.append(message)
        else:
            self._link_publish(message)

    # -- admission ---------------------------------------------------------------------

    def admit(self, job: Job, received_wall: float) -> bool:
        """Journal an accepted MQTT request; withdrawn (``journal_error``) when that fails."""
        try:
            seq = self.journal.admit(job.request, received_wall, lambda: self._lost(job))
        except JournalError:
            self._dispatcher().withdraw(job, JOURNAL_LOST)
            return False
        self._open[job] = seq
        return True

    def resume(self, recovered: Recovered, max_age_s: float) -> tuple[int, int]:
        """After a restart: republish what the broker never acknowledged, remember the answered
        ids, then queue the unanswered requests in their order, or answer ``expired`` those past
        their ``ttlMs`` or ``max_age_s``. Returns (queued, expired)."""
        for unsent in recovered.unsent:
            message = OutMessage(
                unsent.topic,
                unsent.payload,
                unsent.qos,
                correlation_data=unsent.correlation_data,
                on_sent=self._sent_callback(unsent.row),
            )
            self._link_publish(message)
        dispatcher = self._dispatcher()
        dispatcher.remember(recovered.seen_ids)
        queued = expired = 0
        for entry in recovered.open:
            request = entry.request
            ttl_s = request.ttl_ms / 1000.0 if request.ttl_ms is not None else None
            if entry.streamed:  # its writer's later pieces reach a daemon that no longer has the start
                job = dispatcher.unserved(request, Status.CANCELLED, STREAM_CUT)
                expired += 1
            elif entry.age_s > max_age_s or (ttl_s is not None and entry.age_s > ttl_s):
                job = dispatcher.expire(request)
                expired += 1
            else:
                job = dispatcher.submit(request)  # queued, or answered at once (queue full)
            if job.phase is not Phase.DONE:
                self._open[job] = entry.seq
                queued += 1
                continue
            with contextlib.suppress(JournalError):  # logged; answered anyway
                self.journal.done(entry.seq)  # in the same commit as its terminal messages
        return queued, expired

    def release(self, job: Job) -> int | None:
        """Forget a job handed back to the pool (it gets no terminal event here); its journal seq,
        to be finished once the broker acknowledged the hand-back."""
        return self._open.pop(job, None)

    def _lost(self, job: Job) -> None:
        if self._open.pop(job, None) is not None:
            self._dispatcher().withdraw(job, JOURNAL_LOST)

    # -- JobEvents ---------------------------------------------------------------------

    def started(self, job: Job) -> None:
        assert self.inner is not None
        self.inner.started(job)

    def state_changed(self) -> None:
        assert self.inner is not None
        self.inner.state_changed()

    def finished(self, job: Job) -> None:
        assert self.inner is not None
        seq = self._open.pop(job, None)
        if self._leaving_open and seq is not None and job.status in (Status.CANCELLED, Status.INTERRUPTED):
            log.info("left_for_restart", request_id=job.request.id)
            return
        if seq is None and job.request.origin not in MQTT_ORIGINS:
            self.inner.finished(job)  # a connected caller's request: not journaled
            return
        captured: list[OutMessage] = []
        self._captured = captured
        try:
            self.inner.finished(job)
        finally:
            self._captured = None
        held: list[OutMessage] = []
        try:
            if seq is not None:
                self.journal.done(seq)
            for message in captured:
                if message.qos > 0:
                    row = self.journal.outgoing(
                        job.request.id, message.topic, message.payload, message.qos, message.correlation_data
                    )
                    message = replace(message, on_sent=self._sent_callback(row))
                held.append(message)
        except JournalError:  # the journal is closed (the daemon is stopping): sent as they are
            for message in captured:
                self._link_publish(message)
            return
        for message in held:
            self.journal.then(functools.partial(self._link_publish, message))

    def _sent_callback(self, row: int) -> Callable[[], None]:
        return lambda: self.journal.sent(row)


MQTT_ORIGINS = frozenset({"mqtt", "pool", "hermes"})
"""Origins of the requests the MQTT intake makes: the ones journaled."""
