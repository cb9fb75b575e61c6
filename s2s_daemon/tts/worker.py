"""The engine's one worker thread, bridged to asyncio one chunk at a time."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, TypeVar

from s2s_daemon.tts.engine import DeviceMemory, EngineInfo, Samples, SynthesisRequest, TtsEngine

T = TypeVar("T")


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
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
                future.set_exception(exc)

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

_END = object()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Stream:
    """One utterance's chunks, from a generator on the engine thread to the event loop.

    The engine thread runs the generator ahead of the consumer until ``capacity`` chunks
    wait, then *returns* (so other engine calls, e.g. memory figures, can run) and is
    resubmitted once the consumer has taken half of them. The event loop is woken only
    when it is actually waiting: a zero-cost utterance costs one hop, not one per chunk.
    Every generator operation (create, advance, close) happens on the engine thread.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[Callable[[], None]], None],
        start: Callable[[], Iterator[Samples]],
        capacity: int,
    ) -> None:
        self._loop = loop
        self._submit = submit
        self._start = start
        self._capacity = capacity
        self._chunks: Iterator[Samples] | None = None
        self._items: collections.deque[Samples] = collections.deque()
        self._lock = threading.Lock()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._finished = False
        self._error: BaseException | None = None
        self.closed = False
        """Set by the consumer; the engine's ``should_stop`` sees it too."""

    # -- engine thread -----------------------------------------------------------------

    def produce(self) -> None:
        """Advance the generator until the buffer is full, it ends, or the consumer left."""
        try:
            if self._chunks is None:
                if self.closed:
                    return
                self._chunks = iter(self._start())
            while True:
                with self._lock:
                    if self.closed:
                        return
                    if len(self._items) >= self._capacity:
                        self._paused = True
                        return
                chunk = next(self._chunks, _END)
                if chunk is _END:
                    self._finish(None)
                    return
                self._put(chunk)  # type: ignore[arg-type]
        except BaseException as exc:  # re-raised on the event loop by the consumer
            self._finish(exc)

    def release(self) -> None:
        """Close the generator (after a stop, an error or an early exit of the consumer)."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def _put(self, chunk: Samples) -> None:
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

    async def get(self) -> Samples | None:
        """The next chunk; None at the end; re-raises the engine's exception."""
        while True:
            with self._lock:
                if self._items:
                    chunk = self._items.popleft()
                    if self._paused and len(self._items) <= self._capacity // 2:
                        self._paused = False
                        self._submit(self.produce)
                    return chunk
                if self._finished:
                    if self._error is not None:
                        raise self._error
                    return None
                waiter = self._waiter = self._loop.create_future()
            await waiter

    def close(self) -> bool:
        """Stop producing; True when the generator already ended (nothing to release)."""
        with self._lock:
            self.closed = True
            self._items.clear()
            return self._finished


class EngineWorker:
    """Owns the engine and the single thread every engine call runs on."""

    def __init__(self, engine: TtsEngine) -> None:
        self.engine = engine
        self._pool = EngineThread("s2s.engine")
        self._thread_ident: int | None = None

    async def _call(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn)

    async def load(self) -> EngineInfo:
        def load_blocking() -> EngineInfo:
            self._thread_ident = threading.get_ident()
            return self.engine.load_blocking()

        return await self._call(load_blocking)

    async def warmup(self) -> None:
        await self._call(self.engine.warmup_blocking)

    async def memory(self) -> DeviceMemory:
        return await self._call(self.engine.memory_blocking)

    async def stream(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> AsyncGenerator[Samples, None]:
        """Yield chunks as the engine produces them; the engine stops once ``should_stop()``.

        The engine thread runs up to ``STREAM_AHEAD`` chunks ahead of the consumer (see
        ``_Stream``).
        """
        loop = asyncio.get_running_loop()

        def stop() -> bool:
            return stream.closed or should_stop()

        def submit(fn: Callable[[], None]) -> None:
            self._pool.submit(fn)

        stream = _Stream(loop, submit, lambda: self.engine.synthesize_blocking(request, stop), STREAM_AHEAD)
        submit(stream.produce)
        try:
            while not should_stop():
                chunk = await stream.get()
                if chunk is None:
                    return
                yield chunk
        finally:
            if not stream.close():
                # Queued behind any produce() still running; shielded so a cancelled
                # consumer still has the generator closed on its own thread.
                await asyncio.shield(self._call(stream.release))

    async def close(self) -> None:
        try:
            await self._call(self.engine.close_blocking)
        finally:
            self._pool.shutdown(wait=False, park=bool(getattr(self.engine, "park_thread_on_close", False)))
