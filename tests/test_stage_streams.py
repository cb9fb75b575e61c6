"""The TTS stage with several requests at once (``tts.max_streams``): callers' requests (HTTP,
Wyoming) are synthesized beside each other and beside the speaker's, which stay one at a time
and in queue order; with ``max_streams: 1`` every request waits for the one before it.

The pipeline is ``build_stages``'s, on the tone engine (as fast as it can, 40 ms of audio a
character, a frame a chunk). A caller whose stream nobody reads holds its synthesis mid-way
(back-pressure): it is running, and cannot end until it is read."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from s2s_daemon.audio.sink import DiscardSink
from s2s_daemon.config import load_config
from s2s_daemon.pipeline.channel import ChannelClosed
from s2s_daemon.pipeline.jobs import Job, Phase
from s2s_daemon.pipeline.messages import OnFirstSample, PlaybackReport, SayRequest, Status, Utterance
from s2s_daemon.pipeline.output import CallerStream
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.tts.engine import EngineOptions
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.worker import EngineWorker
from s2s_daemon.wiring import SpeechStages, build_stages
from tests.support.events import Events
from tests.support.wait import loop_turns, until

FRAME_S = 0.08
LONG = "x" * 300
"""One sentence of 150 frames, a chunk each: more than an unread caller's buffers hold (its
stream's 16 chunks, the utterance's 64, the engine stream's 8)."""


def frames(text: str) -> int:
    """Frames the tone engine makes for ``text`` (40 ms a character)."""
    return max(1, round(len(text) * 40 / 80))


class Speaker:
    """Plays each chunk for its length divided by ``speed``; notes the order utterances came in
    and the most that played at once."""

    name = "speaker"
    realtime = False
    """Not paced: the stages' order is what these tests watch (``HeardSpeaker`` is paced)."""

    def __init__(self, speed: float = 8.0) -> None:
        self.speed = speed
        self.played: list[str] = []
        self.playing = 0
        self.most = 0

    async def open(self) -> None:
        return None

    async def play(self, utterance: Utterance, on_first_sample: OnFirstSample) -> PlaybackReport:
        self.played.append(utterance.request.id)
        self.playing += 1
        self.most = max(self.most, self.playing)
        first = None
        samples = 0
        try:
            async for chunk in utterance.chunks:
                if first is None:
                    first = time.monotonic()
                    on_first_sample(first)
                samples += len(chunk)
                await asyncio.sleep(len(chunk) / utterance.sample_rate / self.speed)  # plays in (scaled) real time
        finally:
            self.playing -= 1
        return PlaybackReport(first, time.monotonic(), 1000.0 * samples / utterance.sample_rate)

    async def close(self) -> None:
        return None


@dataclass
class Stage:
    stages: SpeechStages
    events: Events
    runner: asyncio.Task[None]
    readers: dict[str, asyncio.Task[float]] = field(default_factory=dict)
    """Caller id -> seconds of audio it read."""

    def say(self, request_id: str, text: str, **fields: Any) -> Job:
        request = SayRequest(id=request_id, text=text, voice=None, language="auto", site_id="t", **fields)
        return self.stages.ledger.submit(request)

    def call(self, request_id: str, text: str, *, read: bool = True) -> tuple[Job, CallerStream]:
        """A caller's request (its own output); read at once unless ``read`` is False."""
        stream = CallerStream()
        job = self.say(request_id, text, output=stream)
        if read:
            self.read(job, stream)
        return job, stream

    def read(self, job: Job, stream: CallerStream) -> None:
        async def audio_s() -> float:
            return sum([len(c) async for c in stream.chunks(job.done)]) / 24000

        self.readers[job.request.id] = asyncio.create_task(audio_s())

    async def done(self, *jobs: Job, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(j.done.wait() for j in jobs)), timeout_s)

    def status(self, request_id: str) -> Status | None:
        job = self.events.done.get(request_id)
        return job.status if job is not None else None


