"""``s2s-daemon say``: one utterance through the daemon's engine, stages and sink, no broker;
``say -`` speaks standard input as it is written (``llm ... | s2s-daemon say -``)."""

from __future__ import annotations

import argparse
import asyncio
import codecs
import functools
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from s2s_daemon.audio.sink import AudioDeviceError, AudioSink, DiscardSink, WavSink
from s2s_daemon.config import DaemonConfig
from s2s_daemon.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CantCreateError,
    ConfigError,
    DataError,
    UnavailableError,
    UsageError,
)
from s2s_daemon.events.publisher import latency_payload
from s2s_daemon.intake.admission import SayAsk, admit
from s2s_daemon.pipeline.jobs import Job
from s2s_daemon.pipeline.messages import ErrorCode, Status
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
    try:
        voice = command_line_voice(cli_voice, config.tts.named_voice, info.voices, library)
    except EngineError as exc:
        raise ConfigError(f"{'--voice' if cli_voice is not None else 'tts.voice'}: {exc}") from exc
    if cli_voice is None and config.tts.named_voice is None:
        log.info("voice_default", voice=voice, model_voices=len(info.voices), mode=info.mode)
    return voice


STDIN_IDLE_S = 24 * 3600.0
"""``say -`` ends at the end of its input, however long its writer thinks."""
STDIN_READ = 4096


def read_stdin(feed: TextFeed, stream: BinaryIO | None = None) -> threading.Thread:
    """Standard input into ``feed``, piece by piece as it comes (a pipe from an LLM's client),
    until its end. A daemon thread: a writer that never stops does not keep the process alive
    once the request has ended (stopped, too long)."""
    if stream is not None:
        read = getattr(stream, "read1", stream.read)
    else:
        # The file descriptor itself, not sys.stdin.buffer: a thread blocked in a buffered read
        # holds its lock, and the interpreter's exit (a Ctrl-C while the writer is still at it)
        # then aborts on it ("Fatal Python error: _enter_buffered_busy").
        fd = sys.stdin.fileno()

        def read(size: int) -> bytes:
            return os.read(fd, size)

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


def check_before_loading(args: argparse.Namespace) -> None:
    """What ``say`` can refuse before the model loads: an empty text (64), an ``--out`` that
    cannot be written (73: tried, so that the audio is not made for nothing)."""
    if args.text != "-" and not args.text.strip():
        raise UsageError("say: the text is empty: give the text to speak, or - to speak standard input")
    out: Path | None = args.out
    if out is None:
        return
    existed = out.exists()
    try:
        if not out.parent.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("ab"):
            pass
    except OSError as exc:
        raise CantCreateError(f"--out {out}: cannot write it ({exc.strerror or exc})") from exc
    if not existed:
        out.unlink(missing_ok=True)


HINTS = {
    ErrorCode.UNKNOWN_VOICE: "--voice NAME (a preset speaker or a library voice: s2s-daemon voices list)",
    ErrorCode.UNSUPPORTED_LANGUAGE: "--language NAME",
    ErrorCode.EMPTY_TEXT: "the text to speak, or - for standard input",
}
"""The flag that mends a refused request, by its error code (``say``'s message)."""


def refused(code: ErrorCode, message: str) -> UsageError | DataError:
    """A request ``say`` could not make, as one plain line and a sysexits code: 64 and the flag to
    use for what the command line can mend, 65 for the text itself (too long)."""
    hint = HINTS.get(code)
    if hint is None:
        return DataError(f"say: {message}")
    if code is ErrorCode.UNKNOWN_VOICE:
        hint += "; or clone one with --ref-audio FILE.wav"
    return UsageError(f"say: {message} (use {hint})")


async def say_once(config: DaemonConfig, args: argparse.Namespace) -> int:
    check_before_loading(args)
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
            feed = TextFeed(stages.rules.max_text_chars, STDIN_IDLE_S, stage=parsed.stream)
            parsed = replace(parsed, request=replace(parsed.request, feed=feed))
        if parsed.error is not None:
            raise refused(parsed.error.code, parsed.error.message)
        stages.ledger.submit(parsed.request)
        stages.requests.close()
        if feed is not None:
            read_stdin(feed)
        with CtrlC(stages.ledger) as interrupted:
            await stages.run()
        job = events.finished_job
        if interrupted:
            return _interrupted(job, args.out)
        if job is None:
            return EXIT_FAILURE
        log.info("latency", **latency_payload(job, info))
        if args.out is not None and job.status is Status.COMPLETED:
            print(f"wrote {args.out} ({job.timeline.audio_s:.2f} s of audio)")
        elif isinstance(sink, DiscardSink) and config.audio.sink != "discard":
            print(
                f"s2s-daemon: no sound device: {job.timeline.audio_s:.2f} s of audio made and discarded;"
                " write it to a file with --out FILE.wav",
                file=sys.stderr,
            )
        if job.status is not Status.COMPLETED and job.error is not None:
            if job.error.code in HINTS:
                raise refused(job.error.code, job.error.message)
            print(f"s2s-daemon: say: {job.error.message} ({job.error.code})", file=sys.stderr)
        return EXIT_OK if job.status is Status.COMPLETED else EXIT_FAILURE
    finally:
        await worker.close()


class CtrlC:
    """Ctrl-C while ``say`` speaks: stop the request (what was made is played or written), then
    exit 130; a second Ctrl-C exits at once. ``bool(self)``: whether it came."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.count = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def __enter__(self) -> CtrlC:
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)

    def _on_sigint(self) -> None:
        self.count += 1
        if self.count > 1:
            print("s2s-daemon: interrupted again: exiting now", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        self.ledger.stop_all()


def _interrupted(job: Job | None, out: Path | None) -> int:
    made_s = job.timeline.audio_s if job is not None else 0.0
    if out is not None and out.exists() and made_s > 0:
        print(f"s2s-daemon: interrupted: wrote {out} ({made_s:.2f} s of audio, what was made)", file=sys.stderr)
    elif out is not None:
        print(f"s2s-daemon: interrupted before any audio was made: {out} not written", file=sys.stderr)
    else:
        print(f"s2s-daemon: interrupted ({made_s:.2f} s of audio made; the rest dropped)", file=sys.stderr)
    return EXIT_INTERRUPTED
