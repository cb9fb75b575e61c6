"""An engine that hangs: EngineWorker.stream's stall timeout and per-utterance time limit, the
wedged engine thread, the TTS stage's one terminal event, and the systemd watchdog."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from s2s_daemon.app import Daemon
from s2s_daemon.audio.sink import DiscardSink
from s2s_daemon.config import load_config
from s2s_daemon.pipeline.messages import SayRequest, Status
from s2s_daemon.tts.engine import DeviceMemory, EngineOptions, ShouldStop, SynthesisRequest
from s2s_daemon.tts.watch import EngineTimeout, EngineWedged
from s2s_daemon.tts.worker import EngineWorker
from s2s_daemon.wiring import build_stages
from tests.support.tone_engine import ToneEngine
from tests.support.wait import until

pytestmark = pytest.mark.timeout(30)

REQUEST = SynthesisRequest(text="x", voice=None, language="auto")


class HangingEngine:
    """Yields ``before`` chunks, then blocks in ``hang`` (ignoring ``should_stop``, as a stuck
    device would) until ``release`` is set, then yields ``after`` more unless told to stop;
    ``chunk_s`` is the engine time each chunk costs."""

    def __init__(self, before: int = 2, after: int = 2, chunk_s: float = 0.0, hang: bool = True) -> None:
        self.before = before
        self.after = after
        self.chunk_s = chunk_s
        self.hang = hang
        self.release = threading.Event()
        self.hanging = threading.Event()
        self.calls = 0
        self.stopped = False
        self.closed = False

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[np.ndarray]:
        self.calls += 1
        for i in range(self.before + self.after):
            if i == self.before and self.hang:
                self.hanging.set()
                self.release.wait()
            if should_stop():
                self.stopped = True
                return
            if self.chunk_s:
                time.sleep(self.chunk_s)  # the engine's work for a chunk: the behaviour under test
            yield np.full(4, i, dtype=np.float32)

    def memory_blocking(self) -> DeviceMemory:
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        self.closed = True


async def test_a_stalled_engine_fails_the_stream_and_a_recovered_one_serves_the_next() -> None:
    engine = HangingEngine()
    wedged: list[str] = []
    worker = EngineWorker(engine, stall_timeout_s=0.4, on_wedged=wedged.append)  # type: ignore[arg-type]
    got: list[int] = []
    began = time.monotonic()
    with pytest.raises(EngineTimeout, match=r"made no audio for 0\.4 s \(tts\.stall_timeout_s\)"):
        async for chunk in worker.stream(REQUEST, lambda: False):
            got.append(int(chunk[0]))
    took = time.monotonic() - began
    assert got == [0, 1]  # what came before the stall
    assert 0.35 < took < 1.5, took  # failed at the stall, not after the grace
    engine.release.set()  # the device comes back within the grace: the engine sees the stop
    await until(lambda: not worker._watch.pending(), what="the watch's verdict")
    assert engine.stopped
    assert worker.wedged is None and wedged == []
    engine.hang = False
    again = [int(c[0]) async for c in worker.stream(REQUEST, lambda: False)]
    assert again == [0, 1, 2, 3]
    await worker.close()
    assert engine.closed


async def test_an_engine_thread_that_never_returns_wedges_the_worker_once() -> None:
    engine = HangingEngine()
    wedged: list[str] = []
    worker = EngineWorker(engine, stall_timeout_s=0.3, on_wedged=wedged.append)  # type: ignore[arg-type]
    try:
        with pytest.raises(EngineTimeout):
            async for _ in worker.stream(REQUEST, lambda: False):
                pass
        assert worker.wedged is None  # the grace is still running
        await until(lambda: not worker._watch.pending(), what="the watch's verdict")
        assert worker.wedged is not None and "did not return within 0.3 s" in worker.wedged
        assert wedged == [worker.wedged]  # told once
        calls = engine.calls
        with pytest.raises(EngineWedged):  # at once: the stuck thread is never asked again
            await asyncio.wait_for(anext(worker.stream(REQUEST, lambda: False)), 0.2)
        assert engine.calls == calls
        await asyncio.wait_for(worker.close(), 1)  # does not queue behind the stuck thread
        assert not engine.closed
    finally:
        engine.release.set()


@pytest.mark.slow
async def test_a_stream_waiting_behind_the_stuck_thread_ends_when_it_is_declared_wedged() -> None:
    engine = HangingEngine()
    worker = EngineWorker(engine, stall_timeout_s=0.5)  # type: ignore[arg-type]
    try:
        with pytest.raises(EngineTimeout):
            async for _ in worker.stream(REQUEST, lambda: False):
                pass
        began = time.monotonic()
        with pytest.raises(EngineWedged):  # queued behind the stuck produce(): woken by the wedge
            async for _ in worker.stream(REQUEST, lambda: False):
                pass
        assert time.monotonic() - began < 0.5 + 0.4
    finally:
        engine.release.set()
        await until(lambda: engine.stopped, what="the stuck call returned")


async def test_time_waiting_for_the_consumer_is_not_a_stall_nor_engine_time() -> None:
    engine = HangingEngine(before=20, after=0, hang=False)
    worker = EngineWorker(engine, stall_timeout_s=0.1, max_utterance_s=0.2)  # type: ignore[arg-type]
    got = []
    async for chunk in worker.stream(REQUEST, lambda: False):
        got.append(int(chunk[0]))
        await asyncio.sleep(0.03)  # the behaviour under test: playback back-pressure, 0.6 s in all
    assert got == list(range(20))
    await worker.close()


async def test_the_utterance_time_limit_counts_engine_time_over_all_its_sentences() -> None:
    engine = HangingEngine(before=1000, after=0, chunk_s=0.02, hang=False)  # never ends by itself
    worker = EngineWorker(engine, stall_timeout_s=5, max_utterance_s=0.5)  # type: ignore[arg-type]
    chunks = 0
    began = time.monotonic()
    with worker.utterance(), pytest.raises(EngineTimeout, match=r"time limit of one utterance \(0\.5 s"):
        first = worker.stream(REQUEST, lambda: False)
        for _ in range(10):  # a first sentence of ~0.2 s
            await anext(first)
            chunks += 1
        await first.aclose()
        async for _ in worker.stream(REQUEST, lambda: False):  # the second has what is left
            chunks += 1
    took = time.monotonic() - began
    assert 0.45 < took < 1.5, took
    assert 15 < chunks < 30, chunks
    await until(lambda: not worker._watch.pending(), what="the watch's verdict")
    assert worker.wedged is None  # the engine was told to stop and returned: nothing wedged
    # A new utterance has a budget of its own.
    with worker.utterance():
        stream = worker.stream(REQUEST, lambda: False)
        assert int((await anext(stream))[0]) == 0
        await stream.aclose()
    await worker.close()


async def test_a_time_limit_shorter_than_the_wait_for_the_engine_thread_is_not_a_stall() -> None:
    """A stream queued behind another engine call spends none of its time limit while it waits:
    it fails when its own engine time runs out, with the time limit's error (it failed with the
    stall's at once when the limit was shorter than the wait for the thread)."""
    engine = HangingEngine(before=1000, after=0, chunk_s=0.02, hang=False)  # never ends by itself
    worker = EngineWorker(engine, stall_timeout_s=5, max_utterance_s=0.1)  # type: ignore[arg-type]
    busy = threading.Event()
    worker._pool.submit(lambda: (busy.set(), time.sleep(0.4)))  # the thread busy with another call
    busy.wait()
    began = time.monotonic()
    chunks = 0
    with pytest.raises(EngineTimeout, match=r"time limit of one utterance \(0\.1 s"):
        async for _ in worker.stream(REQUEST, lambda: False):
            chunks += 1
    took = time.monotonic() - began
    assert 0.45 < took < 3, took  # the wait for the thread, then its own 0.1 s
    assert chunks >= 1
    await until(lambda: not worker._watch.pending(), what="the watch's verdict")
    assert worker.wedged is None
    await worker.close()