@contextlib.asynccontextmanager
async def stage(max_streams: int = 4, speaker: Any = None, gate: Any = None) -> AsyncIterator[Stage]:
    environ = {"S2S_TTS__ENGINE": "tone", "S2S_TTS__CHUNK_FRAMES": "1", "S2S_TTS__MAX_STREAMS": str(max_streams)}
    config = load_config(None, environ=environ)
    worker = EngineWorker(create_engine("tone", EngineOptions(model="tone", extra={"speed": "0"})))
    info = await worker.load()
    events = Events()
    stages = build_stages(config, worker, info, speaker or Speaker(), events, gate=gate)
    runner = asyncio.create_task(stages.run(), name="test.stages")
    try:
        yield Stage(stages, events, runner)
    finally:
        stages.ledger.stop_all()
        stages.ledger.close()
        await asyncio.wait_for(runner, 10)
        await worker.close()


def serial(jobs: list[Job]) -> bool:
    """Each job's synthesis began after the one before it had ended."""
    spans: list[tuple[float, float]] = []
    for job in jobs:
        began, ended = job.timeline.synth_started, job.timeline.synth_done
        assert began is not None and ended is not None, job.request.id
        spans.append((began, ended))
    return all(after[0] >= before[1] for before, after in itertools.pairwise(spans))


async def test_the_queue_hands_its_consumer_the_first_request_it_accepts() -> None:
    def request(request_id: str, priority: int = 0) -> SayRequest:
        return SayRequest(id=request_id, text="t", voice=None, language="auto", site_id="t", priority=priority)

    q = RequestQueue(8)
    for r in (request("room1"), request("call1"), request("room2"), request("call2", 3)):
        assert q.offer(r)
    assert q.offer(request("urgent"), front=True)
    calls = lambda r: r.id.startswith("call")  # noqa: E731
    assert [(await q.get(calls)).id for _ in range(2)] == ["call2", "call1"]
    waiter = asyncio.create_task(q.get(calls))
    await loop_turns()
    assert not waiter.done()  # what it refuses keeps its place
    q.offer(request("call3"))
    assert (await asyncio.wait_for(waiter, 1)).id == "call3"
    assert (await q.get()).id == "urgent"  # interrupts and priorities as before
    room = False
    waiter = asyncio.create_task(q.get(lambda r: room))
    q.close()  # closed, but "room1" and "room2" still wait
    await loop_turns()
    assert not waiter.done()
    room = True
    q.reconsider()
    assert (await asyncio.wait_for(waiter, 1)).id == "room1"
    assert [r.id for r in q.drain()] == ["room2"]
    with pytest.raises(ChannelClosed):
        await q.get(calls)


async def test_two_callers_are_synthesized_together() -> None:
    async with stage() as s:
        held, held_stream = s.call("held", LONG, read=False)
        quick, _ = s.call("quick", "y" * 100)
        await s.done(quick, timeout_s=5)  # serialized, it would wait for "held", which nobody reads
        assert s.status("quick") is Status.COMPLETED
        assert s.readers["quick"].result() == pytest.approx(frames("y" * 100) * FRAME_S)
        made, ended = held.timeline.first_chunk, quick.timeline.synth_done
        assert made is not None and ended is not None and made < ended
        assert held.timeline.synth_done is None and not held.done.is_set()  # both made audio before either ended
        s.read(held, held_stream)
        await s.done(held)
        assert s.status("held") is Status.COMPLETED
        assert s.readers["held"].result() == pytest.approx(frames(LONG) * FRAME_S)
        assert held.timeline.chunks == frames(LONG)  # its own chunks, not the other's


async def test_stopping_one_caller_leaves_the_other_whole() -> None:
    async with stage() as s:
        gone, _ = s.call("gone", LONG, read=False)
        kept, kept_stream = s.call("kept", LONG, read=False)
        await until(lambda: gone.timeline.first_chunk and kept.timeline.first_chunk, 10, "both running")
        assert s.stages.ledger.stop_id("gone")
        await s.done(gone)
        assert s.status("gone") is Status.INTERRUPTED
        assert not kept.done.is_set() and not kept.should_stop()
        s.read(kept, kept_stream)
        await s.done(kept)
        assert s.status("kept") is Status.COMPLETED
        assert s.readers["kept"].result() == pytest.approx(frames(LONG) * FRAME_S)


