"""``cancelled`` means nothing was heard: no ``tts/started`` before it, ``audioMs`` 0, no latency
event; ``interrupted`` means some of it was heard. One rule in the ledger decides which, whenever a
stop comes (a stop, an ``interrupt``, barge-in, the drain), also when the speaker was still
prebuffering or handed over its first sample after the stop was asked for."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from s2s_daemon.app import Daemon
from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.audio.sink import DiscardSink
from s2s_daemon.events.publisher import finished_payload
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import (
    ChunkMade,
    FirstSample,
    Job,
    Ledger,
    OnSpeaker,
    PlaybackEnded,
    SpeakerTurn,
)
from s2s_daemon.pipeline.messages import PlaybackReport, SayRequest, Status
from s2s_daemon.pipeline.pacing import Pacer
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.tts.engine import EngineOptions
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.stage import TtsStage
from s2s_daemon.tts.worker import EngineWorker
from tests.support.broker import Mosquitto
from tests.support.daemon import daemon_in_process, write_config
from tests.support.mqtt import Recorder, recorder
from tests.support.pulse import PulseServer, pulse_server  # noqa: F401  (fixture)
from tests.support.wait import until


class Seen:
    """``JobEvents`` that keep the order of what a subscriber would see."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.done: dict[str, Job] = {}

    def started(self, job: Job) -> None:
        self.log.append(("started", job.request.id))

    def finished(self, job: Job) -> None:
        self.log.append((f"finished:{job.status}", job.request.id))
        self.done[job.request.id] = job

    def state_changed(self) -> None:
        return None


class HeardSink(DiscardSink):
    """A speaker for the pacing (``realtime``): only a sink heard as it plays holds its first sample."""

    realtime = True


def req(rid: str, text: str = "hi") -> SayRequest:
    return SayRequest(id=rid, text=text, voice=None, language="auto", site_id="t")


def assert_silent_cancel(seen: Seen, rid: str) -> None:
    job = seen.done[rid]
    assert job.status is Status.CANCELLED
    assert ("started", rid) not in seen.log, seen.log
    assert finished_payload(job)["audioMs"] == 0.0
    assert job.timeline.first_sample_out is None  # the latency event is sent only for what was heard


async def test_a_first_sample_after_the_stop_is_not_heard() -> None:
    seen = Seen()
    d = Ledger(RequestQueue(4), seen, 16)
    d.submit(req("late"))
    job = d.take(await d.queue.get())
    assert job is not None
    d.record(job, OnSpeaker(time.monotonic()))
    d.record(job, ChunkMade(time.monotonic(), 2.0))
    assert d.stop_current()
    later = time.monotonic() + 0.001
    d.record(job, FirstSample(later))  # the sink handed a sample on before it saw the stop
    d.record(job, PlaybackEnded(later + 0.001))
    assert_silent_cancel(seen, "late")


async def test_a_first_sample_before_the_stop_reported_late_is_interrupted() -> None:
    seen = Seen()
    d = Ledger(RequestQueue(4), seen, 16)
    d.submit(req("heard"))
    job = d.take(await d.queue.get())
    assert job is not None
    d.record(job, OnSpeaker(time.monotonic()))
    d.record(job, ChunkMade(time.monotonic(), 2.0))
    played_at = time.monotonic()
    await asyncio.sleep(0.01)  # the scenario: 10 ms heard before the stop (audioMs counts them)
    assert d.stop_current()  # the stop came after the first sample, which was reported after it
    d.record(job, FirstSample(played_at))
    d.record(job, PlaybackEnded(time.monotonic()))
    assert seen.done["heard"].status is Status.INTERRUPTED
    assert seen.log == [("started", "heard"), ("finished:interrupted", "heard")]
    assert finished_payload(seen.done["heard"])["audioMs"] > 0


async def test_a_report_of_a_sample_played_after_the_stop_is_not_heard() -> None:
    seen = Seen()
    d = Ledger(RequestQueue(4), seen, 16)
    d.submit(req("report"))
    job = d.take(await d.queue.get())
    assert job is not None
    d.cancel(job, Status.INTERRUPTED)
    at = time.monotonic() + 0.001
    d.record(job, PlaybackEnded(at, PlaybackReport(at, at + 0.002, 2.0)))
    assert_silent_cancel(seen, "report")


