"""``EngineWorker``: the engine, the one thread every call to it runs on, and its streams.

Inference never runs on the event loop: ``stream`` bridges a synthesis to asyncio one chunk at a
time (``bridge.py``), serving the speaker first and batching where the engine can
(``scheduler.py``), and bounds how long it waits: a stalled or wedged engine fails the request
and, when its thread does not come back, the daemon (``watch.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TypeVar

import structlog

from s2s_daemon.pipeline.vocabulary import model_name
from s2s_daemon.tts.bridge import STREAM_AHEAD, ChunkStream, EngineThread, GeneratorStream
from s2s_daemon.tts.engine import (
    BatchEngine,
    DeviceMemory,
    EngineInfo,
    Samples,
    SynthesisRequest,
    TtsEngine,
    engine_traits,
)
from s2s_daemon.tts.scheduler import Batch, BatchStream, speaker_first
from s2s_daemon.tts.watch import EngineTimeout, EngineWatch, EngineWedged, UtteranceBudget, current_utterance

__all__ = ["EngineWorker"]

T = TypeVar("T")

log = structlog.get_logger(__name__)


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
        self._watch = EngineWatch(stall_timeout_s, on_wedged)
        self._pool = EngineThread("s2s.engine")
        self._thread_ident: int | None = None
        self._active: set[ChunkStream] = set()
        self._batched: Batch | bool | None = None
        """The engine's batch once known (False: it does not batch)."""
        self._sample_rate = engine_traits(engine).sample_rate or 24000
        """The engine's output rate (``load``): a paced stream's audio seconds from its samples."""

    @property
    def wedged(self) -> str | None:
        """Why the engine thread is given up on; None while it is healthy."""
        return self._watch.wedged

    @wedged.setter
    def wedged(self, reason: str | None) -> None:
        self._watch.wedged = reason

    @property
    def on_wedged(self) -> Callable[[str], None] | None:
        """Called once, on the event loop, when the engine thread is given up on."""
        return self._watch.on_wedged

    @on_wedged.setter
    def on_wedged(self, handler: Callable[[str], None] | None) -> None:
        self._watch.on_wedged = handler

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
        # One name for the model everywhere (info, metrics, events, the page, /v1/models, Home
        # Assistant): a hub id as is, a local checkpoint by its folder's name, never its path.
        return dataclasses.replace(info, model=model_name(info.model))

    async def warmup(self) -> None:
        await self._call(self.engine.warmup_blocking)

    async def memory(self) -> DeviceMemory:
        return await self._call(self.engine.memory_blocking)

    @contextlib.contextmanager
    def utterance(self) -> Iterator[None]:
        """One request: every ``stream`` inside (its sentences) shares one ``max_utterance_s``
        of engine time. A ``stream`` outside has a budget of its own."""
        token = current_utterance.set(UtteranceBudget(self.max_utterance_s))
        try:
            yield
        finally:
            current_utterance.reset(token)

    async def stream(self, request: SynthesisRequest, should_stop: Callable[[], bool]) -> AsyncGenerator[Samples, None]:
        """Yield chunks as the engine produces them; the engine stops once ``should_stop()``.

        The engine thread runs up to ``STREAM_AHEAD`` chunks ahead of the consumer (see
        ``ChunkStream``). Raises ``EngineTimeout`` when the engine stalls or runs past the
        utterance's time limit, ``EngineWedged`` once the engine thread is given up on.
        """
        if self.wedged is not None:
            raise EngineWedged(self.wedged)
        loop = asyncio.get_running_loop()

        def stop() -> bool:
            return stream.closed or should_stop()

        def submit(fn: Callable[[], None]) -> None:
            self._pool.submit(fn)

        budget = current_utterance.get() or UtteranceBudget(self.max_utterance_s)
        batch = self._batch()
        stream: ChunkStream
        if batch is not None:
            stream = BatchStream(loop, batch, request, stop, STREAM_AHEAD, budget, sample_rate=self._sample_rate)
        else:
            stream = GeneratorStream(
                loop,
                submit,
                lambda: self.engine.synthesize_blocking(request, stop),
                STREAM_AHEAD,
                budget,
                crowded=lambda: len(self._active) > 1,
                defer=None if request.paced else self._speaker_first,
                paced=request.paced,
                sample_rate=self._sample_rate,
            )
        self._active.add(stream)
        failed: EngineTimeout | None = None
        submit(stream.produce)
        try:
            while not should_stop():
                try:
                    chunk = await stream.get(self.stall_timeout_s)
                except EngineTimeout as exc:
                    if stream.over_budget() is None and stream.waited_lately(self.stall_timeout_s):
                        continue  # the batch was full, or the speaker went first: others' timeouts watch
                    if self._watch.pending():
                        # Queued behind an earlier request's engine run that has not returned:
                        # not this one's fault. Wait for the verdict (recovered, or wedged).
                        await self._watch.verdict()
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
                watch = self._watch.watch(released, failed, lambda: list(self._active))
                if failed is None and self.wedged is None:
                    await asyncio.shield(watch)

    def _speaker_first(self, opening: bool) -> bool:
        """(Engine thread, streams taking turns) whether a paced stream that can make a chunk is less
        than ``LEAD_S`` ahead of playing time (plus ``OPEN_S`` for a stream about to start)."""
        return speaker_first(list(self._active), opening)

    def _batch(self) -> Batch | None:
        """The batch of an engine that decodes several requests together; None for one that does not."""
        if self._batched is None:
            size = engine_traits(self.engine).max_batch
            if size > 1 and isinstance(self.engine, BatchEngine):

                def submit(fn: Callable[[], None]) -> None:
                    self._pool.submit(fn)

                self._batched = Batch(self.engine, submit, size)
            else:
                self._batched = False
        return self._batched if isinstance(self._batched, Batch) else None

    async def close(self) -> None:
        if self.wedged is not None:
            # Its thread is stuck inside the engine: a close would queue behind it forever.
            log.warning("engine_not_closed", reason=self.wedged)
            self._pool.shutdown(wait=False, park=True)
            return
        try:
            await self._call(self.engine.close_blocking)
        finally:
            self._pool.shutdown(wait=False, park=engine_traits(self.engine).park_thread_on_close)