async def test_the_speaker_gets_one_utterance_at_a_time_in_queue_order() -> None:
    speaker = Speaker(speed=8)
    async with stage(speaker=speaker) as s:
        talk = "a sentence for the room, spoken in full."
        first = s.say("first", talk)
        callers = [s.call(f"caller{i}", "y" * 50)[0] for i in range(3)]
        second = s.say("second", talk)
        urgent = s.say("urgent", talk, priority=5)
        await s.done(first, second, urgent, *callers)
        assert speaker.played == ["urgent", "first", "second"]
        assert speaker.most == 1
        assert serial([urgent, first, second])  # synthesized one after another too
        assert {s.status(j.request.id) for j in [first, second, urgent, *callers]} == {Status.COMPLETED}


async def test_an_interrupt_stops_the_speaker_not_a_caller() -> None:
    speaker = Speaker(speed=1)
    async with stage(speaker=speaker) as s:
        caller, caller_stream = s.call("caller", LONG, read=False)
        playing = s.say("playing", "x" * 50)  # two seconds in the room
        await until(lambda: playing.timeline.first_sample_out is not None, 10, "it plays in the room")
        urgent = s.say("urgent", "now", interrupt=True)
        await s.done(playing, urgent, timeout_s=5)
        assert speaker.played == ["playing", "urgent"]
        assert s.status("playing") is Status.INTERRUPTED and s.status("urgent") is Status.COMPLETED
        assert not caller.should_stop()  # a caller's request is its caller's to stop
        s.read(caller, caller_stream)
        await s.done(caller)
        assert s.status("caller") is Status.COMPLETED


async def test_an_interrupt_goes_before_the_speakers_queue() -> None:
    quiet: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    speaker = Speaker()
    async with stage(speaker=speaker, gate=lambda: None if quiet.done() else quiet) as s:
        held = s.say("held", "taken, held by the gate")
        waiting = s.say("waiting", "queued behind it")
        caller, _ = s.call("caller", "y" * 10)
        await s.done(caller)  # passed both
        urgent = s.say("urgent", "first in the queue", interrupt=True)
        quiet.set_result(None)
        await s.done(held, waiting, urgent)
        assert speaker.played == ["held", "urgent", "waiting"]


async def test_one_stream_serves_every_request_in_queue_order() -> None:
    async with stage(max_streams=1) as s:
        jobs = [
            s.call("c1", "y" * 100)[0],
            s.say("s1", "x" * 50),
            s.call("c2", "y" * 100)[0],
            s.say("s2", "x" * 50),
        ]
        await s.done(*jobs)
        by_start = sorted(jobs, key=lambda j: j.timeline.synth_started or 0.0)
        assert [j.request.id for j in by_start] == ["c1", "s1", "c2", "s2"]
        assert serial(by_start)


async def test_one_stream_keeps_a_caller_behind_an_unread_one() -> None:
    async with stage(max_streams=1) as s:
        held, held_stream = s.call("held", LONG, read=False)
        behind, _ = s.call("behind", "y" * 10)
        await until(lambda: held.timeline.first_chunk is not None, 10, "the first one running")
        await loop_turns()
        assert behind.timeline.dequeued is None  # the one place is taken
        s.read(held, held_stream)
        await s.done(held, behind)
        assert s.status("behind") is Status.COMPLETED


async def test_a_caller_passes_a_speaker_request_the_gate_holds() -> None:
    quiet: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # someone speaks in the room
    async with stage(gate=lambda: None if quiet.done() else quiet) as s:
        held = s.say("held", "for the room, once it is quiet")
        caller, _ = s.call("caller", "y" * 50)
        await s.done(caller, timeout_s=5)
        assert s.status("caller") is Status.COMPLETED
        assert held.phase is Phase.QUEUED and held.timeline.synth_started is None  # still held
        quiet.set_result(None)
        await s.done(held)
        assert s.status("held") is Status.COMPLETED


