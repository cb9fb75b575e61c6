"""The engine's one worker thread, bridged to asyncio one chunk at a time.

The engine can hang (a deadlock in torch, a stuck device). ``EngineWorker.stream`` bounds how
long it waits: no chunk for ``stall_timeout_s``, or more than ``max_utterance_s`` of engine time
on one utterance, fails the request (``EngineTimeout``, an ``engine_error``) at once. A Python
thread cannot be killed: the engine's generator is asked to stop (its ``should_stop`` turns
True) and closed on its thread, and when that thread does not come back within another
``stall_timeout_s`` the worker is *wedged*: it never calls the engine again, and
``on_wedged`` tells the daemon, which exits (70) for its service manager to restart it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from s2s_daemon.tts.engine import (
    BatchEngine,
    BatchSynthesis,
    DeviceMemory,
    EngineError,
    EngineInfo,
    Samples,
    SynthesisRequest,
    TtsEngine,
)

T = TypeVar("T")

log = structlog.get_logger(__name__)


class EngineTimeout(EngineError):
    """The engine made no audio for ``tts.stall_timeout_s``, or ran past ``tts.max_utterance_s``."""


class EngineWedged(EngineError):
    """The engine thread did not come back after a request failed: no synthesis is possible."""


@dataclass(slots=True)
class _Budget:
    """Engine time one utterance may take (``tts.max_utterance_s``), shared by its sentences; and,
    for a paced one (``SynthesisRequest.paced``), how far its audio is ahead of playing time."""

    limit_s: float | None
    spent_s: float = 0.0
    """Seconds the engine thread spent in this utterance's finished runs (written by that thread)."""
    made_s: float = 0.0
    """Seconds of audio a paced utterance's steps made so far (engine thread)."""
    first_at: float | None = None
    """When its first chunk was made (monotonic; engine thread)."""

    def lead_s(self, now: float) -> float:
        """Audio made beyond what could have played since the first chunk (playback may have
        started later, never sooner: a lower bound); minus infinity before the first chunk."""
        if self.first_at is None:
            return float("-inf")
        return self.made_s - (now - self.first_at)


_utterance: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("s2s_utterance_budget", default=None)