async def test_a_stop_while_the_speaker_prebuffers_is_cancelled_without_a_start() -> None:
    """An engine at half real time: the speaker holds the first sample for the rest to come in
    time; a stop then must not let the held audio out (it did: started, then cancelled, audioMs 0.5-1.9)."""
    engine = create_engine("tone", EngineOptions(model="tone", extra={"speed": "0.5", "ms_per_char": "40"}))
    worker = EngineWorker(engine)
    info = await worker.load()
    seen = Seen()
    requests = RequestQueue(8)
    ledger = Ledger(requests, seen, 64)
    utterances: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances")
    pacer = Pacer(rate=0.5, max_wait_s=30)  # learned: this engine is slower than real time
    tts = TtsStage(worker, info, requests, utterances, ledger, chunk_frames=1, pacer=pacer)
    playback = PlaybackStage(HeardSink(), utterances, ledger, pacer)
    tasks = [asyncio.create_task(tts.run()), asyncio.create_task(playback.run())]
    try:
        job = ledger.submit(req("held", "a sentence long enough to need a few seconds of buffer first"))
        await until(lambda: job.timeline.chunks >= 3, 10, "the speaker has audio, and holds it")
        assert job.timeline.first_sample_out is None
        assert ledger.stop_current()
        await asyncio.wait_for(job.done.wait(), 10)
    finally:
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()
    assert_silent_cancel(seen, "held")


# -- through MQTT: a real mosquitto, the daemon in this process ------------------------------

SAY = "s2s/kitchen/tts/say"
STOP = "s2s/kitchen/tts/stop"
HELD_TEXT = "x" * 100
"""4 s of audio from an engine at half real time: the speaker holds it for about 4.6 s first."""
SLOW_ON_A_SPEAKER = {
    "tts": {"options": {"speed": "0.5"}, "chunk_frames": 1},
    "audio": {"sink": "speaker", "device": "pulse", "latency_ms": 80, "prebuffer_max_s": 30},
}
"""Only a speaker prebuffers (a discard sink never waits); the wait unbounded enough to stop within."""


def assert_cancelled_unheard(rec: Recorder, rid: str, fin: dict[str, dict[str, Any]]) -> None:
    assert fin[rid]["status"] == "cancelled", fin[rid]
    assert fin[rid]["audioMs"] == 0
    assert rid not in [p["id"] for p in rec.payloads("/tts/started")]
    assert rid not in [p["id"] for p in rec.payloads("/metrics/latency")]


async def held(rec: Recorder, daemon: Daemon, rid: str) -> None:
    """Say ``HELD_TEXT`` and wait until the engine made some of it: the speaker is prebuffering."""
    await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")))
    await rec.say(SAY, {"id": rid, "text": HELD_TEXT})
    assert daemon._parts is not None
    jobs = daemon._parts.stages.ledger.jobs
    # two chunks made (polled: no event says so); 4.6 s of holding to go
    await until(lambda: rid in jobs and jobs[rid].timeline.chunks >= 2, 10, "two chunks made")


@pytest.mark.integration
async def test_a_stop_or_an_interrupt_while_prebuffering_is_cancelled_unheard(
    tmp_path: Path,
    mosquitto: Mosquitto,
    pulse_server: PulseServer,  # noqa: F811  (fixture)
) -> None:
    config = write_config(tmp_path / "daemon.yaml", mosquitto.port, **SLOW_ON_A_SPEAKER)
    async with recorder(mosquitto.port) as rec, daemon_in_process(config) as daemon:
        await held(rec, daemon, "stopped")
        await rec.say(STOP, {})
        fin = await rec.wait_finished(["stopped"])
        assert_cancelled_unheard(rec, "stopped", fin)
        await held(rec, daemon, "overtaken")
        await rec.say(SAY, {"id": "urgent", "text": "now", "interrupt": True})
        fin = await rec.wait_finished(["overtaken", "urgent"], timeout_s=20)
        assert_cancelled_unheard(rec, "overtaken", fin)
        assert fin["urgent"]["status"] == "completed"


@pytest.mark.integration
async def test_a_drain_that_times_out_while_prebuffering_is_cancelled_unheard(
    tmp_path: Path,
    mosquitto: Mosquitto,
    pulse_server: PulseServer,  # noqa: F811  (fixture)
) -> None:
    config = write_config(
        tmp_path / "daemon.yaml", mosquitto.port, **SLOW_ON_A_SPEAKER, shutdown={"drain_timeout_s": 0.5}
    )
    async with recorder(mosquitto.port) as rec:
        async with daemon_in_process(config) as daemon:
            await held(rec, daemon, "draining")
            daemon.request_stop()  # what SIGINT and SIGTERM do
        fin = await rec.wait_finished(["draining"])
        assert_cancelled_unheard(rec, "draining", fin)
