"""A paced stream (the speaker's) comes first: while its audio is not ``LEAD_S`` ahead of playing
time, other requests are neither opened nor stepped in a batching engine's steps, nor given turns
on an engine that does not batch, so they cannot make it stutter; once it is far enough ahead (a
fast engine), they share its steps or take turns with it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from s2s_daemon.tts.engine import DeviceMemory, ShouldStop, SynthesisRequest
from s2s_daemon.tts.scheduler import LEAD_S
from s2s_daemon.tts.worker import EngineWorker

pytestmark = pytest.mark.timeout(60)

FRAME = 1920
"""Samples a step makes per request: 80 ms at 24 kHz, as the torch engine's frames."""


class _Synthesis:
    def __init__(self, name: str, frames: int) -> None:
        self.name = name
        self.left = frames
        self.done = False
        self._made: list[np.ndarray] = []

    def take(self) -> list[np.ndarray]:
        made, self._made = self._made, []
        return made

    def stop(self) -> None:
        self.done = True


class StepEngine:
    """A batching engine whose steps take ``step_s`` and make one frame of each request; requests
    are ``name:frames``. Records which requests every step ran."""

    def __init__(self, step_s: float, open_s: float = 0.0, size: int = 4) -> None:
        self.step_s = step_s
        self.open_s = open_s
        self.size = size
        self.steps: list[tuple[float, frozenset[str]]] = []
        self.threads: set[int] = set()

    @property
    def max_batch(self) -> int:
        return self.size

    def open_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> _Synthesis:
        time.sleep(self.open_s)  # the engine's work (a prompt's prefill): the behaviour under test
        name, frames = request.text.split(":")
        return _Synthesis(name, int(frames))

    def step_blocking(self, batch: list[_Synthesis]) -> None:
        self.threads.add(threading.get_ident())
        time.sleep(self.step_s)  # the engine's work per step: the behaviour under test
        live = [s for s in batch if not s.done]
        self.steps.append((time.monotonic(), frozenset(s.name for s in live)))
        for s in live:
            s._made.append(np.zeros(FRAME, np.float32))
            s.left -= 1
            s.done = s.left <= 0

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[np.ndarray]:
        raise AssertionError("a batching engine's requests go through open_blocking and step_blocking")

    def memory_blocking(self) -> DeviceMemory:
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        return None


def _request(name: str, frames: int, paced: bool) -> SynthesisRequest:
    return SynthesisRequest(text=f"{name}:{frames}", voice=None, language="auto", chunk_frames=1, paced=paced)


async def _consume(worker: EngineWorker, request: SynthesisRequest, delay_s: float = 0.0) -> list[float]:
    """The arrival times of the request's chunks."""
    await asyncio.sleep(delay_s)  # the scenario: this request arrives this much later
    times = []
    async for _ in worker.stream(request, lambda: False):
        times.append(time.monotonic())
    return times


async def _speaker_and_caller(
    engine: object,
    speaker_frames: int,
    caller_frames: int,
    *,
    delay_s: float,
    stall_timeout_s: float,
    paced: bool = True,
    caller_first: bool = False,
) -> tuple[list[float], list[float]]:
    """The arrival times of a speaker's request's chunks and a caller's, the later of the two
    ``delay_s`` after the other, on one worker of ``engine``."""
    worker = EngineWorker(engine, stall_timeout_s=stall_timeout_s)  # type: ignore[arg-type]
    speaker, caller = _request("speaker", speaker_frames, paced), _request("caller", caller_frames, False)
    if caller_first:
        heard, spoken = await asyncio.gather(_consume(worker, caller), _consume(worker, speaker, delay_s))
    else:
        spoken, heard = await asyncio.gather(_consume(worker, speaker), _consume(worker, caller, delay_s))
    await worker.close()
    return spoken, heard


@pytest.mark.slow
async def test_on_a_slow_engine_the_speaker_runs_alone_and_the_caller_after_it() -> None:
    # 80 ms of audio per 120 ms step: slower than real time. The caller arrives mid-utterance;
    # its audio must come after the speaker's (stall timeout shorter than its wait: no failure).
    engine = StepEngine(step_s=0.12)
    speaker, caller = await _speaker_and_caller(engine, 12, 3, delay_s=0.3, stall_timeout_s=0.6)
    assert len(speaker) == 12 and len(caller) == 3
    assert all(names == {"speaker"} for _, names in engine.steps[:12])  # never slowed by the caller
    assert caller[0] > speaker[-1]


@pytest.mark.slow
async def test_on_a_slow_engine_a_caller_already_open_waits_while_the_speaker_runs() -> None:
    # The caller began first; once the speaker's request is open, the caller is out of the steps
    # until the speaker's last frame, then goes on where it was.
    engine = StepEngine(step_s=0.12)
    speaker, caller = await _speaker_and_caller(engine, 10, 8, delay_s=0.3, stall_timeout_s=0.6, caller_first=True)
    assert len(caller) == 8 and len(speaker) == 10
    names = [n for _, n in engine.steps]
    first, last = names.index(frozenset({"speaker"})), max(i for i, n in enumerate(names) if "speaker" in n)
    assert 0 < first and all(n == {"speaker"} for n in names[first : last + 1])
    assert caller[-1] > speaker[-1]


