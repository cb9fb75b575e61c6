# ruff: noqa: RUF001 -- full-width CJK marks are the point
"""A text still being written: pieces in order, sentences out (pipeline/textfeed.py), and the
TTS stage speaking them as they come."""

from __future__ import annotations

import asyncio
import time

import pytest

from s2s_daemon.audio.playback import PlaybackStage
from s2s_daemon.audio.sink import DiscardSink
from s2s_daemon.config import TextConfig
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import Job, Ledger, SpeakerTurn
from s2s_daemon.pipeline.messages import ErrorCode, SayRequest, Status
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.segment import split_sentences
from s2s_daemon.pipeline.textfeed import FeedEnd, TextFeed
from s2s_daemon.text import TextStage
from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.stage import TtsStage
from s2s_daemon.tts.worker import EngineWorker
from tests.support.events import Events
from tests.support.wait import loop_turns, until


async def read_all(feed: TextFeed, stopped: asyncio.Event | None = None) -> list[str]:
    return [s async for s in feed.sentences(300, stopped or asyncio.Event())]


async def test_pieces_out_of_order_and_repeated_read_as_the_text() -> None:
    feed = TextFeed(1000, 5.0)
    pieces = ["Hello there. ", "How are ", "you today? ", "Fine", "."]
    order = [1, 0, 1, 3, 2, 0, 4]
    taken = [feed.add(i, pieces[i], last=i == 4) for i in order]
    assert taken == [True, True, False, True, True, False, True]
    assert feed.end is FeedEnd.CLOSED
    assert await read_all(feed) == ["Hello there.", "How are you today?", "Fine."]
    assert feed.chars == len("".join(pieces))


async def test_through_its_text_stage_only_the_sentence_being_written_is_held_back() -> None:
    """The text stage gives a sentence out once the next one starts (a list item once the next line
    shows it ended); the feed hands it on at once, not after the stage's next output (what the stage
    gives out ends where a sentence may: ``at_boundary``)."""
    feed = TextFeed(1000, 5.0, stage=TextStage(TextConfig()).stream("english"))
    stopped = asyncio.Event()
    got: list[tuple[str, int]] = []

    async def reader() -> None:
        async for sentence in feed.sentences(300, stopped):
            got.append((sentence, feed.pieces))

    task = asyncio.create_task(reader())
    pieces = ["Here is **the", " plan** for today. We", " go out.\n\n- First item\n- Sec", "ond item\n\n", "Done"]
    for seq, piece in enumerate(pieces):
        feed.add(seq, piece)
        await asyncio.sleep(0.01)
    # (sentence, pieces taken when it came): each as soon as the piece that showed its end
    assert got == [("Here is the plan for today.", 2), ("We go out.", 3), ("First item.", 3), ("Second item.", 4)]
    feed.add(len(pieces), "", last=True)
    await asyncio.wait_for(task, 1)
    assert got[-1] == ("Done.", len(pieces) + 1)
    assert feed.chars == len("".join(pieces)) and feed.spoken_chars == len("\n".join(s for s, _ in got))
    assert feed.changed


async def test_sentences_come_while_the_text_is_still_written() -> None:
    feed = TextFeed(1000, 5.0)
    stopped = asyncio.Event()
    got: list[tuple[str, int]] = []

    async def reader() -> None:
        async for sentence in feed.sentences(300, stopped):
            got.append((sentence, feed.pieces))

    task = asyncio.create_task(reader())
    for seq, piece in enumerate(["The first ", "sentence. The"]):
        feed.add(seq, piece)
        await loop_turns()
    await until(lambda: got, 5, "the first sentence")
    for seq, piece in enumerate([" second one", " is longer."], start=2):
        feed.add(seq, piece)
        await loop_turns()
    assert got == [("The first sentence.", 2)]  # spoken before the rest was written
    feed.add(4, "", last=True)
    await asyncio.wait_for(task, 1)
    assert [s for s, _ in got] == ["The first sentence.", "The second one is longer."]


