"""The playback stage: the speaker's alone. Hands its utterances to the sink one at a time, in
order, and ends their jobs. A caller's audio (``SayRequest.output``) never comes here: the TTS
stage writes it into the caller's stream (``pipeline/output.py``)."""

from __future__ import annotations

import asyncio
import time

import structlog

from s2s_daemon.audio.sink import AudioDeviceError, AudioSink
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import (
    Failed,
    FirstSample,
    Job,
    Ledger,
    OnSpeaker,
    PlaybackEnded,
    Prebuffered,
    Released,
    SpeakerTurn,
)
from s2s_daemon.pipeline.messages import ErrorCode, PlaybackReport, Status, Utterance
from s2s_daemon.pipeline.pacing import REAL_TIME, Pacer

log = structlog.get_logger(__name__)

POLL_S = 0.02
"""How often a slow engine's buffer is looked at while the speaker waits for it."""


class PlaybackStage:
    def __init__(
        self,
        sink: AudioSink,
        utterances: Channel[SpeakerTurn],
        ledger: Ledger,
        pacer: Pacer | None = None,
    ) -> None:
        self.sink = sink
        self.utterances = utterances
        self.ledger = ledger
        self.pacer = pacer or Pacer()
        """What the speaker learns of the engine's speed (gapless playback on slow hardware); the
        TTS stage reads it to hold back each later sentence of an utterance."""

    async def run(self) -> None:
        """Until ``utterances`` is closed and every utterance has played."""
        # The speaker plays one utterance after another; one more waits in ``speaker`` and one in
        # the taker's hand, so that the next ones are synthesized while one plays.
        speaker: Channel[SpeakerTurn] = Channel(1, Overflow.BLOCK, "utterances.speaker")
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._speak(speaker), name="s2s.playback.speaker")
            try:
                async for turn in self.utterances:
                    await speaker.put(turn)
            finally:
                speaker.close()

    async def _speak(self, speaker: Channel[SpeakerTurn]) -> None:
        async for turn in speaker:
            with structlog.contextvars.bound_contextvars(request_id=turn.job.request.id):
                await self._play(turn.job, turn.utterance)

    async def _play(self, job: Job, utterance: Utterance) -> None:
        ledger = self.ledger
        if job.should_stop():  # stopped, or ended, while it waited its turn
            utterance.chunks.clear()
            utterance.chunks.close()
            ledger.record(job, Released(time.monotonic()))  # a job that ended already ignores it
            return
        ledger.record(job, OnSpeaker(time.monotonic()))
        waited = await self._prebuffer(job, utterance)
        if waited > 0:
            ledger.record(job, Prebuffered(time.monotonic(), waited))
        if job.stopped.is_set():  # stopped while it was held: none of it is let out
            utterance.chunks.clear()
            utterance.chunks.close()
            ledger.record(job, Released(time.monotonic()))
            return
        task: asyncio.Task[PlaybackReport] = asyncio.create_task(
            self.sink.play(utterance, lambda at: ledger.record(job, FirstSample(at))),
            name=f"s2s.playback.{utterance.request.id}",
        )
        stop = asyncio.create_task(job.stopped.wait(), name=f"s2s.playback.{utterance.request.id}.stop")
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():  # stopped (stop, barge-in, shutdown) or this stage was cancelled
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        # Whatever the engine still holds for this utterance is no longer wanted.
        utterance.chunks.clear()
        utterance.chunks.close()
        now = time.monotonic()
        if task.cancelled():
            ledger.record(job, PlaybackEnded(now))
            log.info("playback_stopped", status=str(job.status))
        elif (exc := task.exception()) is not None:
            if isinstance(exc, AudioDeviceError):
                log.warning("playback_failed", error=str(exc))
                ledger.record(job, Failed(now, ErrorCode.AUDIO_ERROR, str(exc)))
            else:
                log.error("playback_crashed", error=repr(exc))
                ledger.record(job, Failed(now, ErrorCode.AUDIO_ERROR, f"{type(exc).__name__}: {exc}"))
            ledger.record(job, PlaybackEnded(now))
        else:
            ledger.record(job, PlaybackEnded(now, task.result()))
        if job.status is Status.COMPLETED:  # what the engine does when it runs to the end
            self.pacer.learn(job.timeline, job.request.chars)

    async def _prebuffer(self, job: Job, utterance: Utterance) -> float:
        """Hold the first sample until enough audio is buffered for the rest to arrive in time
        (``pipeline/pacing.py``), at most ``Pacer.max_wait_s`` from now (its turn) or until its
        first chunk; seconds of audio buffered when it waited, else 0. Only a sink heard as it plays
        (``AudioSink.realtime``) waits: a file or the discard sink gains nothing from it."""
        tl, chunks = job.timeline, utterance.chunks
        rate = self.pacer.rate
        if not self.pacer.enabled or not self.sink.realtime:
            return 0.0
        if rate is not None and rate >= REAL_TIME:
            return 0.0
        deadline = time.monotonic() + self.pacer.max_wait_s
        need: float | None = None
        waited = cut = False
        feed = job.request.feed
        while not chunks.closed and not job.should_stop() and len(chunks) < chunks.maxsize - 1:
            if feed is not None and feed.waiting and tl.chunks:
                break  # the engine waits for the writer: nothing more comes until it writes
            if tl.chunks and time.monotonic() >= deadline:
                if need is not None and tl.audio_s < need:
                    log.info(
                        "prebuffer_cut",
                        buffered_s=round(tl.audio_s, 2),
                        need_s=round(need, 2),
                        max_wait_s=self.pacer.max_wait_s,
                    )
                cut = True
                break
            if rate is None and need is None and tl.chunks and tl.first_chunk is not None:
                # Nothing learned yet: a first chunk made faster than it plays, prefill included
                # (from when its text was complete: a streamed text waits for its writer first),
                # means a fast engine (start now); otherwise measure on the second chunk.
                began = max(t for t in (tl.synth_started, tl.first_text, tl.dequeued) if t is not None)
                first_rate = (tl.audio_s / tl.chunks) / max(tl.first_chunk - began, 1e-3)
                if first_rate >= REAL_TIME:
                    return 0.0
            if rate is None and tl.chunks >= 2 and tl.first_chunk is not None:
                # This utterance's own rate since its first chunk (which carries the prefill).
                since = max(time.monotonic() - tl.first_chunk, 1e-3)
                rate = (tl.audio_s - tl.audio_s / tl.chunks) / since
            if rate is not None and need is None and tl.first_text is not None:
                # The first sentence only (known once its text went to the engine): the TTS stage
                # holds back each later one until it will play without a gap (a longer pause
                # between sentences, never a stutter inside one).
                if self.pacer.rate is None:
                    self.pacer.rate = rate  # measured on this utterance: until one is learned
                need = self.pacer.needed_s(rate, tl.first_segment_chars or job.request.chars)
                if need > tl.audio_s:
                    left_s = max(0.0, deadline - time.monotonic())
                    log.info(
                        "prebuffering",
                        rate=round(rate, 2),
                        need_s=round(need, 2),
                        expected_wait_s=round(min(left_s, (need - tl.audio_s) / max(rate, 1e-3)), 2),
                        max_wait_s=self.pacer.max_wait_s,
                    )
            if need is not None and tl.audio_s >= need:
                break
            waited = waited or need is None or need > 0
            await asyncio.sleep(POLL_S)
        return tl.audio_s if waited and (need or cut) else 0.0
