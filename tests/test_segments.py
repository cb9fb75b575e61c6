"""A request's text is synthesized sentence by sentence into one utterance, with a pause between."""

from __future__ import annotations

import asyncio

import numpy as np

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.audio.sink import DiscardSink
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import Job, Ledger, SpeakerTurn
from s2s_daemon.pipeline.messages import SayRequest, Status
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.stage import SENTENCE_PAUSE_S, TtsStage
from s2s_daemon.tts.worker import EngineWorker
from tests.support.events import Events


async def speak(text: str) -> tuple[list[str], Job]:
    engine = create_engine("tone", EngineOptions(model="tone", extra={"speed": "0", "ms_per_char": "40"}))
    seen: list[str] = []
    original = engine.synthesize_blocking

    def recording(request: SynthesisRequest, should_stop):  # type: ignore[no-untyped-def]
        seen.append(request.text)
        return original(request, should_stop)

    engine.synthesize_blocking = recording  # type: ignore[method-assign]
    worker = EngineWorker(engine)
    info = await worker.load()
    events = Events()
    requests = RequestQueue(4)
    ledger = Ledger(requests, events, 16)
    utterances: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances")
    tasks = [
        asyncio.create_task(TtsStage(worker, info, requests, utterances, ledger, chunk_frames=4).run()),
        asyncio.create_task(PlaybackStage(DiscardSink(), utterances, ledger).run()),
    ]
    try:
        job = ledger.submit(SayRequest(id="s", text=text, voice=None, language="auto", site_id="t"))
        await asyncio.wait_for(job.done.wait(), 10)
    finally:
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()
    return seen, events.done["s"]


async def test_each_sentence_is_its_own_engine_call_with_a_pause_between() -> None:
    text = "Dr. Smith is here. He brought the cake! Shall we start?"
    seen, job = await speak(text)
    assert seen == ["Dr. Smith is here.", "He brought the cake!", "Shall we start?"]
    assert job.status is Status.COMPLETED
    tone = sum(max(1, round(len(s) * 40 / 80)) * 0.08 for s in seen)
    assert np.isclose(job.timeline.audio_s, tone + 2 * SENTENCE_PAUSE_S, atol=1e-3)


async def test_one_sentence_is_one_call() -> None:
    seen, job = await speak("Just one sentence, with a comma")
    assert seen == ["Just one sentence, with a comma"]
    assert job.status is Status.COMPLETED
