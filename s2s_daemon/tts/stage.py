"""The TTS stage: takes requests in order, streams the engine's chunks to where they go.

Up to ``tts.max_streams`` requests are synthesized at once, each in a task of its own (its own
``request_id`` in the logs, its own ``tts.max_utterance_s``), their engine streams sharing the
one engine thread (``EngineWorker.stream``). The speaker's requests (no ``output``) hold one place
at a time, in queue order, held back by the VAD gate: the speaker plays one utterance after
another. A caller's request (HTTP, Wyoming) takes any free place, even when a speaker's request
that must wait is queued ahead of it. A speaker's utterance goes to the playback stage; a caller's
chunks go straight into its stream (``pipeline/output.py``), and this stage reports its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable

import numpy as np
import structlog

from s2s_daemon.pipeline.channel import Channel, ChannelClosed, Overflow
from s2s_daemon.pipeline.jobs import (
    ChunkMade,
    Failed,
    FirstSample,
    Job,
    Ledger,
    PlaybackEnded,
    Released,
    SegmentReady,
    SpeakerTurn,
    SynthesisEnded,
    SynthesisStarted,
    TextCut,
    Truncated,
)
from s2s_daemon.pipeline.messages import ErrorCode, PlaybackReport, SayRequest, Utterance
from s2s_daemon.pipeline.output import CallerStream
from s2s_daemon.pipeline.pacing import REAL_TIME, Pacer
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.segment import split_clauses, split_sentences
from s2s_daemon.pipeline.textfeed import FeedEnd, TextFeed
from s2s_daemon.pipeline.vocabulary import normalize_language
from s2s_daemon.pipeline.voices import LibraryVoice, VoiceKind, VoiceLibrary, pinned
from s2s_daemon.tts.engine import EngineError, EngineInfo, SynthesisRequest, UnknownVoiceError
from s2s_daemon.tts.runaway import MARGIN, RunawayCut, RunawayWatch
from s2s_daemon.tts.worker import EngineWorker

log = structlog.get_logger(__name__)

SEGMENT_MAX_CHARS = 300
"""A sentence longer than this is cut at a clause mark or a space (pipeline/segment.py)."""
SENTENCE_PAUSE_S = 0.15
"""Silence between two sentences of one request (the model's own trailing silence comes first)."""
CLAUSE_PAUSE_S = 0.05
"""Silence between two clauses of a sentence spoken clause by clause (a slow engine on the speaker)."""
CHUNK_BUFFER = 64
"""Chunks one utterance may hold ahead of playback before synthesis waits (back-pressure)."""

Deliver = Callable[[np.ndarray], Awaitable[bool]]
"""Hands one chunk on (to the speaker's utterance or a caller's stream); False once it is no
longer wanted (stopped, playback or the caller gone)."""


class TtsStage:
    """Owns synthesis: up to ``max_streams`` requests at once on the engine's worker thread, one
    of them the speaker's. A speaker's utterance goes to ``utterances`` (back-pressure: the
    speaker's backlog holds the next one back); a caller's chunks go into its own stream
    (``SayRequest.output``), which a busy speaker never holds up."""

    def __init__(
        self,
        worker: EngineWorker,
        info: EngineInfo,
        requests: RequestQueue,
        utterances: Channel[SpeakerTurn],
        ledger: Ledger,
        chunk_frames: int,
        gate: Callable[[], asyncio.Future[None] | None] | None = None,
        template: SynthesisRequest | None = None,
        library: VoiceLibrary | None = None,
        pacer: Pacer | None = None,
        max_streams: int = 1,
        paced_speaker: bool = True,
        runaway_margin: float = MARGIN,
    ) -> None:
        self.worker = worker
        self.info = info
        self.requests = requests
        self.utterances = utterances
        self.ledger = ledger
        self.chunk_frames = chunk_frames
        self.gate = gate
        """Returns an awaitable to hold the speaker's next utterance (VAD policy ``wait``), or None."""
        self.template = template or SynthesisRequest(text="", voice=None, language="auto")
        """Fixed synthesis settings (seed, greedy, reference audio) applied to every request."""
        self.library = library
        """Named voices: a request's library voice becomes the reference audio / instruction."""
        self._presets = {v.lower() for v in info.voices}
        self.pacer = pacer
        """The engine's speed as the speaker learned it (shared with the playback stage): on a
        slow engine each later sentence is held back until it will play without a gap."""
        self.paced_speaker = paced_speaker
        """The speaker is heard as it plays (``AudioSink.realtime``): its requests are paced
        (``SynthesisRequest.paced``: others keep out of its way). False for a file or the discard
        sink, which nobody hears: nothing waits for them."""
        self.runaway_margin = runaway_margin
        """``tts.runaway_margin``: cut a piece whose engine ran away (``tts/runaway.py``); 0: never."""
        self._places = asyncio.Semaphore(max_streams)
        """Requests synthesized at once (``tts.max_streams``); 1: one after another, in queue order."""
        self._speaker_busy = False
        """A speaker's request holds a place: waiting for the gate, for room in the speaker's
        backlog, or synthesizing. The next speaker's request waits; a caller's does not."""

    async def run(self) -> None:
        """Until the request queue is closed and empty, and every synthesis begun has ended."""
        try:
            async with asyncio.TaskGroup() as tg:
                while True:
                    await self._places.acquire()
                    try:
                        request = await self.requests.get(self._servable)
                    except ChannelClosed:
                        return  # once the syntheses begun have ended (the task group waits for them)
                    if request.output is None:
                        self._speaker_busy = True
                    tg.create_task(self._serve(request), name=f"s2s.tts.{request.id}")
        finally:
            self.utterances.close()

    def _servable(self, request: SayRequest) -> bool:
        return request.output is not None or not self._speaker_busy

    async def _serve(self, request: SayRequest) -> None:
        """One request in its own task: its log context and engine-time budget are its own."""
        try:
            with structlog.contextvars.bound_contextvars(request_id=request.id):
                # The gate holds the room's next utterance while someone speaks, not a caller's.
                if request.output is None and self.gate is not None and (hold := self.gate()) is not None:
                    await hold
                job = self.ledger.take(request)
                if job is not None:
                    await self._synthesize(job)
        finally:
            if request.output is None:
                self._speaker_busy = False
                self.requests.reconsider()
            self._places.release()

    async def _synthesize(self, job: Job) -> None:
        if job.request.output is not None:
            await self._answer(job, job.request.output)
            return
        chunks: Channel[np.ndarray] = Channel(CHUNK_BUFFER, Overflow.BLOCK, f"chunks.{job.request.id}")
        try:
            await self.utterances.put(SpeakerTurn(job, Utterance(job.request, self.info.sample_rate, chunks)))
        except ChannelClosed:
            self.ledger.record(job, Released(time.monotonic()))
            return

        async def deliver(chunk: np.ndarray) -> bool:
            try:
                await chunks.put(chunk)
            except ChannelClosed:  # playback ended early (stop, device error)
                return False
            return True

        try:
            await self._synthesize_into(job, deliver)
        finally:
            chunks.close()

    async def _answer(self, job: Job, output: CallerStream) -> None:
        """A caller's request: its chunks straight into its stream, and its end reported here
        (there is no playback for it). A stop closes the stream at once, even while synthesis
        waits for a slow reader; what was buffered is still read."""
        ledger = self.ledger
        request = job.request
        if job.should_stop():
            output.close()
            ledger.record(job, Released(time.monotonic()))
            return
        output.open(self.info.sample_rate, request.volume)

        async def deliver(chunk: np.ndarray) -> bool:
            if not await output.put(chunk):
                return False
            if output.first_sample_at is not None and job.timeline.first_sample_out is None:
                ledger.record(job, FirstSample(output.first_sample_at))
            return True

        async def close_on_stop() -> None:
            await job.stopped.wait()
            output.close()

        watch = asyncio.create_task(close_on_stop(), name=f"s2s.tts.{request.id}.stop")
        try:
            await self._synthesize_into(job, deliver)
            if not job.stopped.is_set():  # ended by itself (or failed): the stretcher's rest
                await output.finish()
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            stopped = job.stopped.is_set()
            output.close()
            now = time.monotonic()
            if stopped:  # as a stopped speaker: what was heard is estimated from the first sample
                ledger.record(job, PlaybackEnded(now))
            else:
                # A file sent whole goes out now (once complete; not when it failed): its first sample.
                first = output.complete(now) if job.status is None else output.first_sample_at
                if first is not None and job.timeline.first_sample_out is None:
                    ledger.record(job, FirstSample(first))
                ms = 1000.0 * output.samples / self.info.sample_rate if first is not None else 0.0
                ledger.record(job, PlaybackEnded(now, PlaybackReport(first, now if first is not None else None, ms)))

    async def _synthesize_into(self, job: Job, deliver: Deliver) -> None:
        request = job.request
        ledger = self.ledger
        synth = dataclasses.replace(
            self.template,
            text=request.to_speak,  # what the text stage made of the text asked
            voice=request.voice,
            language=request.language,
            instruct=request.instruct,
            chunk_frames=self.chunk_frames,
            paced=request.output is None and self.paced_speaker,  # others must not make it stutter
        )
        ledger.record(job, SynthesisStarted(time.monotonic()))
        log.debug("synthesis_started", chars=request.chars)
        named: str | None = None
        try:
            with contextlib.ExitStack() as pins:
                if self.library is not None and request.voice and request.voice.lower() not in self._presets:
                    named = request.voice
                    synth = self._with_library_voice(synth, named, pins)
                with self.worker.utterance():  # its sentences share tts.max_utterance_s
                    await self._speak_segments(job, synth, deliver)
        except EngineError as exc:
            message = f"voice {named!r}: {exc}" if named is not None else str(exc)
            log.warning("synthesis_failed", code=exc.code, error=message)
            ledger.record(job, Failed(time.monotonic(), ErrorCode.parse(exc.code), message))
        except (RuntimeError, ValueError, MemoryError, OSError) as exc:
            # Backend failures surface as these from torch/mlx/numpy: per-request, not fatal.
            log.exception("synthesis_crashed")
            message = f"{type(exc).__name__}: {exc}"
            message = f"voice {named!r}: {message}" if named is not None else message
            ledger.record(job, Failed(time.monotonic(), ErrorCode.ENGINE_ERROR, message))
        finally:
            ledger.record(job, SynthesisEnded(time.monotonic()))

    async def _speak_segments(self, job: Job, synth: SynthesisRequest, deliver: Deliver) -> None:
        """The text sentence by sentence, each its own engine call (its prompt and KV cache hold
        one sentence, not the request), with a short pause between, into the one utterance. A
        streamed text's sentences are spoken as its writer completes them. On a speaker whose
        engine is slower than real time each sentence is spoken clause by clause, so that the
        pauses the engine's speed makes fall between clauses rather than inside words."""
        pause = np.zeros(round(SENTENCE_PAUSE_S * self.info.sample_rate), np.float32)
        clause_pause = np.zeros(round(CLAUSE_PAUSE_S * self.info.sample_rate), np.float32)
        spoken = 0
        async with contextlib.aclosing(self._segments(job, synth.text)) as segments:
            async for sentence in segments:
                for index, text in enumerate(self._pieces(sentence, job)):
                    if not await self._speak_piece(job, synth, deliver, text, spoken, clause_pause if index else pause):
                        return
                    spoken += 1
        feed = job.request.feed
        if feed is not None and not job.should_stop():
            self._feed_ended(job, feed, spoken)

    def _pieces(self, sentence: str, job: Job) -> list[str]:
        """A sentence, or its clauses on a paced speaker whose engine is slower than real time."""
        pacer = self.pacer
        if job.request.output is not None or not self.paced_speaker or pacer is None or not pacer.enabled:
            return [sentence]
        if pacer.rate is None or pacer.rate >= REAL_TIME:
            return [sentence]
        return split_clauses(sentence)

    async def _speak_piece(
        self,
        job: Job,
        synth: SynthesisRequest,
        deliver: Deliver,
        text: str,
        spoken: int,
        pause: np.ndarray,
    ) -> bool:
        """One sentence or clause into the utterance (``pause`` before it, unless it is the first);
        False when the request ended early (stopped, playback gone)."""
        self.ledger.record(job, SegmentReady(time.monotonic(), len(text)))
        if spoken and not await self._put(job, deliver, pause):
            return False
        # The first piece's start is the speaker's to pace (audio/playback.py); a later one, on an
        # engine slower than real time, waits here until the rest of it will come in time: the gap
        # falls between clauses and sentences, never inside a word.
        hold_s = self._hold_s(len(text)) if spoken else 0.0
        held: list[np.ndarray] = []
        held_s = 0.0
        margin = self.runaway_margin
        watch = RunawayWatch(text, self.info.sample_rate, margin) if margin > 0 else None
        async with contextlib.aclosing(
            self.worker.stream(dataclasses.replace(synth, text=text), job.should_stop)
        ) as pieces:
            async for chunk in pieces:
                if job.should_stop():
                    return False
                cut = watch.add(chunk) if watch is not None else None
                if cut is not None:  # the engine ran away: cut there (closing the stream stops it)
                    self._runaway(job, text, spoken, cut)
                    break
                if held_s < hold_s:
                    held_s += self._made(job, chunk)
                    held.append(chunk)
                    if held_s < hold_s:
                        continue
                    log.debug("sentence_held", segment=spoken + 1, held_s=round(held_s, 2))
                    if not await self._flush(deliver, held):
                        return False
                    continue
                if not await self._put(job, deliver, chunk):
                    return False
        if held and not await self._flush(deliver, held):
            return False
        log.debug("segment_synthesized", segment=spoken + 1, chars=len(text))
        return True

    def _runaway(self, job: Job, text: str, spoken: int, cut: RunawayCut) -> None:
        log.warning(
            "runaway_cut",
            request_id=job.request.id,
            cause=cut.cause,
            segment=spoken + 1,
            chars=len(text),
            audio_s=round(cut.audio_s, 2),
            budget_s=round(cut.budget_s, 2),
            truncated="runaway",
        )
        self.ledger.record(job, Truncated(time.monotonic(), "runaway", cut.cause))

    def _segments(self, job: Job, text: str) -> AsyncGenerator[str, None]:
        feed = job.request.feed
        if feed is not None:
            return feed.sentences(SEGMENT_MAX_CHARS, job.stopped)
        return _aiter(split_sentences(text, SEGMENT_MAX_CHARS, complete=True, first=True)[0] or [text])

    def _feed_ended(self, job: Job, feed: TextFeed, spoken: int) -> None:
        """A streamed text was read to its end: an early end (its writer went quiet, it grew too
        long, a bad piece) is the request's error once what came has played."""
        log.debug(
            "text_prepared",
            request_id=job.request.id,
            asked_chars=feed.chars,
            spoken_chars=feed.spoken_chars,
            changed=feed.changed,
        )
        why = {
            FeedEnd.IDLE: ErrorCode.STREAM_IDLE,
            FeedEnd.TOO_LONG: ErrorCode.TEXT_TOO_LONG,
            FeedEnd.BAD_PIECE: ErrorCode.BAD_PAYLOAD,
            FeedEnd.SHUTDOWN: ErrorCode.SHUTTING_DOWN,
        }.get(feed.end or FeedEnd.CLOSED)
        if why is not None:
            log.warning("stream_ended_early", reason=str(feed.end), detail=feed.end_detail, chars=feed.chars)
            message = f"{feed.end_detail}; the {feed.chars} characters before were spoken"
            self.ledger.record(job, TextCut(time.monotonic(), why, message))
        elif spoken == 0:
            empty = "the stream closed without text"
            if feed.asked_text:  # only emoji, markup or code: the text stage left nothing to say
                empty = "the streamed text has nothing to speak once prepared: only emoji, markup or code"
            self.ledger.record(job, Failed(time.monotonic(), ErrorCode.EMPTY_TEXT, empty))

    def _hold_s(self, chars: int) -> float:
        """Seconds of a sentence of ``chars`` to buffer before it plays (0: an engine faster than
        real time, or one not measured yet)."""
        if self.pacer is None or self.pacer.rate is None:
            return 0.0
        return self.pacer.needed_s(self.pacer.rate, chars)

    def _made(self, job: Job, chunk: np.ndarray) -> float:
        """Tell the ledger the engine made ``chunk``; its seconds."""
        seconds = len(chunk) / self.info.sample_rate
        self.ledger.record(job, ChunkMade(time.monotonic(), seconds))
        return seconds

    @staticmethod
    async def _flush(deliver: Deliver, held: list[np.ndarray]) -> bool:
        """Hand on what was held back (already counted as made); False once it is no longer wanted."""
        for chunk in held:
            if not await deliver(chunk):
                return False
        held.clear()
        return True

    async def _put(self, job: Job, deliver: Deliver, chunk: np.ndarray) -> bool:
        """Hand ``chunk`` on; False once it is no longer wanted (stop, device error, caller gone)."""
        self._made(job, chunk)
        return await deliver(chunk)

    def _with_library_voice(self, synth: SynthesisRequest, name: str, pins: contextlib.ExitStack) -> SynthesisRequest:
        """``synth`` speaking the library voice ``name`` (read afresh: it may have changed or gone),
        its recording pinned in ``pins`` for the request's every sentence."""
        assert self.library is not None
        voice: LibraryVoice | None = self.library.lookup(name)
        gone = UnknownVoiceError(f"voice {name!r} is no longer in the voice library")
        if voice is None:
            raise gone
        language = synth.language
        if language == "auto" and voice.language is not None:
            try:
                language = normalize_language(voice.language, self.info.languages)
            except EngineError:
                log.warning("voice_language_ignored", voice=name, language=voice.language)
        if self.library.kind is VoiceKind.CLONE:
            try:  # renamed or removed while the request speaks: its later sentences still have it
                recording = pins.enter_context(pinned(voice.ref_audio)) if voice.ref_audio else None
            except FileNotFoundError:
                raise gone from None
            return dataclasses.replace(
                synth,
                voice=None,
                language=language,
                ref_audio=str(recording) if recording is not None else None,
                ref_text=voice.ref_text,
            )
        # A designed voice: its description, then the request's own instruction.
        instruct = " ".join(part for part in (voice.instruct, synth.instruct) if part)
        return dataclasses.replace(synth, voice=None, language=language, instruct=instruct or None)


async def _aiter(items: Iterable[str]) -> AsyncGenerator[str, None]:
    for item in items:
        yield item
