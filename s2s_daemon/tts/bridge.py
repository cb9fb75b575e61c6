"""The engine's one thread, and the stream that carries one utterance's chunks from it to asyncio.

Inference never runs on the event loop: every engine call runs on ``EngineThread``, and a
``ChunkStream`` pulls a synthesis generator there one chunk at a time, a bounded number ahead of
its consumer. Its ``get`` raises ``EngineTimeout`` on a stall or a spent budget (``watch.py``).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import structlog

from s2s_daemon.tts.engine import Samples
from s2s_daemon.tts.watch import EngineTimeout, UtteranceBudget

T = TypeVar("T")

log = structlog.get_logger(__name__)

STREAM_AHEAD = 8
"""Chunks the engine thread produces ahead of the consumer before it pauses."""
SUSPENDED_S = 0.5
"""A wait whose timeout fires this much late means the whole process was held up, not the engine."""

BUDGET_WAIT_S = 0.005
"""The shortest wait for what is left of an utterance's time limit: a stream queued for the engine
thread spends none of it, and is not polled faster than this."""

_END = object()


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


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ChunkStream(abc.ABC):
    """One utterance's chunks, from the engine thread to the event loop: what the engine made
    waits here (at most ``capacity`` chunks ahead of the consumer) until the consumer takes it.

    How the engine makes them is the subclass's: a generator pulled on the engine thread
    (``GeneratorStream``) or a batch's steps (``scheduler.BatchStream``). The engine thread runs
    ``produce`` until ``capacity`` chunks wait, then *returns* (so other engine calls, e.g. memory
    figures, can run) and is resubmitted once the consumer has taken half of them. The event loop
    is woken only when it is actually waiting: a zero-cost utterance costs one hop, not one per chunk.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[Callable[[], None]], None],
        capacity: int,
        budget: UtteranceBudget | None = None,
        *,
        paced: bool = False,
        sample_rate: int = 24000,
    ) -> None:
        self._loop = loop
        self._submit = submit
        self._capacity = capacity
        self._items: collections.deque[Samples] = collections.deque()
        self._lock = threading.Lock()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._finished = False
        self._error: BaseException | None = None
        self.closed = False
        """Set by the consumer; the engine's ``should_stop`` sees it too."""
        self.budget = budget or UtteranceBudget(None)
        self._running_since: float | None = None
        """When the engine thread entered ``produce`` (None while it is not in it)."""
        self.paced = paced
        """Its request is paced (``SynthesisRequest.paced``): its chunks count toward its
        utterance's lead (``UtteranceBudget.lead_s``)."""
        self.sample_rate = sample_rate
        """Hertz of its chunks: a paced stream's audio seconds from its samples."""
        self.held = False
        """Kept from the engine for a paced stream's sake (read by the consumer: no chunk while held
        is no stall)."""
        self.active_since = 0.0
        """When it last began to run after being held (monotonic): a stall counts from then, not
        from when its consumer began to wait."""

    # -- engine thread -----------------------------------------------------------------

    @abc.abstractmethod
    def produce(self) -> None:
        """(Engine thread) make chunks until the buffer is full, the utterance ends, or the consumer left."""

    @abc.abstractmethod
    def release(self) -> None:
        """(Engine thread) let go of what makes its chunks (after a stop, an error or an early exit
        of the consumer)."""

    def begin_run(self, at: float) -> None:
        """(Engine thread) an engine run for it began ``at`` (monotonic): ``engine_time_s`` counts it."""
        self._running_since = at

    def end_run(self, at: float) -> None:
        """(Engine thread) the run ended ``at``: its time is spent from the utterance's budget."""
        since, self._running_since = self._running_since, None
        if since is not None:
            self.budget.spent_s += at - since

    def hold(self, speaker_lead_s: float | None = None) -> None:
        """Mark it kept from the engine for a paced stream's sake (logged once per hold)."""
        if not self.held:
            self.held = True
            lead = round(speaker_lead_s, 2) if speaker_lead_s is not None and speaker_lead_s > float("-inf") else None
            log.info("held_for_speaker", speaker_lead_s=lead)

    def unhold(self) -> None:
        """Mark it back in the engine's runs: a stall counts from now."""
        if self.held:
            self.held = False
            self.active_since = time.monotonic()

    def activate(self, at: float) -> None:
        """No longer held, and a stall counts from ``at`` (monotonic): it is being started now."""
        self.held = False
        self.active_since = at

    def waited_lately(self, stall_timeout_s: float | None) -> bool:
        """Held, or less than ``stall_timeout_s`` out of it (event loop)."""
        if self.held:
            return True
        return stall_timeout_s is not None and time.monotonic() - self.active_since < stall_timeout_s

    def runnable(self) -> bool:
        with self._lock:
            return not (self.closed or self._paused or self._finished)

    def ended(self) -> bool:
        """Finished (its end, or an error) or closed by its consumer."""
        with self._lock:
            return self._finished or self.closed

    def pause_if_full(self) -> None:
        """(Engine thread) leave it out of the runs while ``capacity`` chunks wait for the consumer."""
        with self._lock:
            if len(self._items) >= self._capacity:
                self._paused = True

    def put(self, chunk: Samples) -> None:
        """(Engine thread) hand on a chunk; wake the consumer if it waits."""
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

    def finish(self, error: BaseException | None) -> None:
        """(Engine thread) end the stream: at its end (None) or with ``error``, re-raised by ``get``."""
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

    def over_budget(self) -> EngineTimeout | None:
        """The error once its utterance ran past ``tts.max_utterance_s``; None within it."""
        return self.budget.over(self.engine_time_s())

    async def get(self, stall_timeout_s: float | None = None) -> Samples | None:
        """The next chunk; None at the end; re-raises the engine's exception. ``EngineTimeout``
        when no chunk comes for ``stall_timeout_s`` or the utterance is past its time limit.

        The time limit counts engine time only: a wait cut short by what is left of it ends in
        an error only when the engine did spend it; one queued for the engine thread waits on
        (up to ``stall_timeout_s`` in all)."""
        stall_at = None if stall_timeout_s is None else self._loop.time() + stall_timeout_s
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
                if (late := self.over_budget()) is not None:
                    raise late
                return chunk
            deadline = stall_at
            if self.budget.limit_s is not None:
                left = max(BUDGET_WAIT_S, self.budget.limit_s - self.engine_time_s())
                at = self._loop.time() + left
                deadline = at if deadline is None else min(deadline, at)
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
                now = self._loop.time()
                if now - deadline > SUSPENDED_S:
                    # The event loop itself was held up (SIGSTOP, a machine asleep, starved of
                    # CPU): the engine thread was too, and is not the one to blame. Wait again.
                    log.info("engine_wait_resumed", late_s=round(now - deadline, 2))
                    stall_at = None if stall_timeout_s is None else now + stall_timeout_s
                    continue
                if (late := self.over_budget()) is not None:
                    raise late from None
                if stall_at is None or now < stall_at:
                    continue  # the time limit's share ran out while the engine had not run it
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


