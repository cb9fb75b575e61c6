"""The ledger: the one owner of every request's state, from admission to its terminal event.

Stages never touch a job. They report what happened with a typed event that carries its own
monotonic time (``ledger.record(job, ChunkMade(at, seconds))``), and the ledger moves the job
on, fills its timeline and tells ``JobEvents`` (MQTT's ``tts/started`` and ``tts/finished``,
whose payloads and the latency event are built from the timeline alone). A stop is one
mechanism: ``cancel`` sets the job's stop token, which the engine thread polls between frames
and the playback stage awaits beside its sink; the stage that holds the job then reports how
it ended, and that report is what ends the job.

A request's life: ``submit`` (accepted) or ``reject``; ``take`` (dequeued, or expired);
``SynthesisStarted``, ``SegmentReady`` (a segment's text is complete), ``ChunkMade`` (the first is
the first chunk), ``SynthesisEnded``; ``OnSpeaker``; ``FirstSample``;
``PlaybackEnded`` (the terminal event of every request that reached a stage: played to the end,
stopped, or failed, with what the sink reported) or ``Released`` (a stage let it go unplayed).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from s2s_daemon.pipeline.messages import ErrorCode, PlaybackReport, RequestError, SayRequest, Status, Utterance
from s2s_daemon.pipeline.queue import RequestQueue

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Timeline:
    """Monotonic timestamps (seconds) of one request; written by the ledger only."""

    received: float
    dequeued: float | None = None
    synth_started: float | None = None
    first_text: float | None = None
    """When the text of the first segment was complete (a streamed text waits for its writer)."""
    first_segment_chars: int = 0
    """Characters of the first segment (the speaker paces its start by it)."""
    first_chunk: float | None = None
    synth_done: float | None = None
    first_sample_out: float | None = None
    last_sample_played: float | None = None
    chunks: int = 0
    audio_s: float = 0.0
    """Seconds of audio synthesized."""
    underruns: int = 0
    """Times the speaker ran dry mid-utterance (a run of starved device periods is one)."""
    underrun_ms: float = 0.0
    """Milliseconds of silence those underruns played."""
    prebuffer_s: float = 0.0
    """Audio buffered before the first sample because the engine was slower than real time."""
    played_ms: float | None = None
    """Milliseconds of audio delivered: the sink's report, or estimated when playback was stopped."""
    stop_asked: float | None = None
    """When the request was asked to stop (a stop, ``interrupt``, barge-in, the drain, its caller
    gone): a first sample handed on after this was not heard (``Ledger.heard``)."""


class Phase(enum.StrEnum):
    """Where a request is."""

    QUEUED = "queued"
    SYNTHESIZING = "synthesizing"
    SPEAKING = "speaking"
    DONE = "done"


# -- what stages report --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SynthesisStarted:
    at: float


@dataclass(frozen=True, slots=True)
class SegmentReady:
    """A segment's text (``chars`` long) is complete and goes to the engine (the first one marks
    ``first_text``)."""

    at: float
    chars: int = 0


@dataclass(frozen=True, slots=True)
class ChunkMade:
    """The engine yielded ``seconds`` of audio (the first one is the first chunk)."""

    at: float
    seconds: float


