"""The engine's one worker thread, bridged to asyncio one chunk at a time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from s2s_daemon.tts.engine import DeviceMemory, EngineInfo, Samples, SynthesisRequest, TtsEngine

T = TypeVar("T")


class Generation:
    """A cancel scope: bumping the counter stops whatever was started under an older value.

    Read from the engine thread without a lock: an int read is atomic in CPython.
    """

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> int:
        self.value += 1
        return self.value

    def stopper(self) -> Callable[[], bool]:
        started = self.value
        return lambda: self.value != started


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

    async def stream(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> AsyncIterator[Samples]:
        """Yield chunks as the engine produces them; stops pulling once ``should_stop()``.

        The generator object is created, advanced and closed on the engine thread.
        """
        holder: list[Iterator[Samples]] = []

        exhausted = False

        def next_blocking() -> Samples | None:
            nonlocal exhausted
            if not holder:  # the first pull also starts the generator: one thread hop, not two
                holder.append(iter(self.engine.synthesize_blocking(request, should_stop)))
            chunk = next(holder[0], None)
            exhausted = chunk is None
            return chunk

        def close_blocking() -> None:
            close = getattr(holder[0], "close", None) if holder else None
            if close is not None:
                close()

        try:
            while not should_stop():
                chunk = await self._call(next_blocking)
                if chunk is None:
                    return
                yield chunk
        finally:
            if holder and not exhausted:  # an exhausted generator has nothing to release
                # Shielded so a cancelled consumer still releases the generator on its own thread.
                await asyncio.shield(self._call(close_blocking))

    async def close(self) -> None:
        try:
            await self._call(self.engine.close_blocking)
        finally:
            self._pool.shutdown(wait=False, park=bool(getattr(self.engine, "park_thread_on_close", False)))
