"""A text of several sentences on a real PulseAudio null sink, the engine faster than real time:
recorded from the sink's monitor, the only silences inside the utterance are the pauses between
sentences, none longer than intended."""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt
import pytest

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.audio.speaker import SpeakerSink
from s2s_daemon.config import AudioConfig
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import Ledger, SpeakerTurn
from s2s_daemon.pipeline.messages import SayRequest, Status
from s2s_daemon.pipeline.pacing import Pacer
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.tts.engine import EngineOptions
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.stage import SENTENCE_PAUSE_S, TtsStage
from s2s_daemon.tts.worker import EngineWorker
from tests.support.events import Events
from tests.support.pulse import (
    SPEAKER_RATE_HZ,
    PulseServer,
    pulse_server,  # noqa: F401  (fixture)
)
from tests.support.wait import until

pytestmark = pytest.mark.integration

WINDOW_S = 0.005
SILENT_RMS = 0.01
"""The tone engine's sine has an RMS of 0.21; a 5 ms window below this is silence."""
JITTER_S = 0.06
"""What a pause may grow by on the device: callback periods (20 ms) and PulseAudio's buffering."""


def silences(recording: npt.NDArray[np.float32]) -> list[float]:
    """Seconds of each silent run between the first and the last sound of ``recording``."""
    n = int(WINDOW_S * SPEAKER_RATE_HZ)
    windows = recording[: len(recording) // n * n].reshape(-1, n)
    loud = np.sqrt(np.mean(np.square(windows, dtype=np.float64), axis=1)) >= SILENT_RMS
    where = np.flatnonzero(loud)
    assert len(where), "nothing was recorded"
    runs, length = [], 0
    for is_loud in loud[where[0] : where[-1] + 1]:
        if is_loud:
            if length:
                runs.append(length * WINDOW_S)
            length = 0
        else:
            length += 1
    return runs


@pytest.mark.audio
@pytest.mark.timeout(60)
async def test_sentences_play_gaplessly_with_their_pause_on_the_null_sink(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
) -> None:
    engine = create_engine("tone", EngineOptions(model="tone", extra={"speed": "4", "ms_per_char": "30"}))
    worker = EngineWorker(engine)
    info = await worker.load()
    sink = SpeakerSink(AudioConfig(sink="speaker", device="pulse", latency_ms=80))
    await sink.open()
    events = Events()
    requests = RequestQueue(4)
    ledger = Ledger(requests, events, 16)
    utterances: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances")
    pacer = Pacer()
    tasks = [
        asyncio.create_task(TtsStage(worker, info, requests, utterances, ledger, 2, pacer=pacer).run()),
        asyncio.create_task(PlaybackStage(sink, utterances, ledger, pacer).run()),
    ]
    recorder = pulse_server.record("spk.monitor", SPEAKER_RATE_HZ)
    try:
        await until(lambda: recorder.seconds() >= 0.3, 10, "0.3 s recorded before")
        text = "The first sentence is here. A second one follows it! And a third one ends the text?"
        job = ledger.submit(SayRequest(id="g", text=text, voice=None, language="auto", site_id="t"))
        await asyncio.wait_for(job.done.wait(), 30)
        end = recorder.seconds()
        await until(lambda: recorder.seconds() >= end + 0.3, 10, "0.3 s recorded after")
    finally:
        recording = await asyncio.to_thread(recorder.stop)
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await sink.close()
        await worker.close()
    assert job.status is Status.COMPLETED
    gaps = silences(recording)
    assert len([g for g in gaps if g >= SENTENCE_PAUSE_S / 2]) == 2, gaps  # the two pauses, heard
    assert max(gaps) <= SENTENCE_PAUSE_S + JITTER_S, gaps  # and nothing longer: no gap inside or between
