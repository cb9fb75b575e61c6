"""Who the engine thread serves next: the speaker first, then the batch.

A paced stream (the speaker's, ``SynthesisRequest.paced``) must never stutter: while its audio is
less than ``LEAD_S`` ahead of playing time, other streams wait their turns (an engine that does
not batch) or are left out of the steps (``Batch``, an engine that decodes several requests
together a frame at a time). ``scripts/bench_batch.py`` measures a batch's steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable

from s2s_daemon.tts.bridge import ChunkStream
from s2s_daemon.tts.engine import BatchEngine, BatchSynthesis, SynthesisRequest
from s2s_daemon.tts.watch import UtteranceBudget

LEAD_S = 1.5
"""Audio a paced stream (the speaker's) must have ahead of playing time for others to share its
steps: longer than the longest step of a full batch (a codec chunk of each of its streams, plus
the step itself; ``scripts/bench_torch.py``'s ``codec_ms_per_frame`` measures the codec). Opening
(prefilling) another needs this plus the prefill's expected time."""
OPEN_S = 1.0
"""A prefill's expected time before one was measured (then a running mean of them)."""


def speaker_lead_s(streams: Iterable[ChunkStream]) -> float:
    """The least lead (``UtteranceBudget.lead_s``) of the paced ``streams`` that can make a chunk;
    infinity when there is none."""
    now = time.monotonic()
    return min((s.budget.lead_s(now) for s in streams if s.paced and s.runnable()), default=float("inf"))


def speaker_first(streams: Iterable[ChunkStream], opening: bool) -> bool:
    """(Engine thread, streams taking turns) whether a paced stream that can make a chunk is less
    than ``LEAD_S`` ahead of playing time (plus ``OPEN_S`` for a stream about to start)."""
    return speaker_lead_s(streams) < LEAD_S + (OPEN_S if opening else 0.0)


class BatchStream(ChunkStream):
    """A stream whose engine decodes it together with others (``Batch``), not by a generator."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: Batch,
        request: SynthesisRequest,
        should_stop: Callable[[], bool],
        capacity: int,
        budget: UtteranceBudget | None = None,
        *,
        sample_rate: int = 24000,
    ) -> None:
        super().__init__(loop, batch.submit, capacity, budget, paced=request.paced, sample_rate=sample_rate)
        self.batch = batch
        self.request = request
        self.should_stop = should_stop
        self.synthesis: BatchSynthesis | None = None
        self.joined = False

    def waited_lately(self, stall_timeout_s: float | None) -> bool:
        """Waiting for a place or held, or less than ``stall_timeout_s`` out of it (event loop)."""
        return self.waiting_for_place() or super().waited_lately(stall_timeout_s)

    def produce(self) -> None:
        """(Engine thread) join the batch, or resume after a pause: the batch steps it."""
        if not self.joined:
            self.joined = True
            self.batch.join(self)
        self.batch.wake()

    def release(self) -> None:
        """Leave the batch, and stop its synthesis."""
        self.batch.leave(self)
        if self.synthesis is not None:
            self.synthesis.stop()

    def waiting_for_place(self) -> bool:
        """Joined but not opened yet: ``Batch.size`` streams are open before it."""
        return self.joined and self.synthesis is None and not self.ended()

    def open(self, engine: BatchEngine) -> float | None:
        """(Engine thread) prefill its request: the seconds it took; None when it failed (then
        the stream ended with the error, re-raised on the event loop by the consumer)."""
        started = time.monotonic()
        self.begin_run(started)
        self.activate(started)
        try:
            self.synthesis = engine.open_blocking(self.request, self.should_stop)
        except BaseException as exc:  # re-raised on the event loop by the consumer
            self.batch.leave(self)
            self.finish(exc)
            return None
        finally:
            ended = time.monotonic()
            self.end_run(ended)
        return ended - started

    def deliver(self) -> None:
        """(Engine thread) hand on what the last step made; end the stream when its synthesis did."""
        assert self.synthesis is not None
        for chunk in self.synthesis.take():
            self.put(chunk)
        if self.synthesis.done:
            self.batch.leave(self)  # before the consumer hears of the end
            self.finish(None)
            return
        self.pause_if_full()


class Batch:
    """The streams of a batching engine (``max_batch`` > 1), decoded together a frame at a time.

    Every step runs on the engine thread and is resubmitted after each frame, so other engine
    calls (memory figures, closing a stream) wait at most one step. Up to ``size`` streams are
    open at once (their KV caches live); a step opens (prefills) a paced stream, or every caller
    waiting (requests sent together start together); a later one waits for a place. A stream
    whose consumer is ``STREAM_AHEAD`` chunks behind is left out of the steps until it catches up.

    A paced stream (the speaker's) comes first: while its audio is less than ``LEAD_S`` ahead of
    playing time, the others are left out of the steps, and none is opened unless that lead also
    covers a prefill. On an engine slower than real time the speaker's utterance so runs alone
    (the others wait for it); on a fast one the others join once it is far enough ahead.
    """

    def __init__(self, engine: BatchEngine, submit: Callable[[Callable[[], None]], None], size: int) -> None:
        self.engine = engine
        self.submit = submit
        self.size = size
        self.open_s = OPEN_S
        """A prefill's expected time: a running mean of those measured (engine thread)."""
        self.open_together = True
        """Open every caller waiting in one step (False: one a step)."""
        self._streams: list[BatchStream] = []
        """Joined, in order of arrival (engine thread only)."""
        self._lock = threading.Lock()
        self._scheduled = False

    def join(self, stream: BatchStream) -> None:
        self._streams.append(stream)

    def leave(self, stream: BatchStream) -> None:
        if stream in self._streams:
            self._streams.remove(stream)

    def wake(self) -> None:
        """Have a step run soon (any thread); one is queued at a time."""
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self.submit(self.step)

    def step(self) -> None:
        """(Engine thread) open what has a place, then one frame of every runnable open stream."""
        with self._lock:
            self._scheduled = False
        # Open what has a place: paced streams first, a paced one alone in its step (the speaker
        # plays after one prefill, not after four), then every caller waiting, each while the
        # speaker's lead still covers a prefill. Callers opened in one step are stepped together
        # at once: each one's first audio waits for their prefills and one step, not for a step
        # of every stream opened before it (the streams already open pause for those prefills
        # either way, in one gap or one prefill a step).
        opened = sum(1 for s in self._streams if s.synthesis is not None and not s.closed)
        for stream in sorted(self._streams, key=lambda s: not s.paced):
            if stream.closed or stream.synthesis is not None:
                continue
            if opened >= self.size:
                break
            lead = self._speaker_lead_s()
            if not stream.paced and lead < LEAD_S + self.open_s:
                stream.hold(lead)
                break
            if self._open(stream):
                opened += 1
            if stream.paced or not self.open_together:
                break
        lead = self._speaker_lead_s()
        ready: list[BatchStream] = []
        for stream in list(self._streams):
            if stream.closed or stream.synthesis is None or not stream.runnable():
                continue
            if not stream.paced and lead < LEAD_S:
                stream.hold(lead)
                continue
            stream.unhold()
            ready.append(stream)
        if not ready:
            if self._has_work():  # the stream opened this step failed: the next may open
                self.wake()
            return
        started = time.monotonic()
        for stream in ready:
            stream.begin_run(started)
        try:
            self.engine.step_blocking([stream.synthesis for stream in ready if stream.synthesis is not None])
        except BaseException as exc:  # every stream of the step failed with it
            for stream in ready:
                self.leave(stream)
                stream.finish(exc)
            return
        finally:
            ended = time.monotonic()
            for stream in ready:
                stream.end_run(ended)
        for stream in ready:
            stream.deliver()
        if self._has_work():
            self.wake()

    def _speaker_lead_s(self) -> float:
        """The least lead (``UtteranceBudget.lead_s``) of the open paced streams that can make a
        frame; infinity when there is none (one waiting for a place holds nobody: they must finish
        to make it one)."""
        return speaker_lead_s(s for s in self._streams if s.synthesis is not None)

    def _has_work(self) -> bool:
        """An open stream can make a frame, or a joined one can be opened."""
        opened = [stream for stream in self._streams if stream.synthesis is not None]
        if any(stream.runnable() for stream in opened):
            return True
        return len(opened) < self.size and any(s.synthesis is None and s.runnable() for s in self._streams)

    def _open(self, stream: BatchStream) -> bool:
        took = stream.open(self.engine)
        if took is None:
            return False
        self.open_s = 0.7 * self.open_s + 0.3 * took
        return True
