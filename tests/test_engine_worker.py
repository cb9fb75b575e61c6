"""EngineWorker.stream: the engine thread runs ahead (bounded), pauses so other calls can
run, hands over errors, and closes the generator on its own thread when the consumer leaves."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from s2s_daemon.tts.bridge import STREAM_AHEAD
from s2s_daemon.tts.engine import DeviceMemory, EngineError, ShouldStop, SynthesisRequest
from s2s_daemon.tts.worker import EngineWorker
from tests.support.wait import until

pytestmark = pytest.mark.timeout(30)


class CountingEngine:
    """Yields ``chunks`` numbered chunks; records threads, progress and closing."""

    def __init__(self, chunks: int, fail_at: int | None = None) -> None:
        self.chunks = chunks
        self.fail_at = fail_at
        self.produced = 0
        self.threads: set[int] = set()
        self.closed_on: int | None = None
        self.stopped = False
        self.memory_calls = 0

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[np.ndarray]:
        try:
            for i in range(self.chunks):
                self.threads.add(threading.get_ident())
                if should_stop():
                    self.stopped = True
                    return
                if i == self.fail_at:
                    raise EngineError("failed on purpose")
                self.produced += 1
                yield np.full(4, i, dtype=np.float32)
        finally:
            self.closed_on = threading.get_ident()

    def memory_blocking(self) -> DeviceMemory:
        self.memory_calls += 1
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        return None


REQUEST = SynthesisRequest(text="x", voice=None, language="auto")


async def test_all_chunks_arrive_in_order_from_one_engine_thread() -> None:
    engine = CountingEngine(3 * STREAM_AHEAD + 1)
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    got = [int(chunk[0]) async for chunk in worker.stream(REQUEST, lambda: False)]
    assert got == list(range(engine.chunks))
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
    await worker.close()


async def test_the_engine_pauses_when_the_consumer_lags_and_other_calls_run_meanwhile() -> None:
    engine = CountingEngine(10 * STREAM_AHEAD)
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    stream = worker.stream(REQUEST, lambda: False)
    first = await anext(stream)
    assert int(first[0]) == 0
    # The consumer holds still: the engine stops STREAM_AHEAD chunks ahead ...
    await until(lambda: engine.produced >= STREAM_AHEAD, 5, "the chunks ahead made")
    # ... and its thread is free for other calls (the memory event) in the meantime: had it gone
    # on making chunks, this call would have waited behind all of them.
    await asyncio.wait_for(worker.memory(), 2)
    assert engine.memory_calls == 1
    assert engine.produced <= STREAM_AHEAD + 1
    rest = [int(chunk[0]) async for chunk in stream]
    assert rest == list(range(1, engine.chunks))
    await worker.close()


async def test_an_engine_error_reaches_the_consumer_after_the_chunks_before_it() -> None:
    engine = CountingEngine(10, fail_at=5)
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    got: list[int] = []
    with pytest.raises(EngineError, match="on purpose"):
        async for chunk in worker.stream(REQUEST, lambda: False):
            got.append(int(chunk[0]))
    assert got == [0, 1, 2, 3, 4]
    await worker.close()


async def test_a_consumer_that_leaves_early_has_the_generator_closed_on_the_engine_thread() -> None:
    engine = CountingEngine(10 * STREAM_AHEAD)
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    stream = worker.stream(REQUEST, lambda: False)
    await anext(stream)
    await stream.aclose()
    assert engine.closed_on in engine.threads
    assert engine.produced < engine.chunks
    await worker.close()


async def test_should_stop_ends_the_stream_and_the_engine_sees_it() -> None:
    stop = threading.Event()
    engine = CountingEngine(1000)
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    got = 0
    async for _ in worker.stream(REQUEST, stop.is_set):
        got += 1
        if got == 3:
            stop.set()
    assert got == 3
    assert engine.closed_on in engine.threads
    assert engine.produced < 1000
    await worker.close()


class TaggedEngine:
    """Yields ``chunks`` chunks per request, 10 ms each, and records the order it made them in."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.made: list[str] = []

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[np.ndarray]:
        for _ in range(self.chunks):
            if should_stop():
                return
            time.sleep(0.01)  # the engine's work: the second stream starts while the first makes its first chunk
            self.made.append(request.text)
            yield np.zeros(4, dtype=np.float32)

    def close_blocking(self) -> None:
        return None


async def test_streams_sharing_the_engine_thread_take_turns() -> None:
    """An engine that does not batch: concurrent streams whose readers keep up still advance
    together, a chunk each in turn, not one stream to its end and then the next."""
    engine = TaggedEngine(STREAM_AHEAD)
    worker = EngineWorker(engine)  # type: ignore[arg-type]

    async def read(text: str) -> int:
        request = SynthesisRequest(text=text, voice=None, language="auto")
        return len([chunk async for chunk in worker.stream(request, lambda: False)])

    assert await asyncio.gather(read("a"), read("b")) == [STREAM_AHEAD, STREAM_AHEAD]
    assert engine.made.index("b") <= 2, engine.made  # b's first chunk came right after a's first
    assert engine.made[: 2 * STREAM_AHEAD - 2].count("a") <= STREAM_AHEAD - 1
