"""The TTS stage: takes requests in order, streams the engine's chunks to the sink."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import structlog

from s2s_daemon.pipeline.channel import Channel, ChannelClosed, Overflow
from s2s_daemon.pipeline.jobs import ChunkMade, Dispatcher, Failed, Job, Released, SynthesisEnded, SynthesisStarted
from s2s_daemon.pipeline.messages import ErrorCode, Utterance
from s2s_daemon.pipeline.queue import RequestQueue
from s2s_daemon.pipeline.segment import split_sentences
from s2s_daemon.pipeline.vocabulary import normalize_language
from s2s_daemon.pipeline.voices import LibraryVoice, VoiceKind, VoiceLibrary
from s2s_daemon.tts.engine import EngineError, EngineInfo, SynthesisRequest, UnknownVoiceError
from s2s_daemon.tts.worker import EngineWorker

log = structlog.get_logger(__name__)

SEGMENT_MAX_CHARS = 300
"""A sentence longer than this is cut at a clause mark or a space (pipeline/segment.py)."""
SENTENCE_PAUSE_S = 0.15
"""Silence between two sentences of one request (the model's own trailing silence comes first)."""
CHUNK_BUFFER = 64
"""Chunks one utterance may hold ahead of playback before synthesis waits (back-pressure)."""


class TtsStage:
    """Owns synthesis. Runs one request at a time on the engine's worker thread."""

    def __init__(
        self,
        worker: EngineWorker,
        info: EngineInfo,
        requests: RequestQueue,
        utterances: Channel[Utterance],
        dispatcher: Dispatcher,
        chunk_frames: int,
        gate: Callable[[], asyncio.Future[None] | None] | None = None,
        template: SynthesisRequest | None = None,
        library: VoiceLibrary | None = None,
    ) -> None:
        self.worker = worker
        self.info = info
        self.requests = requests
        self.utterances = utterances
        self.dispatcher = dispatcher
        self.chunk_frames = chunk_frames
        self.gate = gate
        self.template = template or SynthesisRequest(text="", voice=None, language="auto")
        """Fixed synthesis settings (seed, greedy, reference audio) applied to every request."""
        """Returns an awaitable to hold the next utterance (VAD policy ``wait``), or None."""
        self.library = library
        """Named voices: a request's library voice becomes the reference audio / instruction."""
        self._presets = {v.lower() for v in info.voices}

    async def run(self) -> None:
        try:
            while True:
                try:
                    request = await self.requests.get()
                except ChannelClosed:
                    return
                if self.gate is not None and (hold := self.gate()) is not None:
                    await hold
                job = self.dispatcher.take(request)
                if job is None:
                    continue
                with structlog.contextvars.bound_contextvars(request_id=request.id):
                    await self._synthesize(job)
        finally:
            self.utterances.close()

    async def _synthesize(self, job: Job) -> None:
        request = job.request
        ledger = self.dispatcher
        chunks: Channel[np.ndarray] = Channel(CHUNK_BUFFER, Overflow.BLOCK, f"chunks.{request.id}")
        utterance = Utterance(request, self.info.sample_rate, chunks)
        try:
            await self.utterances.put(utterance)
        except ChannelClosed:
            ledger.record(job, Released(time.monotonic()))
            return
        synth = dataclasses.replace(
            self.template,
            text=request.text,
            voice=request.voice,
            language=request.language,
            instruct=request.instruct,
            chunk_frames=self.chunk_frames,
        )
        ledger.record(job, SynthesisStarted(time.monotonic()))
        log.debug("synthesis_started", chars=len(request.text))
        named: str | None = None
        try:
            if self.library is not None and request.voice and request.voice.lower() not in self._presets:
                named = request.voice
                synth = self._with_library_voice(synth, named)
            with self.worker.utterance():  # its sentences share tts.max_utterance_s
                await self._speak_segments(job, synth, chunks)
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
            chunks.close()

    async def _speak_segments(self, job: Job, synth: SynthesisRequest, chunks: Channel[np.ndarray]) -> None:
        """The text sentence by sentence, each its own engine call (its prompt and KV cache hold
        one sentence, not the request), with a short pause between, into the one utterance."""
        segments = split_sentences(synth.text, SEGMENT_MAX_CHARS, complete=True)[0] or [synth.text]
        pause = np.zeros(round(SENTENCE_PAUSE_S * self.info.sample_rate), np.float32)
        for index, text in enumerate(segments):
            if index and not await self._put(job, chunks, pause):
                return
            async with contextlib.aclosing(
                self.worker.stream(dataclasses.replace(synth, text=text), job.should_stop)
            ) as pieces:
                async for chunk in pieces:
                    if job.should_stop() or not await self._put(job, chunks, chunk):
                        return
            if len(segments) > 1:
                log.debug("segment_synthesized", segment=index + 1, of=len(segments), chars=len(text))

    async def _put(self, job: Job, chunks: Channel[np.ndarray], chunk: np.ndarray) -> bool:
        """Hand ``chunk`` to playback; False once playback has ended early (stop, device error)."""
        self.dispatcher.record(job, ChunkMade(time.monotonic(), len(chunk) / self.info.sample_rate))
        try:
            await chunks.put(chunk)
        except ChannelClosed:
            return False
        return True

    def _with_library_voice(self, synth: SynthesisRequest, name: str) -> SynthesisRequest:
        """``synth`` speaking the library voice ``name`` (read afresh: it may have changed or gone)."""
        assert self.library is not None
        voice: LibraryVoice | None = self.library.lookup(name)
        if voice is None:
            raise UnknownVoiceError(f"voice {name!r} is no longer in the voice library")
        language = synth.language
        if language == "auto" and voice.language is not None:
            try:
                language = normalize_language(voice.language, self.info.languages)
            except EngineError:
                log.warning("voice_language_ignored", voice=name, language=voice.language)
        if self.library.kind is VoiceKind.CLONE:
            return dataclasses.replace(
                synth,
                voice=None,
                language=language,
                ref_audio=str(voice.ref_audio),
                ref_text=voice.ref_text,
            )
        # A designed voice: its description, then the request's own instruction.
        instruct = " ".join(part for part in (voice.instruct, synth.instruct) if part)
        return dataclasses.replace(synth, voice=None, language=language, instruct=instruct or None)
