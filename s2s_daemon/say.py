"""``s2s-daemon say``: one utterance through the daemon's engine, stages and sink, no broker;
``say -`` speaks standard input as it is written (``llm ... | s2s-daemon say -``)."""

from __future__ import annotations

import argparse
import asyncio
import codecs
import functools
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import structlog

from s2s_daemon.audio.sink import AudioDeviceError, AudioSink, WavSink
from s2s_daemon.config import DaemonConfig
from s2s_daemon.errors import EXIT_FAILURE, EXIT_OK, ConfigError, UnavailableError
from s2s_daemon.events.publisher import latency_payload
from s2s_daemon.intake.admission import SayAsk, admit
from s2s_daemon.pipeline.jobs import Job
from s2s_daemon.pipeline.messages import Status
from s2s_daemon.pipeline.textfeed import TextFeed
from s2s_daemon.pipeline.vocabulary import EngineError, EngineInfo
from s2s_daemon.pipeline.voice_policy import command_line_voice
from s2s_daemon.pipeline.voices import VoiceLibrary
from s2s_daemon.tts.engine import SynthesisRequest
from s2s_daemon.wiring import build_stages, load_engine, voice_library

log = structlog.get_logger(__name__)


class LogEvents:
    """``JobEvents`` for the command line: log lines instead of MQTT."""

    def __init__(self) -> None:
        self.finished_job: Job | None = None

    def started(self, job: Job) -> None:
        log.info("audio_started", request_id=job.request.id)

    def finished(self, job: Job) -> None:
        self.finished_job = job
        log.info(
            "request_finished",
            request_id=job.request.id,
            status=str(job.status),
            code=str(job.error.code) if job.error else None,
            error=job.error.message if job.error else None,
        )

    def state_changed(self) -> None:
        return None


def default_voice(config: DaemonConfig, cli_voice: str | None, info: EngineInfo, library: VoiceLibrary) -> str | None:
    """The voice to speak in (``voice_policy.command_line_voice``); ConfigError naming ``--voice`` or
    ``tts.voice`` when it is none this model can speak."""
    explicit = "voice" in config.tts.model_fields_set
    try:
        voice, replaced = command_line_voice(cli_voice, config.tts.voice, explicit, info.voices, library)
    except EngineError as exc:
        raise ConfigError(f"{'--voice' if cli_voice is not None else 'tts.voice'}: {exc}") from exc
    if replaced:
        log.info("voice_default", configured=config.tts.voice, model_voices=len(info.voices), voice=voice)
    return voice


STDIN_IDLE_S = 24 * 3600.0
"""``say -`` ends at the end of its input, however long its writer thinks."""
STDIN_READ = 4096


def read_stdin(feed: TextFeed, stream: BinaryIO | None = None) -> threading.Thread:
    """Standard input into ``feed``, piece by piece as it comes (a pipe from an LLM's client),
    until its end. A daemon thread: a writer that never stops does not keep the process alive
    once the request has ended (stopped, too long)."""
    source = stream if stream is not None else sys.stdin.buffer
    read = getattr(source, "read1", source.read)
    loop = asyncio.get_running_loop()

    def pump() -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        seq = 0
        while True:
            try:
                data: bytes = read(STDIN_READ)
            except (OSError, ValueError):
                data = b""
            text = decoder.decode(data, final=not data)
            try:
                loop.call_soon_threadsafe(functools.partial(feed.add, seq, text, last=not data))
            except RuntimeError:  # the loop is closed: the command has ended
                return
            seq += 1
            if not data:
                return

    thread = threading.Thread(target=pump, name="s2s.say.stdin", daemon=True)
    thread.start()
    return thread


async def say_once(config: DaemonConfig, args: argparse.Namespace) -> int:
    # The voice is checked against the model here, after loading, where --voice is known.
    unchecked = config.model_copy(update={"tts": config.tts.model_copy(update={"voice": None})})
    worker, info = await load_engine(unchecked)
    sink: AudioSink
    try:
        voice = default_voice(config, args.voice, info, voice_library(config, info))
        if args.out is not None:
            out: Path = args.out
            sink = WavSink(out.parent if str(out.parent) else Path("."), out.name)
        else:
            from s2s_daemon.audio.select import make_sink

            sink = make_sink(config.audio)
        try:
            await sink.open()
        except AudioDeviceError as exc:
            raise UnavailableError(f"audio: {exc}") from exc
        events = LogEvents()
        template = SynthesisRequest(
            text="",
            voice=None,
            language="auto",
            seed=args.seed,
            greedy=args.greedy,
            ref_audio=str(args.ref_audio) if args.ref_audio else None,
            ref_text=args.ref_text,
        )
        stages = build_stages(config, worker, info, sink, events, max_pending=1, default_voice=voice, template=template)
        feed: TextFeed | None = None
        streamed = args.text == "-"  # a text still being written: spoken sentence by sentence as it comes
        ask = SayAsk(
            "" if streamed else args.text,
            id="stdin" if streamed else None,
            voice=voice,
            language=args.language,
            instruct=args.instruct,
        )
        parsed = admit(ask, stages.rules, origin="cli", streamed=streamed)
        if streamed and parsed.error is None:
            feed = TextFeed(stages.rules.max_text_chars, STDIN_IDLE_S)
            parsed = replace(parsed, request=replace(parsed.request, feed=feed))
        if parsed.error is not None:
            log.error("request_rejected", code=str(parsed.error.code), reason=parsed.error.message)
            return EXIT_FAILURE
        stages.ledger.submit(parsed.request)
        stages.requests.close()
        if feed is not None:
            read_stdin(feed)
        await stages.run()
        job = events.finished_job
        if job is None:
            return EXIT_FAILURE
        log.info("latency", **latency_payload(job, info))
        if args.out is not None and job.status is Status.COMPLETED:
            print(f"wrote {args.out} ({job.timeline.audio_s:.2f} s of audio)")
        return EXIT_OK if job.status is Status.COMPLETED else EXIT_FAILURE
    finally:
        await worker.close()