class EngineThread(concurrent.futures.Executor):
    """One daemon thread that runs submitted calls in order.

    Unlike a ThreadPoolExecutor, whose threads end at shutdown and are joined at exit, this
    thread can be *parked* instead: MLX aborts the process at exit ("terminate called without
    an active exception") when the thread that ran it has ended, so an engine that sets
    ``park_thread_on_close`` keeps its idle thread until the process ends.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._busy_lock = threading.Lock()
        self._busy_s = 0.0
        self._running_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            started = time.monotonic()
            with self._busy_lock:
                self._running_since = started
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
                self._idle(started)
                future.set_exception(exc)
            else:
                self._idle(started)  # before the caller wakes: what it reads next is final
                future.set_result(result)

    def _idle(self, started: float) -> None:
        with self._busy_lock:
            self._busy_s += time.monotonic() - started
            self._running_since = None

    def busy_s(self) -> float:
        """Seconds spent in calls so far, the one running included (never decreases)."""
        with self._busy_lock:
            since = self._running_since
            return self._busy_s + (time.monotonic() - since if since is not None else 0.0)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("engine thread is shut down")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, park: bool = False) -> None:
        self._closed = True
        if not park:
            self._calls.put(None)
            if wait:
                self._thread.join()


STREAM_AHEAD = 8
"""Chunks the engine thread produces ahead of the consumer before it pauses."""
LEAD_S = 1.5
"""Audio a paced stream (the speaker's) must have ahead of playing time for others to share its
steps: longer than the longest step of a full batch (four 4-frame codec chunks at once, about
0.6-0.9 s on the 2-core Xeon: 4 x 4 frames x 35-54 ms, ``bench_torch``'s ``codec_ms_per_frame`` on
2 December 2026, plus the step itself). Opening (prefilling) another needs this plus the
prefill's expected time."""
OPEN_S = 1.0
"""A prefill's expected time before one was measured (then a running mean of them)."""

_END = object()
SUSPENDED_S = 0.5
"""A wait whose timeout fires this much late means the whole process was held up, not the engine."""


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Stream:
    """One utterance's chunks, from a generator on the engine thread to the event loop.

    The engine thread runs the generator ahead of the consumer until ``capacity`` chunks
    wait, then *returns* (so other engine calls, e.g. memory figures, can run) and is
    resubmitted once the consumer has taken half of them. While other streams share the thread
    (``crowded``) it takes turns with them, a chunk each; one that is not paced waits its turns
    out while a paced one is not ``LEAD_S`` ahead (``defer``). The event loop is woken only
    when it is actually waiting: a zero-cost utterance costs one hop, not one per chunk.
    Every generator operation (create, advance, close) happens on the engine thread.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[Callable[[], None]], None],
        start: Callable[[], Iterator[Samples]],
        capacity: int,
        budget: _Budget | None = None,
        crowded: Callable[[], bool] | None = None,
    ) -> None:
        self._loop = loop
        self._submit = submit
        self._start = start
        self._capacity = capacity
        self._crowded = crowded
        """True while other streams share the engine thread: give it back after every chunk."""
        self._chunks: Iterator[Samples] | None = None
        self._items: collections.deque[Samples] = collections.deque()
        self._lock = threading.Lock()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._finished = False
        self._error: BaseException | None = None
        self.closed = False
        """Set by the consumer; the engine's ``should_stop`` sees it too."""
        self.budget = budget or _Budget(None)
        self._running_since: float | None = None
        """When the engine thread entered ``produce`` (None while it is not in it)."""
        self.paced = False
        """Its request is paced (``SynthesisRequest.paced``): its chunks count toward its
        utterance's lead (``_Budget.lead_s``)."""
        self.sample_rate = 24000
        self.defer: Callable[[bool], bool] | None = None
        """Among streams taking turns, for one not paced: whether a paced one must go first now
        (True: before its first chunk, which takes a prefill)."""
        self.held = False
        """Kept from the engine for a paced stream's sake (read by the consumer: no chunk while held
        is no stall)."""
        self.active_since = 0.0
        """When it last began to run after being held (monotonic): a stall counts from then, not
        from when its consumer began to wait."""

    # -- engine thread -----------------------------------------------------------------

    def produce(self) -> None:
        """Advance the generator until the buffer is full, it ends, or the consumer left."""
        started = self._running_since = time.monotonic()
        try:
            self._produce()
        finally:
            self._running_since = None
            self.budget.spent_s += time.monotonic() - started

    def _produce(self) -> None:
        try:
            if self._chunks is None:
                if self.closed:
                    return
                if self._held_back(opening=True):
                    return
                self._chunks = iter(self._start())
            while True:
                with self._lock:
                    if self.closed:
                        return
                    if len(self._items) >= self._capacity:
                        self._paused = True
                        return
                if self._held_back(opening=False):
                    return
                chunk = next(self._chunks, _END)
                if chunk is _END:
                    self._finish(None)
                    return
                self._put(chunk)  # type: ignore[arg-type]
                if self._crowded is not None and self._crowded():
                    self._submit(self.produce)  # behind the other streams' turns
                    return
        except BaseException as exc:  # re-raised on the event loop by the consumer
            self._finish(exc)

    def release(self) -> None:
        """Close the generator (after a stop, an error or an early exit of the consumer)."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def _held_back(self, opening: bool) -> bool:
        """(Engine thread) a paced stream goes first: requeue behind it instead of running now."""
        if self.defer is None or not self.defer(opening):
            self.unhold()
            return False
        self.hold()
        self._submit(self.produce)
        return True

    def hold(self, speaker_lead_s: float | None = None) -> None:
        """Mark it kept from the engine for a paced stream's sake (logged once per hold)."""
        if not self.held:
            self.held = True
            lead = round(speaker_lead_s, 2) if speaker_lead_s is not None and speaker_lead_s > float("-inf") else None
            log.info("held_for_speaker", speaker_lead_s=lead)

    def unhold(self) -> None:
        if self.held:
            self.held = False
            self.active_since = time.monotonic()

    def waited_lately(self, stall_timeout_s: float | None) -> bool:
        """Held, or less than ``stall_timeout_s`` out of it (event loop)."""
        if self.held:
            return True
        return stall_timeout_s is not None and time.monotonic() - self.active_since < stall_timeout_s

    def runnable(self) -> bool:
        with self._lock:
            return not (self.closed or self._paused or self._finished)

    def _put(self, chunk: Samples) -> None:
        if self.paced:
            budget = self.budget
            if budget.first_at is None:
                budget.first_at = time.monotonic()
            budget.made_s += len(chunk) / self.sample_rate
        with self._lock:
            self._items.append(chunk)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._finished = True
            self._error = error
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    # -- event loop --------------------------------------------------------------------

    def engine_time_s(self) -> float:
        """Engine seconds this utterance took so far, the run in progress included."""
        running = self._running_since
        return self.budget.spent_s + (time.monotonic() - running if running is not None else 0.0)

    def _over_budget(self) -> EngineTimeout | None:
        limit = self.budget.limit_s
        if limit is not None and self.engine_time_s() >= limit:
            return EngineTimeout(
                f"the engine ran past the time limit of one utterance ({limit:g} s, tts.max_utterance_s)"
            )
        return None

    async def get(self, stall_timeout_s: float | None = None) -> Samples | None:
        """The next chunk; None at the end; re-raises the engine's exception. ``EngineTimeout``
        when no chunk comes for ``stall_timeout_s`` or the utterance is past its time limit."""
        while True:
            with self._lock:
                if self._items:
                    chunk = self._items.popleft()
                    if self._paused and len(self._items) <= self._capacity // 2:
                        self._paused = False
                        self._submit(self.produce)
                    waiter = None
                elif self._finished:
                    if self._error is not None:
                        raise self._error
                    return None
                else:
                    waiter = self._waiter = self._loop.create_future()
            if waiter is None:
                if (late := self._over_budget()) is not None:
                    raise late
                return chunk
            timeout = stall_timeout_s
            if self.budget.limit_s is not None:
                left = max(0.0, self.budget.limit_s - self.engine_time_s())
                timeout = left if timeout is None else min(timeout, left)
            deadline = None if timeout is None else self._loop.time() + timeout
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None
                    arrived = bool(self._items) or self._finished
                if arrived:  # it came just as the time ran out
                    continue
                assert deadline is not None
                if self._loop.time() - deadline > SUSPENDED_S:
                    # The event loop itself was held up (SIGSTOP, a machine asleep, starved of
                    # CPU): the engine thread was too, and is not the one to blame. Wait again.
                    log.info("engine_wait_resumed", late_s=round(self._loop.time() - deadline, 2))
                    continue
                if (late := self._over_budget()) is not None:
                    raise late from None
                raise EngineTimeout(
                    f"the engine made no audio for {stall_timeout_s:g} s (tts.stall_timeout_s)"
                ) from None

    def abort(self, error: BaseException) -> None:
        """End the stream with ``error`` from the event loop (the engine thread is gone)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._error = error
            self._items.clear()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake(waiter)

    def close(self) -> bool:
        """Stop producing; True when the generator already ended (nothing to release)."""
        with self._lock:
            self.closed = True
            self._items.clear()
            return self._finished


def _speaker_lead_s(streams: Iterable[_Stream]) -> float:
    """The least lead (``_Budget.lead_s``) of the paced ``streams`` that can make a chunk; infinity
    when there is none."""
    now = time.monotonic()
    return min((s.budget.lead_s(now) for s in streams if s.paced and s.runnable()), default=float("inf"))


class _BatchStream(_Stream):
    """A stream whose engine decodes it together with others (``_Batch``), not by a generator."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: _Batch,
        request: SynthesisRequest,
        should_stop: Callable[[], bool],
        capacity: int,
        budget: _Budget | None = None,
    ) -> None:
        super().__init__(loop, batch.submit, lambda: iter(()), capacity, budget)
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
        self.batch.leave(self)
        if self.synthesis is not None:
            self.synthesis.stop()

    def waiting_for_place(self) -> bool:
        """Joined but not opened yet: ``_Batch.size`` streams are open before it."""
        with self._lock:
            return self.joined and self.synthesis is None and not self._finished and not self.closed

    def deliver(self) -> None:
        """(Engine thread) hand on what the last step made; end the stream when its synthesis did."""
        assert self.synthesis is not None
        for chunk in self.synthesis.take():
            self._put(chunk)
        if self.synthesis.done:
            self.batch.leave(self)  # before the consumer hears of the end
            self._finish(None)
            return
        with self._lock:
            if len(self._items) >= self._capacity:
                self._paused = True