async def test_the_stage_answers_a_hung_request_once_and_serves_the_next(tmp_path: Path) -> None:
    """Through the TTS stage and the ledger: the hung request ends ``error`` / ``engine_error``
    once, with the message; the one after it completes."""
    from s2s_daemon.pipeline.jobs import Job

    config = load_config(None, environ={"S2S_TTS__ENGINE": "tone", "S2S_TTS__STALL_TIMEOUT_S": "0.4"})
    engine = ToneEngine(EngineOptions(model="tone", extra={"speed": "0"}))
    worker = EngineWorker(engine, stall_timeout_s=config.tts.stall_timeout_s, max_utterance_s=10)
    info = await worker.load()
    finished: list[Job] = []

    class Events:
        def started(self, job: Job) -> None:
            pass

        def finished(self, job: Job) -> None:
            finished.append(job)

        def state_changed(self) -> None:
            pass

    stages = build_stages(config, worker, info, DiscardSink(), Events())
    runner = asyncio.create_task(stages.run())
    try:
        for rid, text in (("hung", "a sentence that stalls #stall=0.6 here"), ("next", "and then this one")):
            job = stages.ledger.submit(
                SayRequest(id=rid, text=text, voice="Ryan", language="english", site_id="kitchen")
            )
            assert job.status is None
        await asyncio.wait_for(asyncio.gather(*(j.done.wait() for j in list(stages.ledger.jobs.values()))), 10)
        by_id = {j.request.id: j for j in finished}
        assert len(finished) == 2 and set(by_id) == {"hung", "next"}
        hung = by_id["hung"]
        assert hung.status is Status.ERROR and hung.error is not None
        assert hung.error.code == "engine_error" and "no audio for 0.4 s" in hung.error.message
        assert hung.timeline.chunks >= 1  # the chunk before the stall was made (and played)
        assert by_id["next"].status is Status.COMPLETED
        assert worker.wedged is None
    finally:
        stages.ledger.close()
        await asyncio.wait_for(runner, 5)
        await worker.close()


class Notifier:
    watchdog_interval_s = 0.04

    def __init__(self) -> None:
        self.pings = 0

    def watchdog(self) -> None:
        self.pings += 1


async def test_the_watchdog_is_not_pinged_once_the_engine_is_wedged() -> None:
    notifier = Notifier()
    daemon = Daemon(load_config(None, environ={}), notifier=notifier)  # type: ignore[arg-type]
    worker = EngineWorker(HangingEngine())  # type: ignore[arg-type]
    task = asyncio.create_task(daemon._watchdog(worker))
    await until(lambda: notifier.pings >= 3, what="pings while healthy")  # every half interval
    worker.wedged = "stuck for the test"
    # withheld: the pinger ends (systemd's WatchdogSec restarts a daemon stuck on its way out)
    await until(task.done, what="the pinger ended")
    assert task.exception() is None
    await worker.close()
