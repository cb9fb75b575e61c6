"""Gapless on slow hardware: an engine slower than real time makes the speaker wait before the
first sample until the rest will arrive in time; a fast one keeps the short start."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.events.publisher import latency_payload
from s2s_daemon.pipeline.channel import Channel, ChannelClosed, Overflow
from s2s_daemon.pipeline.jobs import Ledger, SpeakerTurn, Timeline
from s2s_daemon.pipeline.messages import OnFirstSample, PlaybackReport, SayRequest, Utterance
from s2s_daemon.pipeline.pacing import Pacer
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.vocabulary import EngineInfo
from s2s_daemon.tts.engine import EngineOptions
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.stage import TtsStage
from s2s_daemon.tts.worker import EngineWorker
from tests.support.events import Events

INFO = EngineInfo("tone", "tone", "cpu", 24000)
GAP_S = 0.03
"""A wait for the next chunk longer than this, once playing, is an audible gap."""


class RealTimeSpeaker:
    """Plays each chunk for as long as it lasts and notes every wait for the next one."""

    name = "speaker"
    realtime = True

    def __init__(self) -> None:
        self.gaps: dict[str, list[float]] = {}
        self.after_pause: dict[str, list[float]] = {}
        """Waits that came right after the silence between two sentences."""
        self.gaps_at: dict[str, list[float]] = {}
        """Seconds of the utterance played before each wait that was not after a silence."""

    async def open(self) -> None:
        return None

    async def play(self, utterance: Utterance, on_first_sample: OnFirstSample) -> PlaybackReport:
        gaps = self.gaps.setdefault(utterance.request.id, [])
        gaps_at = self.gaps_at.setdefault(utterance.request.id, [])
        after_pause = self.after_pause.setdefault(utterance.request.id, [])
        first = None
        samples = 0
        previous = None
        while True:
            asked = time.monotonic()
            try:
                chunk = await utterance.chunks.get()
            except ChannelClosed:
                break
            if first is None:
                first = time.monotonic()
                on_first_sample(first)
            elif (waited := time.monotonic() - asked) > GAP_S:
                silent = previous is not None and not previous.any()
                (after_pause if silent else gaps).append(waited)
                if not silent:
                    gaps_at.append(samples / utterance.sample_rate)
            previous = chunk
            samples += len(chunk)
            await asyncio.sleep(len(chunk) / utterance.sample_rate)  # plays in real time, as a speaker
        return PlaybackReport(first, time.monotonic(), 1000.0 * samples / utterance.sample_rate)

    async def close(self) -> None:
        return None


async def speak(
    speed: str,
    texts: list[str],
    shared: bool = False,
    max_wait_s: float = 60.0,
    learned: tuple[float, float] | None = None,
    speaker: RealTimeSpeaker | None = None,
) -> tuple[RealTimeSpeaker, Events]:
    """``texts`` one after another on the tone engine at ``speed`` x real time and a real-time
    speaker; ``shared``: the TTS stage shares the pacer (later sentences and clauses wait);
    ``max_wait_s``: ``audio.prebuffer_max_s`` (long by default: the formula alone); ``learned``:
    the engine's rate and seconds of audio per character, as if measured before."""
    engine = create_engine("tone", EngineOptions(model="tone", extra={"speed": speed, "ms_per_char": "40"}))
    worker = EngineWorker(engine)
    info = await worker.load()
    events = Events()
    requests = RequestQueue(8)
    ledger = Ledger(requests, events, 64)
    utterances: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances")
    speaker = speaker or RealTimeSpeaker()
    pacer = Pacer(max_wait_s=max_wait_s)
    if learned is not None:
        pacer.rate, pacer.seconds_per_char = learned
    tts = TtsStage(worker, info, requests, utterances, ledger, chunk_frames=2, pacer=pacer if shared else None)
    playback = PlaybackStage(speaker, utterances, ledger, pacer)
    tasks = [asyncio.create_task(tts.run()), asyncio.create_task(playback.run())]
    try:
        for i, text in enumerate(texts):
            job = ledger.submit(SayRequest(id=f"u{i}", text=text, voice=None, language="auto", site_id="t"))
            await asyncio.wait_for(job.done.wait(), 30)  # one at a time: each starts from an idle engine
    finally:
        requests.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await worker.close()
    return speaker, events


@pytest.mark.slow
async def test_a_slow_engine_is_played_without_gaps() -> None:
    text = "a sentence of about two seconds of audio, more or less"  # 55 chars x 40 ms
    speaker, events = await speak("0.6", [text, text])
    for rid in ("u0", "u1"):
        assert speaker.gaps[rid] == [], (rid, speaker.gaps[rid])
        payload = latency_payload(events.done[rid], INFO)
        assert events.done[rid].timeline.prebuffer_s > 0  # and the latency event says what was waited for
        assert payload["prebufferMs"] == round(events.done[rid].timeline.prebuffer_s * 1000.0, 1)


