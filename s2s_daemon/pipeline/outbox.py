"""The journal's two sides for the requests it keeps: admissions in, answers out.

``DurableRequests`` journals an accepted request (acknowledged to the broker once committed),
withdraws it when the commit fails, resumes what a restart left, forgets one handed back.
``Outbox`` takes a request's terminal messages, stores them in the journal in the same commit
as the request's ``done``, publishes them once committed, marks each sent once the broker
acknowledged it, and at start republishes what was stored and never marked sent.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, Self, TypeVar

import structlog

from s2s_daemon.pipeline.jobs import Job, Ledger, Phase
from s2s_daemon.pipeline.journal import JournalError, Recovered, RequestJournal, Unsent
from s2s_daemon.pipeline.messages import ErrorCode, RequestError, Status

log = structlog.get_logger(__name__)

STREAM_CUT = RequestError(ErrorCode.RESTARTED, "the daemon restarted while this text was being streamed")
JOURNAL_LOST = RequestError(ErrorCode.JOURNAL_ERROR, "the request could not be stored (journal write failed)")


class Sendable(Protocol):
    """A message the outbox can store: what the journal's ``outgoing`` table keeps."""

    @property
    def topic(self) -> str: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def qos(self) -> int: ...
    @property
    def correlation_data(self) -> bytes | None: ...

    def once_sent(self, on_sent: Callable[[], None]) -> Self:
        """The same message, calling ``on_sent`` once the broker acknowledged it."""
        ...


M = TypeVar("M", bound=Sendable)


class Outbox(Generic[M]):
    """The terminal messages of the requests of ``origins``, stored until the broker acknowledged
    them. A request the journal kept (``expect``) is marked done in the same commit; the answers of
    other requests (connected callers: Wyoming, HTTP) go straight out."""

    def __init__(
        self,
        journal: RequestJournal,
        publish: Callable[[M], None],
        restore: Callable[[Unsent], M],
        origins: frozenset[str],
    ) -> None:
        self.journal = journal
        self._publish = publish
        self._restore = restore
        """The message for a stored row (a restart)."""
        self.origins = origins
        self._open: dict[Job, int] = {}
        """Journaled jobs not answered yet -> their journal seq."""
        self._leaving_open = False

    def expect(self, job: Job, seq: int) -> None:
        """``job`` is journaled as ``seq``: its answer marks it done."""
        self._open[job] = seq

    def forget(self, job: Job) -> int | None:
        """Stop expecting ``job`` (handed back, or its commit failed); its seq, if it was expected."""
        return self._open.pop(job, None)

    def leave_open(self) -> None:
        """The daemon exits on a failure (a wedged engine): from now on a journaled request that
        ends ``cancelled`` or ``interrupted`` is not answered, its journal row stays open and the
        next start serves it (as after a crash). Completed, failed and expired ones are answered."""
        self._leaving_open = True

    def answer(self, job: Job, messages: Iterable[M]) -> None:
        """Store ``job``'s terminal messages (QoS 0 ones are only held), publish them once committed."""
        seq = self._open.pop(job, None)
        if self._leaving_open and seq is not None and job.status in (Status.CANCELLED, Status.INTERRUPTED):
            log.info("left_for_restart", request_id=job.request.id)
            return
        if seq is None and job.request.origin not in self.origins:
            for message in messages:
                self._publish(message)  # a connected caller's request: not journaled
            return
        captured = list(messages)
        held: list[M] = []
        try:
            if seq is not None:
                self.journal.done(seq)
            for message in captured:
                if message.qos > 0:
                    row = self.journal.outgoing(
                        job.request.id, message.topic, message.payload, message.qos, message.correlation_data
                    )
                    message = message.once_sent(self._sent_callback(row))
                held.append(message)
        except JournalError:  # the journal is closed (the daemon is stopping): sent as they are
            for message in captured:
                self._publish(message)
            return
        for message in held:
            self.journal.then(functools.partial(self._publish, message))

    def republish(self, unsent: Iterable[Unsent]) -> None:
        """After a restart: publish again what the broker never acknowledged."""
        for stored in unsent:
            self._publish(self._restore(stored).once_sent(self._sent_callback(stored.row)))

    def _sent_callback(self, row: int) -> Callable[[], None]:
        return lambda: self.journal.sent(row)


class DurableRequests:
    """Admission into the journal: an accepted request is journaled (the intake acknowledges it
    once committed) and withdrawn (``journal_error``) when the commit fails; after a restart the
    unanswered ones are queued again."""

    def __init__(self, outbox: Outbox[Any], ledger: Ledger) -> None:
        self.outbox = outbox
        self.journal = outbox.journal
        self.ledger = ledger

    def admit(self, job: Job, received_wall: float) -> bool:
        """Journal an accepted request; withdrawn (``journal_error``) when that fails."""
        try:
            seq = self.journal.admit(job.request, received_wall, lambda: self._lost(job))
        except JournalError:
            self.ledger.withdraw(job, JOURNAL_LOST)
            return False
        self.outbox.expect(job, seq)
        return True

    def resume(self, recovered: Recovered, max_age_s: float) -> tuple[int, int]:
        """After a restart: republish what the broker never acknowledged, remember the answered
        ids, then queue the unanswered requests in their order, or answer ``expired`` those past
        their ``ttlMs`` or ``max_age_s``. Returns (queued, expired)."""
        self.outbox.republish(recovered.unsent)
        ledger = self.ledger
        ledger.remember(recovered.seen_ids)
        queued = expired = 0
        for entry in recovered.open:
            request = entry.request
            ttl_s = request.ttl_ms / 1000.0 if request.ttl_ms is not None else None
            if entry.streamed:  # its writer's later pieces reach a daemon that no longer has the start
                job = ledger.unserved(request, Status.CANCELLED, STREAM_CUT)
                expired += 1
            elif entry.age_s > max_age_s or (ttl_s is not None and entry.age_s > ttl_s):
                job = ledger.expire(request)
                expired += 1
            else:
                job = ledger.submit(request)  # queued, or answered at once (queue full)
            if job.phase is not Phase.DONE:
                self.outbox.expect(job, entry.seq)
                queued += 1
                continue
            with contextlib.suppress(JournalError):  # logged; answered anyway
                self.journal.done(entry.seq)  # in the same commit as its terminal messages
        return queued, expired

    def release(self, job: Job) -> int | None:
        """Forget a job handed back to the pool (it gets no terminal event here); its journal seq,
        to be finished once the broker acknowledged the hand-back."""
        return self.outbox.forget(job)

    def _lost(self, job: Job) -> None:
        if self.outbox.forget(job) is not None:
            self.ledger.withdraw(job, JOURNAL_LOST)
