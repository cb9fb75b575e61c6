"""Requests whose audio goes back to their caller (``SayRequest.output``): the same queue, engine
and ledger as the speaker's, played beside the speaker instead of after it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import Job, Ledger, SpeakerTurn
from s2s_daemon.pipeline.messages import OnFirstSample, PlaybackReport, SayRequest, Status, Utterance
from s2s_daemon.pipeline.output import CallerStream, pcm16
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.tts.engine import EngineOptions
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.stage import TtsStage
from s2s_daemon.tts.worker import EngineWorker
from tests.support.wait import until


class RealTimeSpeaker:
    """A speaker that takes as long to play a chunk as the chunk lasts."""

    name = "speaker"
    realtime = False

    async def open(self) -> None:
        return None

    async def play(self, utterance: Utterance, on_first_sample: OnFirstSample) -> PlaybackReport:
        first = None
        samples = 0
        async for chunk in utterance.chunks:
            if first is None:
                first = time.monotonic()
                on_first_sample(first)
            samples += len(chunk)
            await asyncio.sleep(len(chunk) / utterance.sample_rate)  # plays in real time, as a speaker
        return PlaybackReport(first, time.monotonic(), 1000.0 * samples / utterance.sample_rate)

    async def close(self) -> None:
        return None


class Events:
    def __init__(self) -> None:
        self.done: dict[str, tuple[str, float]] = {}
        """Request id -> (status, milliseconds of audio delivered)."""

    def started(self, job: Job) -> None:
        return None

    def finished(self, job: Job) -> None:
        self.done[job.request.id] = (str(job.status), job.timeline.played_ms or 0.0)

    def state_changed(self) -> None:
        return None


def request(request_id: str, text: str, output: CallerStream | None = None) -> SayRequest:
    return SayRequest(id=request_id, text=text, voice=None, language="auto", site_id="t", output=output)


async def pipeline(
    ms_per_char: str = "40",
) -> tuple[Ledger, Events, RequestQueue, list[asyncio.Task[None]], EngineWorker]:
    engine = create_engine("tone", EngineOptions(model="tone", extra={"speed": "0", "ms_per_char": ms_per_char}))
    worker = EngineWorker(engine)
    info = await worker.load()
    events = Events()
    requests = RequestQueue(8)
    ledger = Ledger(requests, events, 64)
    utterances: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances")
    tts = TtsStage(worker, info, requests, utterances, ledger, chunk_frames=2)
    playback = PlaybackStage(RealTimeSpeaker(), utterances, ledger)
    tasks = [asyncio.create_task(tts.run()), asyncio.create_task(playback.run())]
    return ledger, events, requests, tasks, worker


async def test_caller_audio_arrives_while_the_speaker_still_plays() -> None:
    ledger, events, requests, tasks, worker = await pipeline()
    try:
        room = ledger.submit(request("room", "x" * 100))  # four seconds on the speaker
        await until(lambda: room.timeline.first_sample_out is not None, 10, "it plays in the room")
        stream = CallerStream()
        job = ledger.submit(request("caller", "y" * 25, stream))  # one second of audio
        began = time.monotonic()
        pieces = [chunk async for chunk in stream.chunks(job.done)]
        took = time.monotonic() - began
        await asyncio.wait_for(job.done.wait(), 5)
        audio_s = sum(len(p) for p in pieces) / 24000
        assert abs(audio_s - 1.0) < 0.1
        assert took < 2.0, took  # not after the speaker's four seconds
        assert events.done["caller"][0] == "completed"
        assert events.done["caller"][1] == pytest.approx(audio_s * 1000.0, rel=0.01)
        assert "room" not in events.done  # still playing in the room
        assert len(pcm16(np.concatenate(pieces))) == 2 * sum(len(p) for p in pieces)
    finally:
        ledger.stop_all()
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()
    assert events.done["room"][0] == "interrupted"


async def test_a_caller_that_goes_away_frees_the_engine() -> None:
    ledger, events, requests, tasks, worker = await pipeline(ms_per_char="400")  # a long utterance
    try:
        stream = CallerStream(buffer_chunks=2)
        job = ledger.submit(request("gone", "z" * 100, stream))
        async for _ in stream.chunks(job.done):
            break  # the caller reads one chunk and disconnects
        stream.abandon()
        ledger.cancel(job, Status.INTERRUPTED)
        await asyncio.wait_for(job.done.wait(), 5)
        assert events.done["gone"][0] == "interrupted"
        # the engine serves the next request at once
        nxt = CallerStream()
        after = ledger.submit(request("next", "ok", nxt))
        assert [c async for c in nxt.chunks(after.done)]
        await asyncio.wait_for(after.done.wait(), 5)
        assert events.done["next"][0] == "completed"
    finally:
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()


async def test_a_rejected_caller_request_ends_its_stream() -> None:
    ledger, _events, requests, tasks, worker = await pipeline()
    try:
        ledger.submit(request("dup", "a"))
        stream = CallerStream()
        job = ledger.submit(request("dup", "b", stream))  # same id: rejected, never played
        assert [c async for c in stream.chunks(job.done)] == []
        assert job.status is Status.REJECTED
    finally:
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()


async def test_the_speakers_requests_are_paced_and_a_callers_are_not() -> None:
    # What the engine worker is told: the speaker's audio is heard as it is made (a batching
    # engine keeps others out of its steps while it is not far enough ahead), a caller's is not.
    ledger, _events, requests, tasks, worker = await pipeline()
    seen: dict[str, bool] = {}
    plain = worker.stream

    def stream(synth, should_stop):  # type: ignore[no-untyped-def]
        seen[synth.text] = synth.paced
        return plain(synth, should_stop)

    worker.stream = stream  # type: ignore[method-assign]
    try:
        room = ledger.submit(request("room", "room words"))
        caller = CallerStream()
        job = ledger.submit(request("caller", "caller words", caller))
        assert [c async for c in caller.chunks(job.done)]
        await asyncio.wait_for(asyncio.gather(room.done.wait(), job.done.wait()), 10)
    finally:
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()
    assert seen == {"room words": True, "caller words": False}
