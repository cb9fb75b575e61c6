"""Request bookkeeping: admission, de-duplication, stop, and exactly one terminal event."""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from s2s_daemon.pipeline.messages import ErrorCode, RequestError, SayRequest, Status
from s2s_daemon.pipeline.queue import RequestQueue

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Timeline:
    """Monotonic timestamps (seconds) of one request, filled in as it moves."""

    received: float
    dequeued: float | None = None
    synth_started: float | None = None
    first_chunk: float | None = None
    synth_done: float | None = None
    first_sample_out: float | None = None
    last_sample_played: float | None = None
    chunks: int = 0
    audio_s: float = 0.0
    """Seconds of audio synthesized."""
    underruns: int = 0
    played_ms: float | None = None
    """Milliseconds of audio the sink reported as played."""


class Phase(enum.StrEnum):
    """Where a request is."""

    QUEUED = "queued"
    SYNTHESIZING = "synthesizing"
    SPEAKING = "speaking"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Job:
    """A request being served; mutable, owned by the event loop."""

    request: SayRequest
    timeline: Timeline
    phase: Phase = Phase.QUEUED
    status: Status | None = None
    error: RequestError | None = None
    cancelled: bool = False
    """Set once a stop reaches this job; polled by the engine thread between frames."""
    play_task: asyncio.Task[Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def should_stop(self) -> bool:
        return self.cancelled


class JobEvents(Protocol):
    """Where job transitions are reported (MQTT in the daemon, logs in ``say``)."""

    def started(self, job: Job) -> None: ...

    def finished(self, job: Job) -> None: ...

    def state_changed(self) -> None: ...


class Dispatcher:
    """Admits requests into the queue and guarantees one ``finished`` per request id."""

    def __init__(self, queue: RequestQueue, events: JobEvents, dedup_window: int) -> None:
        self.queue = queue
        self.events = events
        self.jobs: dict[str, Job] = {}
        """Jobs not yet finished, by id."""
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._dedup_window = dedup_window
        self.accepting = True
        self.current: Job | None = None
        """The job whose audio is playing (or about to)."""

    # -- admission ---------------------------------------------------------------------

    def _remember(self, request_id: str) -> bool:
        """True if ``request_id`` is new; remembers it."""
        if request_id in self._seen:
            self._seen.move_to_end(request_id)
            return False
        self._seen[request_id] = None
        while len(self._seen) > self._dedup_window:
            self._seen.popitem(last=False)
        return True

    def reject(self, request: SayRequest, code: ErrorCode, message: str) -> Job:
        """Answer a request that never entered the queue."""
        job = Job(request, Timeline(received=request.received_at))
        self._terminate(job, Status.REJECTED, RequestError(code, message))
        return job

    def submit(self, request: SayRequest) -> Job:
        """Queue ``request`` or reject it; either way the caller gets its job."""
        if not self.accepting:
            return self.reject(request, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if not self._remember(request.id):
            return self.reject(request, ErrorCode.DUPLICATE, f"request id {request.id!r} was already received")
        if request.interrupt:
            self.stop_current()
        if not self.queue.offer(request, front=request.interrupt):
            return self.reject(request, ErrorCode.QUEUE_FULL, f"{len(self.queue)} requests are already waiting")
        job = Job(request, Timeline(received=request.received_at))
        self.jobs[request.id] = job
        log.debug("request_queued", request_id=request.id, queue=len(self.queue))
        self.events.state_changed()
        return job

    # -- stopping ----------------------------------------------------------------------

    def stop_current(self) -> bool:
        """Interrupt the utterance being spoken (or synthesized for speaking next)."""
        job = self.current
        if job is None:
            job = next((j for j in self.jobs.values() if j.phase is Phase.SYNTHESIZING), None)
        if job is None:
            return False
        self.cancel(job, Status.INTERRUPTED)
        return True

    def stop_id(self, request_id: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None:
            return False
        status = Status.CANCELLED if job.phase is Phase.QUEUED else Status.INTERRUPTED
        self.cancel(job, status)
        return True

    def stop_all(self, status_queued: Status = Status.CANCELLED, error: RequestError | None = None) -> int:
        """Stop the current utterance and empty the queue; returns how many were stopped."""
        count = 0
        for request in self.queue.drain():
            job = self.jobs.get(request.id)
            if job is not None:
                self._terminate(job, status_queued, error)
                count += 1
        for job in list(self.jobs.values()):
            self.cancel(job, Status.INTERRUPTED if job.phase is not Phase.QUEUED else status_queued)
            count += 1
        return count

    def cancel(self, job: Job, status: Status) -> None:
        """Stop ``job`` wherever it is; a playing job ends when its sink has flushed.

        ``interrupted`` means some of it was heard: a job stopped before its first sample played
        (queued, or still synthesizing) ends ``cancelled`` whatever stopped it.
        """
        if job.status is not None or job.phase is Phase.DONE:
            return
        if status is Status.INTERRUPTED and job.timeline.first_sample_out is None:
            status = Status.CANCELLED
        job.cancelled = True
        if job.phase is Phase.QUEUED:
            self.queue.remove(job.request.id)
            self._terminate(job, status)
            return
        job.status = status
        if job.play_task is not None and not job.play_task.done():
            job.play_task.cancel()
        self.events.state_changed()

    # -- progress, called by the stages ------------------------------------------------

    def take(self, request: SayRequest) -> Job | None:
        """The TTS stage dequeued ``request``; None when it is no longer wanted."""
        job = self.jobs.get(request.id)
        if job is None or job.phase is not Phase.QUEUED:
            return None
        now = time.monotonic()
        job.timeline.dequeued = now
        if request.ttl_ms is not None and (now - request.received_at) * 1000.0 > request.ttl_ms:
            self._terminate(job, Status.EXPIRED)
            return None
        job.phase = Phase.SYNTHESIZING
        self.events.state_changed()
        return job

    def first_sample(self, job: Job, at: float) -> None:
        job.timeline.first_sample_out = at
        job.phase = Phase.SPEAKING
        self.events.started(job)
        self.events.state_changed()

    def fail(self, job: Job, code: ErrorCode, message: str) -> None:
        """Record a per-request failure; the request ends with status ``error``."""
        if job.error is None:
            job.error = RequestError(code, message)
        if job.status is None:
            job.status = Status.ERROR
        job.cancelled = True

    def complete(self, job: Job) -> None:
        """The job's playback ended (normally, stopped, or failed)."""
        self._terminate(job, job.status or Status.COMPLETED, job.error)

    def _terminate(self, job: Job, status: Status, error: RequestError | None = None) -> None:
        if job.phase is Phase.DONE:
            return
        job.phase = Phase.DONE
        job.status = status
        job.error = error if error is not None else job.error
        job.cancelled = True
        if self.jobs.get(job.request.id) is job:
            del self.jobs[job.request.id]
        if self.current is job:
            self.current = None
        job.done.set()
        self.events.finished(job)
        self.events.state_changed()

    # -- state -------------------------------------------------------------------------

    def state(self) -> tuple[str, str | None]:
        """``(idle|synthesizing|speaking, current id)`` for the retained state topic."""
        job = self.current
        if job is not None and job.phase is Phase.SPEAKING:
            return "speaking", job.request.id
        busy = next((j for j in self.jobs.values() if j.phase is not Phase.QUEUED), None)
        if busy is not None:
            return "synthesizing", busy.request.id
        return "idle", None