@pytest.mark.slow
async def test_without_pacing_the_caller_shares_the_speakers_steps() -> None:
    # The same two requests, neither paced: the batch takes the caller in at once (what the
    # first test rules out, so that test can tell).
    engine = StepEngine(step_s=0.12)
    await _speaker_and_caller(engine, 12, 3, delay_s=0.3, stall_timeout_s=5, paced=False)
    assert any(names == {"speaker", "caller"} for _, names in engine.steps)


@pytest.mark.slow
async def test_on_a_fast_engine_the_caller_joins_once_the_speaker_is_far_enough_ahead() -> None:
    # 80 ms of audio per 10 ms step: the speaker's lead grows by 7 s a second; the caller is
    # opened once the lead covers LEAD_S and a prefill, then shares the speaker's steps.
    engine = StepEngine(step_s=0.01)
    started = time.monotonic()
    speaker, caller = await _speaker_and_caller(engine, 120, 20, delay_s=0.05, stall_timeout_s=5)
    assert len(speaker) == 120 and len(caller) == 20
    shared = [at for at, names in engine.steps if names == {"speaker", "caller"}]
    assert shared, "the caller never shared a step"
    # When it first did, the speaker had made more audio than could have played, by LEAD_S.
    made = sum(1 for at, names in engine.steps if "speaker" in names and at < shared[0]) * FRAME / 24000
    assert made - (shared[0] - started) >= LEAD_S
    assert caller[-1] < speaker[-1]  # done while the speaker still went on: no waiting for its end


@pytest.mark.slow
async def test_callers_sent_together_start_together() -> None:
    # Four callers at once, then three more while those run: each group is opened in one step
    # (two where a step begins between the joins), so each one's first audio waits for its group's
    # prefills and a step, not for a step of every stream opened before it; one a step, the
    # fourth of a group would be stepped three steps after the first.
    engine = StepEngine(step_s=0.02, open_s=0.05, size=8)
    worker = EngineWorker(engine, stall_timeout_s=5)  # type: ignore[arg-type]
    results = await asyncio.wait_for(
        asyncio.gather(
            *(_consume(worker, _request(name, 30, False)) for name in "abcd"),
            *(_consume(worker, _request(name, 5, False), 0.35) for name in "efg"),
        ),
        timeout=20,
    )
    await worker.close()
    assert [len(r) for r in results] == [30] * 4 + [5] * 3
    names = [n for _, n in engine.steps]
    for group in ("abcd", "efg"):
        firsts = [next(i for i, n in enumerate(names) if name in n) for name in group]
        assert max(firsts) - min(firsts) <= 1, (group, firsts)


async def test_a_speaker_waiting_for_a_place_lets_the_open_callers_finish() -> None:
    # Both places taken by callers: the speaker cannot be opened, so it must not hold them.
    engine = StepEngine(step_s=0.02, size=2)
    worker = EngineWorker(engine, stall_timeout_s=5)  # type: ignore[arg-type]
    results = await asyncio.wait_for(
        asyncio.gather(
            _consume(worker, _request("a", 10, False)),
            _consume(worker, _request("b", 10, False)),
            _consume(worker, _request("speaker", 5, paced=True), 0.05),
        ),
        timeout=20,
    )
    await worker.close()
    assert [len(r) for r in results] == [10, 10, 5]


class TurnEngine:
    """An engine that does not batch: its requests take turns a chunk at a time (the worker's
    ``crowded`` streams); each chunk takes ``chunk_s`` and is one frame. Records the order."""

    def __init__(self, chunk_s: float) -> None:
        self.chunk_s = chunk_s
        self.made: list[str] = []

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[np.ndarray]:
        name, frames = request.text.split(":")
        for _ in range(int(frames)):
            if should_stop():
                return
            time.sleep(self.chunk_s)  # the engine's work per chunk: the behaviour under test
            self.made.append(name)
            yield np.zeros(FRAME, np.float32)

    def memory_blocking(self) -> DeviceMemory:
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        return None


@pytest.mark.slow
async def test_taking_turns_on_a_slow_engine_the_caller_waits_for_the_speaker() -> None:
    engine = TurnEngine(chunk_s=0.12)
    speaker, caller = await _speaker_and_caller(engine, 10, 3, delay_s=0.3, stall_timeout_s=0.6)
    assert len(speaker) == 10 and len(caller) == 3
    assert engine.made == ["speaker"] * 10 + ["caller"] * 3  # no turn of the caller's in between


@pytest.mark.slow
async def test_taking_turns_on_a_fast_engine_the_caller_gets_turns_once_the_speaker_is_ahead() -> None:
    engine = TurnEngine(chunk_s=0.01)
    speaker, caller = await _speaker_and_caller(engine, 150, 10, delay_s=0.05, stall_timeout_s=5)
    assert len(speaker) == 150 and len(caller) == 10
    last_caller = max(i for i, name in enumerate(engine.made) if name == "caller")
    assert "speaker" in engine.made[last_caller:]  # the caller was done before the speaker
    first_caller = engine.made.index("caller")
    assert first_caller * FRAME / 24000 >= LEAD_S  # not before the speaker was LEAD_S of audio ahead