async def test_the_first_clause_goes_first_while_its_sentence_is_written() -> None:
    feed = TextFeed(1000, 5.0)
    feed.add(0, "According to the weather report, it will")
    reader = feed.sentences(300, asyncio.Event())
    assert await asyncio.wait_for(anext(reader), 1) == "According to the weather report,"
    feed.add(1, " rain.", last=True)
    assert [s async for s in reader] == ["it will rain."]


async def test_a_writer_that_goes_quiet_ends_the_feed_with_what_came() -> None:
    feed = TextFeed(1000, 0.2)
    feed.add(0, "Half a sentence, then")
    feed.add(2, " a piece after a gap")
    start = time.monotonic()
    assert await read_all(feed) == ["Half a sentence, then"]
    assert 0.15 < time.monotonic() - start < 2
    assert feed.end is FeedEnd.IDLE
    assert "0.2 s" in feed.end_detail


async def test_a_stop_ends_the_reading_at_once() -> None:
    feed = TextFeed(1000, 30.0)
    stopped = asyncio.Event()
    feed.add(0, "Never finished")
    task = asyncio.create_task(read_all(feed, stopped))
    await until(lambda: feed.waiting, 5, "the reader waiting for more")
    stopped.set()
    assert await asyncio.wait_for(task, 1) == []


def test_too_long_and_late_pieces() -> None:
    feed = TextFeed(10, 5.0)
    assert feed.add(0, "12345")
    assert feed.add(1, "678901")
    assert feed.end is FeedEnd.TOO_LONG
    assert feed.pending() == "12345"
    assert not feed.add(2, "x")  # after the end: changes nothing
    closed = TextFeed(100, 5.0)
    closed.add(0, "a", last=True)
    assert not closed.add(1, "b")
    early = TextFeed(100, 5.0)  # pieces waiting for the ones before them count as received
    early.add(2, "orphan")
    early.add(4, "s")
    assert (early.chars, early.received_chars, early.received_pieces) == (0, 7, 2)


def test_pieces_waiting_for_a_gap_count_against_the_limit_as_they_come() -> None:
    """Pieces after a missing one were held uncounted: a writer that never sends piece 0 could
    park any amount of text in one request."""
    feed = TextFeed(10, 5.0)
    assert feed.add(1, "123456")
    assert feed.add(2, "7890")  # exactly the limit, still waiting for piece 0
    assert feed.end is None and feed.received_chars == 10
    assert feed.add(3, "x")
    assert feed.end is FeedEnd.TOO_LONG and "10 characters at piece 3" in feed.end_detail
    assert feed.received_chars == 0  # what waited is let go
    huge = TextFeed(2000, 5.0)
    huge.add(5, "Ab. " * 1_000_000)
    assert huge.end is FeedEnd.TOO_LONG and huge.received_chars == 0


# -- the TTS stage with a streamed text ------------------------------------------------------


class Rig:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []
        self.events = Events()

    async def __aenter__(self) -> Rig:
        engine = create_engine("tone", EngineOptions(model="tone", extra={"speed": "0", "ms_per_char": "20"}))
        original = engine.synthesize_blocking

        def recording(request: SynthesisRequest, should_stop):  # type: ignore[no-untyped-def]
            self.seen.append((request.text, time.monotonic()))
            return original(request, should_stop)

        engine.synthesize_blocking = recording  # type: ignore[method-assign]
        self.worker = EngineWorker(engine)
        info = await self.worker.load()
        self.requests = RequestQueue(4)
        self.ledger = Ledger(self.requests, self.events, 16)
        utterances: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances")
        self.tasks = [
            asyncio.create_task(TtsStage(self.worker, info, self.requests, utterances, self.ledger, 4).run()),
            asyncio.create_task(PlaybackStage(DiscardSink(), utterances, self.ledger).run()),
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.requests.close()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 10)
        await self.worker.close()

    def submit(self, rid: str, feed: TextFeed) -> Job:
        return self.ledger.submit(SayRequest(id=rid, text="", voice=None, language="auto", site_id="t", feed=feed))