async def test_a_caller_passes_the_speakers_backlog() -> None:
    speaker = Speaker(speed=1)
    async with stage(speaker=speaker) as s:
        room = [s.say(f"room{i}", "x" * 50) for i in range(5)]  # two seconds each
        await until(lambda: room[4].timeline.dequeued is not None, 10, "the fifth taken")
        await loop_turns()
        # The speaker plays the first; the next three are made and wait (in the speaker's channel,
        # in the playback stage's hand, in the channel to it): the fifth waits for room.
        assert room[4].timeline.dequeued is not None and room[4].timeline.synth_started is None
        began = time.monotonic()
        caller, _ = s.call("caller", "y" * 25)
        await s.done(caller, timeout_s=5)
        assert time.monotonic() - began < 1.0  # not once the room's first utterance has played
        assert s.status("caller") is Status.COMPLETED
        assert speaker.played == ["room0"]


async def test_shutdown_waits_for_every_synthesis_begun() -> None:
    speaker = Speaker(speed=40)
    async with stage(speaker=speaker) as s:
        held, held_stream = s.call("held", LONG, read=False)
        room = s.say("room", LONG)  # a second on this speaker
        s.say("queued", "never spoken")
        await until(lambda: held.timeline.first_chunk and room.timeline.first_chunk, 10, "both running")
        s.stages.ledger.close()  # the drain's first step
        assert s.status("queued") is Status.CANCELLED
        await s.done(room)  # all that is left is the unread caller's
        await loop_turns()
        assert not s.runner.done() and not s.stages.tts.utterances.closed  # "held" is still being made
        s.read(held, held_stream)
        await asyncio.wait_for(s.runner, 10)
        assert s.status("held") is Status.COMPLETED and s.status("room") is Status.COMPLETED
        assert s.stages.tts.utterances.closed and held_stream.closed
        assert s.stages.ledger.jobs == {}


async def test_each_synthesis_logs_and_counts_its_own_request() -> None:
    texts = {"held": LONG, "quick": "y" * 100}
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        async with stage() as s:
            held, held_stream = s.call("held", texts["held"], read=False)
            quick, _ = s.call("quick", texts["quick"])
            await s.done(quick)
            s.read(held, held_stream)
            await s.done(held)
    mine = [e for e in logs if e["event"] in ("synthesis_started", "segment_synthesized")]
    assert {(e["event"], e["request_id"]) for e in mine} == {
        (event, rid) for event in ("synthesis_started", "segment_synthesized") for rid in texts
    }
    assert all(e["chars"] == len(texts[e["request_id"]]) for e in mine)
    for job in (held, quick):
        text = texts[job.request.id]
        assert job.timeline.audio_s == pytest.approx(frames(text) * FRAME_S)
        assert job.timeline.chunks == frames(text)


class HeardSpeaker(Speaker):
    """A speaker heard as it plays (``AudioSink.realtime``), as the real one."""

    realtime = True


@pytest.mark.parametrize(("sink", "paced"), [(HeardSpeaker, True), (Speaker, False), (DiscardSink, False)])
async def test_only_a_speaker_heard_as_it_plays_is_paced_and_never_a_caller(sink: type, paced: bool) -> None:
    # Paced: others keep out of the engine's steps while its audio is not far enough ahead. For the
    # discard sink (or a file) nobody listens: a caller is never held behind its request.
    seen: dict[str, bool] = {}
    async with stage(speaker=sink()) as s:
        plain = s.stages.tts.worker.stream

        def stream(synth, should_stop):  # type: ignore[no-untyped-def]
            seen[synth.text] = synth.paced
            return plain(synth, should_stop)

        s.stages.tts.worker.stream = stream  # type: ignore[method-assign]
        room = s.say("room", "room words")
        caller, _ = s.call("caller", "caller words")
        await s.done(room, caller)
    assert seen == {"room words": paced, "caller words": False}