@pytest.mark.slow
async def test_a_long_text_waits_for_its_first_sentence_and_pauses_longer_between_sentences() -> None:
    sentence = "A sentence of about two seconds of audio, more or less."  # 55 chars x 40 ms
    speaker, events = await speak("0.6", [sentence, " ".join([sentence] * 3)], shared=True)
    one, three = events.done["u0"].timeline, events.done["u1"].timeline
    assert speaker.gaps["u1"] == []  # never inside a sentence
    assert len(speaker.after_pause["u1"]) >= 1  # the pause between sentences grew instead
    # The first sample waited for the first sentence, not for the three of them.
    assert three.prebuffer_s > 0 and three.prebuffer_s < 1.5 * max(one.prebuffer_s, 0.3)
    assert three.first_segment_chars == len(sentence)


@pytest.mark.slow
async def test_without_pacing_the_same_engine_stutters() -> None:
    original = Pacer.needed_s
    Pacer.needed_s = lambda self, rate, chars: 0.0  # type: ignore[method-assign]
    try:
        text = "a sentence of about two seconds of audio, more or less"
        speaker, _ = await speak("0.6", [text])
    finally:
        Pacer.needed_s = original  # type: ignore[method-assign]
    assert speaker.gaps["u0"], "the control run should stutter, or the test above proves nothing"


@pytest.mark.slow
async def test_a_fast_engine_keeps_the_short_start() -> None:
    text = "a sentence of about two seconds of audio, more or less"
    _, events = await speak("4", [text, text])
    for rid in ("u0", "u1"):  # the first utterance too: its first chunk came faster than it plays
        timeline = events.done[rid].timeline
        assert timeline.prebuffer_s == 0.0
        assert timeline.first_sample_out is not None and timeline.first_chunk is not None
        assert timeline.first_sample_out - timeline.first_chunk < 0.05


def test_the_buffer_asked_for_follows_the_formula() -> None:
    pacer = Pacer()
    tl = Timeline(received=0.0, synth_started=0.0, synth_done=8.0, audio_s=4.0)  # half real time
    pacer.learn(tl, chars=50)
    assert pacer.rate == 0.5
    expected = 50 * pacer.seconds_per_char
    assert abs(pacer.needed_s(0.5, 50) - expected * 0.5 * 1.15) < 1e-9
    assert pacer.needed_s(2.0, 50) == 0.0
    assert Pacer(enabled=False).needed_s(0.5, 50) == 0.0  # audio.gapless: false


@pytest.mark.slow
async def test_the_first_sample_waits_no_longer_than_the_bound_and_says_what_it_expects() -> None:
    text = "a sentence of about two seconds of audio, more or less"  # needs ~1.7 s of waiting at 0.6
    with capture_logs() as logs:
        speaker, events = await speak("0.6", [text, text], max_wait_s=0.4)
    for rid in ("u0", "u1"):
        tl = events.done[rid].timeline
        assert tl.dequeued is not None and tl.first_sample_out is not None and tl.first_chunk is not None
        # From its turn (taken from an idle queue; or its first chunk, when that came later): at most
        # the bound, and a poll.
        assert tl.first_sample_out - max(tl.dequeued, tl.first_chunk) < 0.4 + 0.15, rid
    expected = [e for e in logs if e["event"] == "prebuffering"]
    assert expected and all(0 < e["expected_wait_s"] <= 0.4 for e in expected)
    assert [e for e in logs if e["event"] == "prebuffer_cut"]  # what it did not wait for, said
    assert speaker.gaps["u1"], "cut short, the sentence stutters: the control for the clause test below"


@pytest.mark.slow
async def test_a_sentence_goes_clause_by_clause_so_its_first_clause_starts_within_the_bound() -> None:
    # The engine's speed is known (0.6 x real time, 40 ms a character). The whole sentence would
    # need about 1.7 s of waiting, more than the bound: cut short, it would stutter inside. Its
    # first clause needs about 0.7 s: it plays through, and the second waits for the first.
    text = "one clause of this size, and then a longer second clause."
    with capture_logs() as logs:
        speaker, events = await speak("0.6", [text], shared=True, max_wait_s=1.2, learned=(0.6, 0.04))
    assert speaker.gaps["u0"] == [], speaker.gaps_at["u0"]
    assert not [e for e in logs if e["event"] == "prebuffer_cut"]
    segments = [e["chars"] for e in logs if e["event"] == "segment_synthesized"]
    assert segments == [len(p) for p in clauses_of(text)] and len(segments) == 2
    tl = events.done["u0"].timeline
    assert tl.first_sample_out is not None and tl.dequeued is not None
    assert tl.first_sample_out - tl.dequeued < 1.2 + 0.15


def clauses_of(text: str) -> list[str]:
    from s2s_daemon.pipeline.segment import split_clauses

    return split_clauses(text)


@pytest.mark.slow
async def test_a_sink_not_heard_as_it_plays_never_waits() -> None:
    # The discard and WAV sinks: nobody hears them, so the first sample is never held.
    class Silent(RealTimeSpeaker):
        realtime = False

    text = "a sentence of about two seconds of audio, more or less"
    _, events = await speak("0.6", [text], speaker=Silent())
    tl = events.done["u0"].timeline
    assert tl.prebuffer_s == 0.0 and tl.first_sample_out is not None and tl.first_chunk is not None
    assert tl.first_sample_out - tl.first_chunk < 0.05