class _Batch:
    """The streams of a batching engine (``max_batch`` > 1), decoded together a frame at a time.

    Every step runs on the engine thread and is resubmitted after each frame, so other engine
    calls (memory figures, closing a stream) wait at most one step. Up to ``size`` streams are
    open at once (their KV caches live), one more opened (prefilled) per step; a later one
    waits for a place. A stream whose consumer is ``STREAM_AHEAD`` chunks behind is left out of
    the steps until it catches up.

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
        self._streams: list[_BatchStream] = []
        """Joined, in order of arrival (engine thread only)."""
        self._lock = threading.Lock()
        self._scheduled = False

    def join(self, stream: _BatchStream) -> None:
        self._streams.append(stream)

    def leave(self, stream: _BatchStream) -> None:
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
        # Open what has a place: paced streams first, one prefill per step (the streams already
        # open make their next frame in between: four requests at once, the first plays after one
        # prefill, not after four); another only when the speaker is far enough ahead.
        lead = self._speaker_lead_s()
        opened = sum(1 for s in self._streams if s.synthesis is not None and not s.closed)
        for stream in sorted(self._streams, key=lambda s: not s.paced):
            if stream.closed or stream.synthesis is not None:
                continue
            if opened >= self.size:
                break
            if not stream.paced and lead < LEAD_S + self.open_s:
                stream.hold(lead)
                break
            if self._open(stream):
                opened += 1
            break
        lead = self._speaker_lead_s()
        ready: list[_BatchStream] = []
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
            stream._running_since = started
        try:
            self.engine.step_blocking([stream.synthesis for stream in ready if stream.synthesis is not None])
        except BaseException as exc:  # every stream of the step failed with it
            for stream in ready:
                self.leave(stream)
                stream._finish(exc)
            return
        finally:
            spent = time.monotonic() - started
            for stream in ready:
                stream._running_since = None
                stream.budget.spent_s += spent
        for stream in ready:
            stream.deliver()
        if self._has_work():
            self.wake()

    def _speaker_lead_s(self) -> float:
        """The least lead (``_Budget.lead_s``) of the open paced streams that can make a frame;
        infinity when there is none (one waiting for a place holds nobody: they must finish to
        make it one)."""
        return _speaker_lead_s(s for s in self._streams if s.synthesis is not None)

    def _has_work(self) -> bool:
        """An open stream can make a frame, or a joined one can be opened."""
        opened = [stream for stream in self._streams if stream.synthesis is not None]
        if any(stream.runnable() for stream in opened):
            return True
        return len(opened) < self.size and any(s.synthesis is None and s.runnable() for s in self._streams)

    def _open(self, stream: _BatchStream) -> bool:
        started = stream._running_since = stream.active_since = time.monotonic()
        try:
            stream.synthesis = self.engine.open_blocking(stream.request, stream.should_stop)
        except BaseException as exc:  # re-raised on the event loop by the consumer
            self.leave(stream)
            stream._finish(exc)
            return False
        finally:
            took = time.monotonic() - started
            stream._running_since = None
            stream.budget.spent_s += took
        self.open_s = 0.7 * self.open_s + 0.3 * took
        stream.held = False
        return True


class EngineWorker:
    """Owns the engine and the single thread every engine call runs on.

    ``stall_timeout_s`` and ``max_utterance_s`` bound ``stream`` (None: no bound); the thread
    gets ``stall_timeout_s`` more to come back after a request failed, else the worker is
    wedged and ``on_wedged(reason)`` is called once, on the event loop.
    """

    def __init__(
        self,
        engine: TtsEngine,
        *,
        stall_timeout_s: float | None = None,
        max_utterance_s: float | None = None,
        on_wedged: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.max_utterance_s = max_utterance_s
        self.on_wedged = on_wedged
        self.wedged: str | None = None
        """Why the engine thread is given up on; None while it is healthy."""
        self._pool = EngineThread("s2s.engine")
        self._thread_ident: int | None = None
        self._active: set[_Stream] = set()
        self._batched: _Batch | bool | None = None
        """The engine's batch once known (False: it does not batch)."""
        self._watches: set[asyncio.Task[None]] = set()
        self._sample_rate = int(getattr(getattr(engine, "info", None), "sample_rate", 0) or 24000)
        """The engine's output rate (``load``): a paced stream's audio seconds from its samples."""

    def busy_s(self) -> float:
        """Seconds the engine thread spent in engine calls since it started (``s2s_engine_busy_seconds_total``)."""
        return self._pool.busy_s()

    async def _call(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn)

    async def load(self) -> EngineInfo:
        def load_blocking() -> EngineInfo:
            self._thread_ident = threading.get_ident()
            return self.engine.load_blocking()

        info = await self._call(load_blocking)
        self._sample_rate = info.sample_rate
        return info

    async def warmup(self) -> None:
        await self._call(self.engine.warmup_blocking)

    async def memory(self) -> DeviceMemory:
        return await self._call(self.engine.memory_blocking)

    @contextlib.contextmanager
    def utterance(self) -> Iterator[None]:
        """One request: every ``stream`` inside (its sentences) shares one ``max_utterance_s``
        of engine time. A ``stream`` outside has a budget of its own."""
        token = _utterance.set(_Budget(self.max_utterance_s))
        try:
            yield
        finally:
            _utterance.reset(token)

    async def stream(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> AsyncGenerator[Samples, None]:
        """Yield chunks as the engine produces them; the engine stops once ``should_stop()``.

        The engine thread runs up to ``STREAM_AHEAD`` chunks ahead of the consumer (see
        ``_Stream``). Raises ``EngineTimeout`` when the engine stalls or runs past the
        utterance's time limit, ``EngineWedged`` once the engine thread is given up on.
        """
        if self.wedged is not None:
            raise EngineWedged(self.wedged)
        loop = asyncio.get_running_loop()

        def stop() -> bool:
            return stream.closed or should_stop()

        def submit(fn: Callable[[], None]) -> None:
            self._pool.submit(fn)

        budget = _utterance.get() or _Budget(self.max_utterance_s)
        batch = self._batch()
        stream: _Stream
        if batch is not None:
            stream = _BatchStream(loop, batch, request, stop, STREAM_AHEAD, budget)
        else:
            stream = _Stream(
                loop,
                submit,
                lambda: self.engine.synthesize_blocking(request, stop),
                STREAM_AHEAD,
                budget,
                crowded=lambda: len(self._active) > 1,
            )
            if not request.paced:
                stream.defer = self._speaker_first
        stream.paced = request.paced
        stream.sample_rate = self._sample_rate
        self._active.add(stream)
        failed: EngineTimeout | None = None
        submit(stream.produce)
        try:
            while not should_stop():
                try:
                    chunk = await stream.get(self.stall_timeout_s)
                except EngineTimeout as exc:
                    if stream._over_budget() is None and stream.waited_lately(self.stall_timeout_s):
                        continue  # the batch was full, or the speaker went first: others' timeouts watch
                    if self._watches:
                        # Queued behind an earlier request's engine run that has not returned:
                        # not this one's fault. Wait for the verdict (recovered, or wedged).
                        await asyncio.wait(set(self._watches))
                        if self.wedged is not None:
                            raise EngineWedged(self.wedged) from None
                        continue
                    failed = exc
                    log.warning("engine_timeout", error=str(exc))
                    raise
                if chunk is None:
                    return
                yield chunk
        finally:
            self._active.discard(stream)
            if not stream.close():
                # Queued behind any produce() still running (submitted here, so a cancelled
                # consumer still has the generator closed on its own thread), and watched:
                # an engine thread that does not come back is wedged.
                released = asyncio.wrap_future(self._pool.submit(stream.release))
                watch = self._watch(released, failed)
                if failed is None and self.wedged is None:
                    await asyncio.shield(watch)

    def _speaker_first(self, opening: bool) -> bool:
        """(Engine thread, streams taking turns) whether a paced stream that can make a chunk is less
        than ``LEAD_S`` ahead of playing time (plus ``OPEN_S`` for a stream about to start)."""
        return _speaker_lead_s(list(self._active)) < LEAD_S + (OPEN_S if opening else 0.0)

    def _batch(self) -> _Batch | None:
        """The batch of an engine that decodes several requests together; None for one that does not."""
        if self._batched is None:
            size = int(getattr(self.engine, "max_batch", 1))
            if size > 1 and isinstance(self.engine, BatchEngine):

                def submit(fn: Callable[[], None]) -> None:
                    self._pool.submit(fn)

                self._batched = _Batch(self.engine, submit, size)
            else:
                self._batched = False
        return self._batched if isinstance(self._batched, _Batch) else None

    def _watch(self, released: asyncio.Future[None], failed: EngineTimeout | None) -> asyncio.Task[None]:
        async def watch() -> None:
            grace = self.stall_timeout_s
            done, _ = await asyncio.wait({released}, timeout=grace)
            if done:
                if not released.cancelled() and (exc := released.exception()) is not None:
                    log.warning("engine_close_failed", error=repr(exc))
                elif failed is not None:
                    log.info("engine_recovered", after=str(failed))
                return
            why = f"after {failed}" if failed is not None else "while a stream was being closed"
            self._declare_wedged(f"the engine thread did not return within {grace:g} s {why}")

        task = asyncio.get_running_loop().create_task(watch(), name="s2s.engine.watch")
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)
        return task

    def _declare_wedged(self, reason: str) -> None:
        if self.wedged is not None:
            return
        self.wedged = reason
        log.critical(
            "engine_wedged",
            reason=reason,
            consequence="no more synthesis in this process: the daemon exits for its service manager to restart it",
        )
        if self.on_wedged is not None:
            try:
                self.on_wedged(reason)
            except Exception:  # the streams below must still be woken
                log.exception("engine_wedged_handler_failed")
        for stream in list(self._active):  # waiting on the thread that will not come back
            stream.abort(EngineWedged(reason))

    async def close(self) -> None:
        if self.wedged is not None:
            # Its thread is stuck inside the engine: a close would queue behind it forever.
            log.warning("engine_not_closed", reason=self.wedged)
            self._pool.shutdown(wait=False, park=True)
            return
        try:
            await self._call(self.engine.close_blocking)
        finally:
            self._pool.shutdown(wait=False, park=bool(getattr(self.engine, "park_thread_on_close", False)))
