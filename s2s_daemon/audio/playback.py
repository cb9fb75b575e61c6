"""The playback stage: hands utterances to the speaker's sink one at a time, and those bound
for a caller (``SayRequest.output``) to their own output at once; ends their jobs."""

from __future__ import annotations

import asyncio
import time

import structlog

from s2s_daemon.audio.sink import AudioDeviceError, AudioSink
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.jobs import Dispatcher, Job, Phase
from s2s_daemon.pipeline.messages import AudioOutput, ErrorCode, PlaybackReport, Utterance

log = structlog.get_logger(__name__)


class PlaybackStage:
    def __init__(self, sink: AudioSink, utterances: Channel[Utterance], dispatcher: Dispatcher) -> None:
        self.sink = sink
        self.utterances = utterances
        self.dispatcher = dispatcher

    async def run(self) -> None:
        # The speaker plays one utterance after another (one more waits in ``speaker``); a
        # caller's output plays as soon as its utterance comes, beside the speaker and the others.
        speaker: Channel[Utterance] = Channel(1, Overflow.BLOCK, "utterances.speaker")
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._speak(speaker), name="s2s.playback.speaker")
            try:
                async for utterance in self.utterances:
                    output = utterance.request.output
                    if output is None:
                        await speaker.put(utterance)
                        continue
                    tg.create_task(self._play_logged(utterance, output), name=f"s2s.output.{utterance.request.id}")
            finally:
                speaker.close()

    async def _speak(self, speaker: Channel[Utterance]) -> None:
        async for utterance in speaker:
            with structlog.contextvars.bound_contextvars(request_id=utterance.request.id):
                await self._play(utterance, self.sink, speaker=True)

    async def _play_logged(self, utterance: Utterance, output: AudioOutput) -> None:
        with structlog.contextvars.bound_contextvars(request_id=utterance.request.id, output=output.name):
            await self._play(utterance, output, speaker=False)

    async def _play(self, utterance: Utterance, sink: AudioSink | AudioOutput, speaker: bool) -> None:
        dispatcher = self.dispatcher
        job = dispatcher.jobs.get(utterance.request.id)
        if job is None or job.phase is Phase.DONE:
            utterance.chunks.clear()
            utterance.chunks.close()
            return
        if job.cancelled:
            utterance.chunks.clear()
            utterance.chunks.close()
            dispatcher.complete(job)
            return
        if speaker:
            dispatcher.current = job
        task: asyncio.Task[PlaybackReport] = asyncio.create_task(
            sink.play(utterance, lambda at: dispatcher.first_sample(job, at)),
            name=f"s2s.playback.{utterance.request.id}",
        )
        job.play_task = task
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # this stage itself was cancelled (shutdown)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        job.play_task = None
        if task.cancelled() or task.exception() is not None:
            self._stopped_at(job, time.monotonic())
        if task.cancelled():
            log.info("playback_stopped", status=str(job.status), played_ms=job.timeline.played_ms)
        elif (exc := task.exception()) is not None:
            if isinstance(exc, AudioDeviceError):
                log.warning("playback_failed", error=str(exc))
                dispatcher.fail(job, ErrorCode.AUDIO_ERROR, str(exc))
            else:
                log.error("playback_crashed", error=repr(exc))
                dispatcher.fail(job, ErrorCode.AUDIO_ERROR, f"{type(exc).__name__}: {exc}")
        else:
            report = task.result()
            job.timeline.underruns = report.underruns
            if report.first_sample_at is not None and job.timeline.first_sample_out is None:
                job.timeline.first_sample_out = report.first_sample_at
            job.timeline.last_sample_played = report.last_sample_at
            job.timeline.played_ms = report.audio_ms
        # Whatever the engine still holds for this utterance is no longer wanted.
        job.cancelled = True
        utterance.chunks.clear()
        utterance.chunks.close()
        dispatcher.complete(job)

    @staticmethod
    def _stopped_at(job: Job, now: float) -> None:
        """Playback ended early: the audio heard is the time since the first sample, at most what
        was synthesized (the sink plays in real time); nothing when no sample played."""
        tl = job.timeline
        if tl.first_sample_out is None:
            tl.played_ms = 0.0
            return
        tl.last_sample_played = now
        tl.played_ms = round(min(tl.audio_s, max(0.0, now - tl.first_sample_out)) * 1000.0, 1)