class GeneratorStream(ChunkStream):
    """An utterance whose engine yields its chunks from a generator, pulled on the engine thread.

    While other streams share the thread (``crowded``) it takes turns with them, a chunk each; one
    that is not paced waits its turns out while ``defer`` says a paced one goes first
    (``scheduler.py``). Every generator operation (create, advance, close) happens on the engine
    thread.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[Callable[[], None]], None],
        start: Callable[[], Iterator[Samples]],
        capacity: int,
        budget: UtteranceBudget | None = None,
        *,
        crowded: Callable[[], bool] | None = None,
        defer: Callable[[bool], bool] | None = None,
        paced: bool = False,
        sample_rate: int = 24000,
    ) -> None:
        super().__init__(loop, submit, capacity, budget, paced=paced, sample_rate=sample_rate)
        self._start = start
        self._crowded = crowded
        """True while other streams share the engine thread: give it back after every chunk."""
        self._chunks: Iterator[Samples] | None = None
        self._defer = defer
        """Among streams taking turns, for one not paced: whether a paced one must go first now
        (True: before its first chunk, which takes a prefill)."""

    def produce(self) -> None:
        """Advance the generator until the buffer is full, it ends, or the consumer left."""
        self.begin_run(time.monotonic())
        try:
            self._produce()
        finally:
            self.end_run(time.monotonic())

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
                    self.finish(None)
                    return
                self.put(chunk)  # type: ignore[arg-type]
                if self._crowded is not None and self._crowded():
                    self._submit(self.produce)  # behind the other streams' turns
                    return
        except BaseException as exc:  # re-raised on the event loop by the consumer
            self.finish(exc)

    def release(self) -> None:
        """Close the generator (after a stop, an error or an early exit of the consumer)."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def _held_back(self, opening: bool) -> bool:
        """(Engine thread) a paced stream goes first: requeue behind it instead of running now."""
        if self._defer is None or not self._defer(opening):
            self.unhold()
            return False
        self.hold()
        self._submit(self.produce)
        return True