async def test_the_stage_speaks_each_sentence_once_its_writer_completes_it() -> None:
    async with Rig() as rig:
        feed = TextFeed(1000, 5.0)
        job = rig.submit("s", feed)
        feed.add(0, "One sentence here. And")
        await until(lambda: rig.seen and feed.waiting, 5, "the first sentence spoken, the stage waiting")
        assert [t for t, _ in rig.seen] == ["One sentence here."]
        written = time.monotonic()
        feed.add(1, " another one.", last=True)
        await asyncio.wait_for(job.done.wait(), 5)
        assert [t for t, _ in rig.seen] == ["One sentence here.", "And another one."]
        assert rig.seen[1][1] >= written
        assert job.status is Status.COMPLETED
        tl = job.timeline
        assert tl.first_text is not None and tl.first_chunk is not None and tl.first_text <= tl.first_chunk


@pytest.mark.parametrize(
    ("end", "code"),
    [
        (FeedEnd.IDLE, ErrorCode.STREAM_IDLE),
        (FeedEnd.TOO_LONG, ErrorCode.TEXT_TOO_LONG),
        (FeedEnd.BAD_PIECE, ErrorCode.BAD_PAYLOAD),
        (FeedEnd.SHUTDOWN, ErrorCode.SHUTTING_DOWN),
    ],
)
async def test_an_early_end_speaks_what_came_then_says_why(end: FeedEnd, code: ErrorCode) -> None:
    async with Rig() as rig:
        feed = TextFeed(1000, 30.0)
        job = rig.submit("s", feed)
        feed.add(0, "What came before the end")
        await until(lambda: feed.waiting, 5, "the stage waiting for more")
        feed.stop(end, "it ended")
        await asyncio.wait_for(job.done.wait(), 5)
        assert [t for t, _ in rig.seen] == ["What came before the end"]
        assert job.status is Status.ERROR
        assert job.error is not None and job.error.code is code
        assert job.timeline.played_ms and job.timeline.played_ms > 0


async def test_a_stream_closed_without_text_is_an_error_and_a_stop_ends_a_waiting_stream() -> None:
    async with Rig() as rig:
        empty = TextFeed(1000, 30.0)
        job = rig.submit("empty", empty)
        empty.add(0, "  ", last=True)
        await asyncio.wait_for(job.done.wait(), 5)
        assert job.status is Status.ERROR and job.error is not None and job.error.code is ErrorCode.EMPTY_TEXT
        waiting = TextFeed(1000, 30.0)
        job = rig.submit("waiting", waiting)
        waiting.add(0, "A sentence. And then nothing")
        await until(lambda: rig.seen and waiting.waiting, 5, "the first sentence spoken, the stage waiting")
        assert rig.ledger.stop_id("waiting")
        await asyncio.wait_for(job.done.wait(), 2)
        assert job.status is Status.INTERRUPTED
        assert [t for t, _ in rig.seen] == ["A sentence."]


def test_whole_texts_start_from_their_first_clause_when_their_first_sentence_is_long() -> None:
    text = "When the rain stops tomorrow morning, we will all go out to the park together. See you."
    assert split_sentences(text, 300, complete=True, first=True)[0] == [
        "When the rain stops tomorrow morning,",
        "we will all go out to the park together.",
        "See you.",
    ]
    short = "Yes, it works. Good."
    assert split_sentences(short, 300, complete=True, first=True)[0] == ["Yes, it works.", "Good."]
    cjk = "今天下午的天气预报说，明天早上北方和东部地区将会有大雨。"
    assert split_sentences(cjk, 300, complete=True, first=True)[0] == [
        "今天下午的天气预报说，",
        "明天早上北方和东部地区将会有大雨。",
    ]