@dataclass(frozen=True, slots=True)
class SynthesisEnded:
    at: float


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine or the audio output failed this request (it ends with status ``error``)."""

    at: float
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class TextCut:
    """The request's streamed text ended early (``code``): what came plays, and the request then
    ends ``error`` with it, unless it was stopped."""

    at: float
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class Truncated:
    """A piece of the request's text was cut short: the engine ran away (``tts/runaway.py``). What
    came before plays, the rest of the text is spoken, and the request still ends ``completed``."""

    at: float
    reason: str
    """``runaway``."""
    cause: str
    """What gave it away: ``length``, ``silence`` or ``loop``."""


@dataclass(frozen=True, slots=True)
class OnSpeaker:
    """The speaker took the request: its audio plays next, in the room."""

    at: float


@dataclass(frozen=True, slots=True)
class Prebuffered:
    """The speaker waited for ``seconds`` of audio before its first sample (a slow engine)."""

    at: float
    seconds: float


@dataclass(frozen=True, slots=True)
class FirstSample:
    """The first sample left for the device (or the caller)."""

    at: float


@dataclass(frozen=True, slots=True)
class PlaybackEnded:
    """The output is done with the request: ``report`` when it played to the end, None when it
    was stopped or failed (the audio heard is then estimated from the first sample's time)."""

    at: float
    report: PlaybackReport | None = None


@dataclass(frozen=True, slots=True)
class Released:
    """A stage let the request go without playing it (it was stopped, or the daemon is stopping)."""

    at: float


StageEvent = (
    SynthesisStarted
    | SegmentReady
    | ChunkMade
    | SynthesisEnded
    | Failed
    | TextCut
    | Truncated
    | OnSpeaker
    | Prebuffered
    | FirstSample
    | PlaybackEnded
    | Released
)


@dataclass(slots=True, eq=False)
class Job:
    """A request being served. Its fields are the ledger's; stages read ``request`` and the stop token."""

    request: SayRequest
    timeline: Timeline
    phase: Phase = Phase.QUEUED
    status: Status | None = None
    error: RequestError | None = None
    shortfall: RequestError | None = None
    """Why the request was spoken short of what was asked (its streamed text ended early): its
    error if it otherwise plays to the end."""
    truncated: str | None = None
    """Why part of its audio was cut short (``runaway``), told in ``tts/finished``; None: none was."""
    truncated_cause: str | None = None
    """What gave the first cut away (``length``, ``silence``, ``loop``; the metric's label)."""
    cancelled: bool = False
    """The stop token as a plain flag: polled by the engine thread between frames."""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    """The stop token for the event loop: awaited by the playback stage beside its sink."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set with the terminal event."""

    def should_stop(self) -> bool:
        return self.cancelled


@dataclass(frozen=True, slots=True)
class SpeakerTurn:
    """A speaker's request, handed from the TTS stage to the playback stage: its job (the ledger's:
    the stop token, the timeline) and its utterance (the sink's: the request and its chunks). The
    playback stage is handed the job; it never looks it up again by id."""

    job: Job
    utterance: Utterance


class JobEvents(Protocol):
    """Where job transitions are reported (MQTT in the daemon, logs in ``say``)."""

    def started(self, job: Job) -> None: ...

    def finished(self, job: Job) -> None: ...

    def state_changed(self) -> None: ...


class Ledger:
    """Admits requests into the queue, owns every request's state and guarantees one ``finished`` per request id."""

    def __init__(self, queue: RequestQueue, events: JobEvents, dedup_window: int) -> None:
        self.queue = queue
        self.events = events
        self.jobs: dict[str, Job] = {}
        """Jobs not yet finished, by id."""
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._dedup_window = dedup_window
        self.accepting = True
        self.current: Job | None = None
        """The job whose audio is playing on the speaker (or about to)."""

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

    def remember(self, request_ids: list[str]) -> None:
        """Ids answered before a restart (the journal's): a redelivery of one is a duplicate."""
        for request_id in request_ids:
            self._remember(request_id)

    def expire(self, request: SayRequest) -> Job:
        """Answer ``expired`` a request too old to be spoken (one resumed after a restart)."""
        return self.unserved(request, Status.EXPIRED)

    def unserved(self, request: SayRequest, status: Status, error: RequestError | None = None) -> Job:
        """Answer a request that cannot be served (one resumed after a restart that is too old,
        or a stream whose text the restart cut; a pool request that could not be handed back)."""
        self._remember(request.id)
        job = Job(request, Timeline(received=request.received_at))
        self._terminate(job, status, error)
        return job

    def seen(self, request_id: str) -> bool:
        """Whether ``request_id`` was received within the de-duplication window."""
        return request_id in self._seen

    def withdraw(self, job: Job, error: RequestError) -> None:
        """Take back an accepted request that could not be kept (its journal write failed): it
        ends ``rejected`` with ``error``, wherever it is."""
        if job.phase is Phase.DONE:
            return
        job.error = error
        self.cancel(job, Status.REJECTED)

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
        if not self.queue.offer(request, front=request.interrupt):
            waiting = len(self.queue)
            message = f"{waiting} {'request is' if waiting == 1 else 'requests are'} already waiting"
            return self.reject(request, ErrorCode.QUEUE_FULL, message)  # and has no effect: nothing is stopped
        if request.interrupt:  # once it is queued: a rejected interrupt stops nothing
            self.stop_current()
        job = Job(request, Timeline(received=request.received_at))
        self.jobs[request.id] = job
        log.debug("request_queued", request_id=request.id, queue=len(self.queue))
        self.events.state_changed()
        return job

    def take(self, request: SayRequest, at: float | None = None) -> Job | None:
        """The TTS stage dequeued ``request``; its job, or None when it is no longer wanted."""
        job = self.jobs.get(request.id)
        if job is None or job.phase is not Phase.QUEUED:
            return None
        now = time.monotonic() if at is None else at
        job.timeline.dequeued = now
        if request.ttl_ms is not None and (now - request.received_at) * 1000.0 > request.ttl_ms:
            self._terminate(job, Status.EXPIRED)
            return None
        job.phase = Phase.SYNTHESIZING
        self.events.state_changed()
        return job

    # -- stopping ----------------------------------------------------------------------

    def stop_current(self) -> bool:
        """Stop the utterance being spoken (or synthesized for speaking next) on the speaker;
        a caller's request (Wyoming, HTTP) is its caller's to stop."""
        job = self.current
        if job is None:
            job = next(
                (j for j in self.jobs.values() if j.phase is Phase.SYNTHESIZING and j.request.output is None), None
            )
        if job is None:
            return False
        self.cancel(job, Status.INTERRUPTED)
        return True

    def stop_speaking(self) -> str | None:
        """Stop the utterance playing on the speaker (barge-in); its id, or None when none plays."""
        job = self.current
        if job is None or job.phase is not Phase.SPEAKING:
            return None
        self.cancel(job, Status.INTERRUPTED)
        return job.request.id

    def stop_id(self, request_id: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None:
            return False
        self.cancel(job, Status.INTERRUPTED)
        return True

    def stop_all(self) -> int:
        """Stop the current utterance and empty the queue; returns how many were stopped."""
        count = 0
        for request in self.queue.drain():
            job = self.jobs.get(request.id)
            if job is not None:
                self._terminate(job, Status.CANCELLED)
                count += 1
        for job in list(self.jobs.values()):
            self.cancel(job, Status.INTERRUPTED)
            count += 1
        return count

    def cancel(self, job: Job, status: Status) -> None:
        """Stop ``job`` wherever it is: the one way to stop a request.

        A queued job ends at once. Otherwise its stop token is set and the stage holding it
        reports how it ended (``PlaybackEnded`` or ``Released``). Whether a stopped job ends
        ``interrupted`` or ``cancelled`` is decided when it ends, by ``heard``.
        """
        if job.status is not None or job.phase is Phase.DONE:
            return
        if job.timeline.stop_asked is None:
            job.timeline.stop_asked = time.monotonic()
        self._stop(job)
        if job.phase is Phase.QUEUED:
            self.queue.remove(job.request.id)
            self._terminate(job, status)
            return
        job.status = status
        self.events.state_changed()

    def close(self) -> list[Job]:
        """Stop accepting and cancel every queued request (the drain's first step)."""
        self.accepting = False
        cancelled = []
        for request in self.queue.drain():
            job = self.jobs.get(request.id)
            if job is not None:
                self.cancel(job, Status.CANCELLED)
                cancelled.append(job)
        self.queue.close()
        return cancelled

    def hand_back(self, wanted: Callable[[SayRequest], bool], at: float | None = None) -> list[Job]:
        """Take the queued, not yet started requests ``wanted`` out of the queue with no terminal
        event: another daemon answers them (a pool daemon's drain hands them back to the pool).
        One already past its ``ttlMs`` ends ``expired`` here instead. Returns the handed-back jobs,
        highest priority first, then in arrival order; each is done (``done`` set, no status)."""
        now = time.monotonic() if at is None else at
        out: list[Job] = []
        for job in list(self.jobs.values()):
            request = job.request
            if job.phase is not Phase.QUEUED or request.id not in self.queue or not wanted(request):
                continue
            if request.ttl_ms is not None and (now - request.received_at) * 1000.0 >= request.ttl_ms:
                self.cancel(job, Status.EXPIRED)
                continue
            self.queue.remove(request.id)
            del self.jobs[request.id]
            job.phase = Phase.DONE
            self._stop(job)
            job.done.set()
            out.append(job)
        if out:
            self.events.state_changed()
        out.sort(key=lambda job: -job.request.priority)  # stable: arrival order within a priority
        return out

    def abandon(self, error: RequestError) -> None:
        """The stages are gone (shutdown): end every job still open, with ``error``."""
        for job in list(self.jobs.values()):
            self.cancel(job, Status.INTERRUPTED)
            if job.phase is not Phase.DONE:
                self._terminate(job, job.status or Status.INTERRUPTED, job.error or error)

    @staticmethod
    def _stop(job: Job) -> None:
        job.cancelled = True
        job.stopped.set()

    @staticmethod
    def heard(job: Job, at: float | None) -> bool:
        """The one rule of ``interrupted`` against ``cancelled``: a sample handed on at ``at`` was
        heard when it left before the request was asked to stop. One handed on after the stop (a
        sink that had not seen it yet: at most a device period plays before its flush) was not:
        the request ends ``cancelled``, with no ``tts/started``, ``audioMs`` 0 and no latency event."""
        stop = job.timeline.stop_asked
        return at is not None and (stop is None or at <= stop)

    # -- what the stages report ------------------------------------------------------------

    def record(self, job: Job, event: StageEvent) -> None:
        """Move ``job`` on by what a stage saw; ignored once the job has ended."""
        if job.phase is Phase.DONE:
            return
        tl = job.timeline
        match event:
            case SynthesisStarted(at):
                tl.synth_started = at
            case SegmentReady(at, chars):
                if tl.first_text is None:
                    tl.first_text = at
                    tl.first_segment_chars = chars
            case ChunkMade(at, seconds):
                if tl.first_chunk is None:
                    tl.first_chunk = at
                tl.chunks += 1
                tl.audio_s += seconds
            case SynthesisEnded(at):
                tl.synth_done = at
            case Failed(_, code, message):
                job.error = job.error or RequestError(code, message)
                job.status = job.status or Status.ERROR
                job.cancelled = True  # the engine stops; what was already made still plays
            case TextCut(_, code, message):
                job.shortfall = job.shortfall or RequestError(code, message)
            case Truncated(_, reason, cause):
                if job.truncated is None:
                    job.truncated, job.truncated_cause = reason, cause
            case OnSpeaker(_):
                self.current = job
            case Prebuffered(_, seconds):
                tl.prebuffer_s = seconds
            case FirstSample(at):
                if tl.first_sample_out is None and self.heard(job, at):
                    tl.first_sample_out = at
                    job.phase = Phase.SPEAKING
                    self.events.started(job)
                    self.events.state_changed()
            case PlaybackEnded(at, report):
                self._ended(job, at, report)
            case Released(_):
                self._terminate(job, job.status or Status.CANCELLED)

    def _ended(self, job: Job, at: float, report: PlaybackReport | None) -> None:
        tl = job.timeline
        if report is not None:
            tl.underruns = report.underruns
            tl.underrun_ms = report.underrun_ms
            if tl.first_sample_out is None and self.heard(job, report.first_sample_at):
                tl.first_sample_out = report.first_sample_at
        if tl.first_sample_out is None:
            tl.played_ms = 0.0
        elif report is not None:
            tl.last_sample_played = report.last_sample_at
            tl.played_ms = report.audio_ms
        else:  # stopped or failed while playing: it played in real time since the first sample
            end = at if tl.stop_asked is None else min(at, tl.stop_asked)
            tl.last_sample_played = end
            tl.played_ms = round(min(tl.audio_s, max(0.0, end - tl.first_sample_out)) * 1000.0, 1)
        if job.status is None and job.shortfall is not None:
            job.status, job.error = Status.ERROR, job.shortfall
        self._terminate(job, job.status or Status.COMPLETED)

    def _terminate(self, job: Job, status: Status, error: RequestError | None = None) -> None:
        if job.phase is Phase.DONE:
            return
        if status in (Status.INTERRUPTED, Status.CANCELLED):
            status = Status.INTERRUPTED if job.timeline.first_sample_out is not None else Status.CANCELLED
        job.phase = Phase.DONE
        job.status = status
        job.error = error if error is not None else job.error
        self._stop(job)
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
