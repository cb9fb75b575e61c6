"""A Wyoming TTS server in the daemon's loop: Home Assistant's Assist pipelines speak through it.

One TCP listener; one ``WyomingConnection`` per client, each with three named tasks:

- ``reader``: events in, validated; a streamed text (``synthesize-chunk``) goes through its text
  stage (``text/``, one ``StreamingTextStage`` per stream, so Markdown split across chunks reads as
  a whole) and what the stage gives out is cut into sentences;
- ``submitter``: turns each text into a request (``origin="wyoming"``, ``output=CallerStream()``)
  and submits it, at most ``SPEECH_AHEAD`` of this client's at a time, in order;
- ``writer``: the only one that writes to the socket: replies and audio in order, one
  ``audio-start`` / ``audio-chunk``... / ``audio-stop`` group per request, never two interleaved.

The requests share the engine and the request queue with MQTT's; their audio goes back to the
client as it is made (the TTS stage writes it into a ``CallerStream``, beside the speaker). A client
that goes away (end of its connection, a failed write) abandons its streams and cancels its
requests, so the engine is free at its next chunk. A request that fails ends the exchange with an
``error`` event and the connection, as wyoming-piper does (Home Assistant waits for audio until
then). Wyoming's own ``AsyncServer.run`` is not used: it takes over SIGTERM from the daemon, and
its handler tasks have no owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import ipaddress
import json
import socket
import time
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from wyoming.error import Error
from wyoming.event import Event, async_write_event, write_event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

with warnings.catch_warnings():
    # wyoming.audio imports the stdlib's audioop, deprecated since Python 3.11 (it falls back to
    # its own copy where audioop is gone); the warning is about wyoming, not about us.
    warnings.simplefilter("ignore", DeprecationWarning)
    from wyoming.audio import AudioChunk, AudioStart, AudioStop

from s2s_daemon import __version__
from s2s_daemon.config import WyomingConfig
from s2s_daemon.errors import UnavailableError
from s2s_daemon.intake.admission import IntakeRules, Parsed, SayAsk, admit
from s2s_daemon.intake.schemas import MAX_NAME_CHARS
from s2s_daemon.pipeline.channel import Channel, ChannelClosed, Overflow
from s2s_daemon.pipeline.jobs import Job, Ledger
from s2s_daemon.pipeline.messages import ErrorCode, Status
from s2s_daemon.pipeline.output import CallerStream, pcm16
from s2s_daemon.pipeline.segment import split_sentences
from s2s_daemon.pipeline.vocabulary import (
    LANGUAGE_ALIASES,
    EngineError,
    EngineInfo,
    UnsupportedLanguageError,
    model_name,
    normalize_language,
)
from s2s_daemon.text import StreamingTextStage

log = structlog.get_logger(__name__)

SERVICE_TYPE = "_wyoming._tcp.local."
SAMPLE_WIDTH = 2
"""Bytes per sample of the PCM we send (signed 16-bit little-endian, mono)."""
SPEECH_AHEAD = 2
"""A client's requests submitted and not yet written: the one streaming and the next, synthesizing."""
PENDING_ITEMS = 256
"""Texts and replies a client may have waiting before its reader waits (back-pressure on the socket)."""
MAX_EVENT_BYTES = 262_144
"""The longest event (``wyoming.max_event_bytes``'s default): header line, data and payload together."""
REFUSED_LOG_S = 1.0
"""Connections refused at the cap are logged at most this often (with how many since)."""
NO_PRESET_VOICE = "default"
"""The one voice advertised for a model without preset speakers (VoiceDesign, Base)."""
WRITE_TIMEOUT_S = 10.0
"""A client that takes longer than this to accept one event is treated as gone."""
CLOSE_TIMEOUT_S = 5.0
"""At shutdown, the longest ``close`` waits for the connections and the advertisement to end."""
CLOSE_GRACE_S = 2.0
"""At shutdown, how long connections may take to write what they hold before they are cut."""
ZEROCONF_TIMEOUT_S = 5.0
"""Longest wait for registering the advertisement (probing takes about 2 s), and for withdrawing it."""
_CODES: dict[str, str] = {}
for _alias, _name in LANGUAGE_ALIASES.items():
    if len(_alias) == 2:
        _CODES.setdefault(_name, _alias)


class FrameError(Exception):
    """Bytes on the connection that are not a Wyoming event; the connection ends."""


class Refused(Exception):
    """A request this server answers with an ``error`` event."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- text ------------------------------------------------------------------------------------


def language_codes(languages: Iterable[str]) -> list[str]:
    """The model's language names as the codes Home Assistant matches (``english`` -> ``en``)."""
    codes: list[str] = []
    for name in languages:
        code = _CODES.get(name.lower())
        if code is not None and code not in codes:
            codes.append(code)
    return codes or sorted(set(_CODES.values()))


def describe(info: EngineInfo, site_id: str, library: tuple[str, ...] = ()) -> Info:
    """The ``info`` answer: one TTS program whose voices are the model's preset speakers and the
    ``library`` voices it can speak."""
    attribution = Attribution(name="Qwen (Alibaba Cloud)", url="https://github.com/QwenLM/Qwen3-TTS")
    codes = language_codes(info.languages)
    voices = [
        TtsVoice(
            name=voice,
            description=voice,
            attribution=attribution,
            installed=True,
            version=None,
            languages=codes,
        )
        for voice in (*info.voices, *library) or (NO_PRESET_VOICE,)
    ]
    program = TtsProgram(
        name=f"s2s {site_id}",
        # a local checkpoint by its folder's name: its path says whose home it is in, to anyone on the network
        description=f"Qwen3-TTS {model_name(info.model)} on {info.device} (s2s-daemon, site {site_id})",
        attribution=attribution,
        installed=True,
        version=__version__,
        voices=voices,
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program])


# -- one client ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Text:
    """Text to speak as one audio group (a ``synthesize``, or one sentence of a stream)."""

    text: str
    voice: str | None
    """Canonical speaker, or None for the configured default."""
    language: str | None
    """Canonical language name, or None for the configured default."""
    session_id: str
    """Shared by every sentence of one stream."""
    received_at: float
    """Monotonic seconds when the text was complete."""
    prepared: bool = False
    """A sentence of a stream: its text stage's already (not prepared again at admission)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """An event to write in turn; ``hang_up``: the exchange ends after it."""

    event: Event
    hang_up: bool = False


@dataclass(frozen=True, slots=True)
class Speech:
    """A submitted request and the stream its audio comes back on."""

    job: Job
    stream: CallerStream


async def read_event(
    reader: asyncio.StreamReader,
    *,
    max_bytes: int = MAX_EVENT_BYTES,
    timeout_s: float | None = None,
    first: bytes = b"",
) -> Event | None:
    """The next event (``first``: its first byte, read already); None when the connection ended.
    ``FrameError`` for bytes that are not one, an event longer than ``max_bytes`` (refused before its
    body is read) or one not whole within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_event(reader, max_bytes, first)
    except TimeoutError as exc:
        raise FrameError(f"event not complete within {timeout_s:g} s (wyoming.event_timeout_s)") from exc


async def _read_event(reader: asyncio.StreamReader, max_bytes: int, first: bytes) -> Event | None:
    try:
        line = first if first == b"\n" else first + await reader.readline()
    except ValueError as exc:  # the stream's limit: a header line longer than max_bytes
        raise FrameError(f"event header longer than {max_bytes} bytes (wyoming.max_event_bytes)") from exc
    if not line:
        return None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise FrameError(f"event header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise FrameError("event header must be a JSON object with a string 'type'")
    data = header.get("data") or {}
    lengths = [header.get("data_length") or 0, header.get("payload_length") or 0]
    if not isinstance(data, dict) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in lengths):
        raise FrameError("event data must be an object, and its lengths whole numbers of bytes")
    if (size := len(line) + sum(lengths)) > max_bytes:
        raise FrameError(f"event of {size} bytes is longer than {max_bytes} (wyoming.max_event_bytes)")
    payload: bytes | None = None
    try:
        if lengths[0]:
            try:
                extra = json.loads(await reader.readexactly(lengths[0]))
            except (ValueError, RecursionError) as exc:
                raise FrameError(f"event data is not JSON: {exc}") from exc
            if not isinstance(extra, dict):
                raise FrameError("event data must be a JSON object")
            data = {**data, **extra}
        if lengths[1]:
            payload = await reader.readexactly(lengths[1])
    except asyncio.IncompleteReadError:
        return None  # the connection ended inside an event
    return Event(type=header["type"], data=data, payload=payload)


def event_bytes(event: Event) -> bytes:
    """``event`` as written on the wire (for a write that must not wait)."""
    out = io.BytesIO()
    write_event(event, out)
    return out.getvalue()


class _Idle(Exception):
    """No event came for ``wyoming.idle_timeout_s`` and nothing was in flight."""


class WyomingConnection:
    """One client. The constructor does no I/O."""

    def __init__(
        self,
        server: WyomingServer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self._pending: Channel[Text | Reply] = Channel(PENDING_ITEMS, Overflow.BLOCK, "wyoming.pending")
        self._writing: Channel[Speech | Reply] = Channel(SPEECH_AHEAD, Overflow.BLOCK, "wyoming.writing")
        self._slots = asyncio.Semaphore(SPEECH_AHEAD)
        self._speeches: list[Speech] = []
        """Submitted and not yet written (abandoned if the client goes away)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._ended = False
        # streaming input (synthesize-start ... synthesize-stop)
        self._streamed = False
        """A stream began on this connection: a plain ``synthesize`` is then the copy Home Assistant
        sends for older servers, and is ignored (as wyoming-piper does)."""
        self._streaming = False
        self._buffer = ""
        """What the stream's text stage gave out and is not cut into sentences yet."""
        self._stage: StreamingTextStage | None = None
        """The stream's text stage (its language's)."""
        self._stream_chars = 0
        """Characters of the stream's chunks so far (at most ``tts.max_text_chars``)."""
        self._asked: list[str] = []
        self._spoken: list[str] = []
        """The stream's text as asked and as its stage gave it out (``text_prepared``)."""
        self._sentences = 0
        """Sentences of the stream submitted so far."""
        self._stream_voice: tuple[str | None, str | None] = (None, None)
        self._session = ""

    async def serve(self) -> None:
        log.debug("wyoming_connected", peer=self.peer)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tasks = [
                    tg.create_task(self._read_loop(), name="s2s.wyoming.reader"),
                    tg.create_task(self._submit_loop(), name="s2s.wyoming.submitter"),
                    tg.create_task(self._write_loop(), name="s2s.wyoming.writer"),
                ]
        finally:
            self.end(gone=True)
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.writer.wait_closed()
            log.debug("wyoming_disconnected", peer=self.peer)

    def finish(self) -> None:
        """Shutdown: read nothing more; write what is submitted, then hang up."""
        self._pending.close()

    def end(self, gone: bool) -> None:
        """Stop this exchange: abandon the client's streams (the engine stops at its next chunk),
        cancel its requests, close the socket. ``gone``: the client left, so drop unsent bytes."""
        if self._ended:
            return
        self._ended = True
        for speech in self._speeches:
            speech.stream.abandon()
            self.server.ledger.cancel(speech.job, Status.INTERRUPTED)
        self._speeches.clear()
        for channel in (self._pending, self._writing):
            channel.clear()
            channel.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if gone:
            self.writer.transport.abort()
        else:
            self.writer.close()
        self.reader.feed_eof()

    # -- reading ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while not self._ended:
                try:
                    event = await self._next_event()
                except _Idle:
                    log.info("wyoming_idle_closed", peer=self.peer, idle_s=self.server.config.idle_timeout_s)
                    self.end(gone=False)
                    return
                except FrameError as exc:
                    log.info("wyoming_bad_frame", peer=self.peer, reason=str(exc))
                    await self._pending.put(Reply(Error(str(exc), str(ErrorCode.BAD_PAYLOAD)).event(), hang_up=True))
                    return
                if event is None:
                    break
                try:
                    await self._handle(event)
                except Refused as exc:
                    log.info("wyoming_refused", peer=self.peer, type=event.type, code=str(exc.code), reason=str(exc))
                    await self._pending.put(Reply(Error(str(exc), str(exc.code)).event(), hang_up=True))
                    return
        except ChannelClosed:  # shutting down, or the exchange ended
            return
        self.end(gone=True)  # the client closed its side: it is gone

    async def _next_event(self) -> Event | None:
        """The next event: its first byte within ``idle_timeout_s`` unless a request of this client
        is in flight (``_Idle`` otherwise), the rest within ``event_timeout_s``."""
        cfg = self.server.config
        while True:
            try:
                async with asyncio.timeout(cfg.idle_timeout_s):
                    first = await self.reader.read(1)
                break
            except TimeoutError:
                if not self._busy():
                    raise _Idle from None
        if not first:
            return None
        return await read_event(self.reader, max_bytes=cfg.max_event_bytes, timeout_s=cfg.event_timeout_s, first=first)

    def _busy(self) -> bool:
        """A request of this client is waiting, being synthesized or being written, or a reply is."""
        return bool(self._speeches) or len(self._pending) > 0 or len(self._writing) > 0

    async def _handle(self, event: Event) -> None:
        kind = event.type
        now = time.monotonic()
        if Describe.is_type(kind):
            await self._pending.put(Reply(self.server.info_now()))
        elif Ping.is_type(kind):
            echo = event.data.get("text")
            await self._pending.put(Reply(Pong(text=echo if isinstance(echo, str) else None).event()))
        elif Synthesize.is_type(kind):
            if self._streamed:
                log.debug("wyoming_synthesize_ignored", peer=self.peer, reason="streamed")
                return
            text = self._text_field(event).strip()  # as admission.asked_text reads it
            voice, language = self._voice(event.data.get("voice"))
            if len(text) > self.server.rules.max_text_chars:
                self._reject_now(Text(text, voice, language, uuid.uuid4().hex, now))
            await self._pending.put(Text(text, voice, language, uuid.uuid4().hex, now))
        elif SynthesizeStart.is_type(kind):
            if self._streaming:
                await self._flush(now)
            self._stream_voice = self._voice(event.data.get("voice"))
            self._streamed = self._streaming = True
            self._buffer = ""
            rules = self.server.rules
            self._stage = rules.text.stream(self._stream_voice[1] or rules.default_language)
            self._stream_chars = 0
            self._asked, self._spoken, self._sentences = [], [], 0
            self._session = uuid.uuid4().hex
        elif SynthesizeChunk.is_type(kind):
            if not self._streaming:
                raise Refused(ErrorCode.BAD_PAYLOAD, "synthesize-chunk outside synthesize-start ... synthesize-stop")
            chunk = self._text_field(event)
            self._stream_chars += len(chunk)
            if self._stream_chars > (limit := self.server.rules.max_text_chars):
                why = f"the streamed text grew past {limit} characters (tts.max_text_chars)"
                raise Refused(ErrorCode.TEXT_TOO_LONG, why)
            await self._speak(chunk, now)
        elif SynthesizeStop.is_type(kind):
            if self._streaming:
                await self._flush(now)
            self._streaming = False
            await self._pending.put(Reply(SynthesizeStopped().event()))
        else:
            log.debug("wyoming_event_ignored", peer=self.peer, type=kind)

    async def _speak(self, chunk: str, now: float, *, last: bool = False) -> None:
        """A chunk of the stream through its text stage (``last``: the stream ended, the stage gives
        out what it held), and each sentence complete in what it gave out submitted in turn. The
        stage holds back at most the sentence being written; what it gave out ends where a
        sentence may end (``at_boundary``), so nothing more waits here."""
        assert self._stage is not None
        self._asked.append(chunk)
        spoken = self._stage.feed(chunk) + (self._stage.close() if last else "")
        self._spoken.append(spoken)
        self._buffer += spoken
        sentences, self._buffer = split_sentences(
            self._buffer, self.server.rules.max_text_chars, complete=last, at_boundary=True
        )
        for sentence in sentences:
            self._sentences += 1
            await self._pending.put(Text(sentence, *self._stream_voice, self._session, now, prepared=True))

    async def _flush(self, now: float) -> None:
        """The stream ended: what is left is the last sentence (or sentences). A stream that asked
        for something and has nothing to speak once prepared (only emoji, markup or code) is
        refused ``empty_text``, as a ``synthesize`` of it is."""
        await self._speak("", now, last=True)
        asked, spoken = "".join(self._asked), "".join(self._spoken)
        changed = spoken.split() != asked.split()
        log.debug(
            "text_prepared", session_id=self._session, asked_chars=len(asked), spoken_chars=len(spoken), changed=changed
        )
        if asked.strip() and not self._sentences:
            why = "the streamed text has nothing to speak once prepared: only emoji, markup or code (docs/text.md)"
            raise Refused(ErrorCode.EMPTY_TEXT, why)

    def _reject_now(self, text: Text) -> None:
        """Reject a text too long to wait in turn (it would be held until then): through the ledger
        as ``_submit`` would, then ``Refused`` (the error event after what came before)."""
        parsed = self._parse(text)
        if parsed.error is None:
            return
        self.server.ledger.reject(parsed.request, parsed.error.code, parsed.error.message)
        raise Refused(parsed.error.code, parsed.error.message)

    @staticmethod
    def _text_field(event: Event) -> str:
        text = event.data.get("text")
        if not isinstance(text, str):
            raise Refused(ErrorCode.BAD_PAYLOAD, f"{event.type}: 'text' must be a string")
        return text

    def _voice(self, voice: Any) -> tuple[str | None, str | None]:
        """``voice: {name, language}`` as the canonical speaker and language (None: the defaults)."""
        if voice is None:
            return None, None
        if not isinstance(voice, dict):
            raise Refused(ErrorCode.BAD_PAYLOAD, "'voice' must be an object")
        name, language = voice.get("name"), voice.get("language")
        if not isinstance(name, str | None) or not isinstance(language, str | None):
            raise Refused(ErrorCode.BAD_PAYLOAD, "'voice.name' and 'voice.language' must be strings")
        if any(value is not None and len(value) > MAX_NAME_CHARS for value in (name, language)):
            raise Refused(
                ErrorCode.BAD_PAYLOAD, f"'voice.name' and 'voice.language' have at most {MAX_NAME_CHARS} characters"
            )
        rules = self.server.rules
        try:
            if not rules.voices.presets and name is not None and name.strip().lower() == NO_PRESET_VOICE:
                name = None
            canonical = rules.voices.resolve(name) if name is not None else None
            return canonical, self._language(language) if language is not None else None
        except EngineError as exc:
            raise Refused(ErrorCode.parse(exc.code, ErrorCode.BAD_PAYLOAD), str(exc)) from exc

    def _language(self, value: str) -> str:
        """``en``, ``en_AU``, ``English``...; a region the model does not name falls back to its language."""
        languages = self.server.rules.languages
        try:
            return normalize_language(value, languages)
        except UnsupportedLanguageError:
            primary = value.replace("_", "-").split("-")[0]
            if primary == value:
                raise
            return normalize_language(primary, languages)

    # -- submitting -------------------------------------------------------------------------

    async def _submit_loop(self) -> None:
        try:
            async for item in self._pending:
                if isinstance(item, Reply):
                    await self._writing.put(item)
                    continue
                await self._slots.acquire()
                speech = self._submit(item)
                self._speeches.append(speech)
                await self._writing.put(speech)
        except ChannelClosed:
            return
        finally:
            self._writing.close()

    def _parse(self, text: Text) -> Parsed:
        ask = SayAsk(
            text.text, voice=text.voice, language=text.language, session_id=text.session_id, prepared=text.prepared
        )
        return admit(ask, self.server.rules, origin="wyoming", received_at=text.received_at)

    def _submit(self, text: Text) -> Speech:
        server = self.server
        parsed = self._parse(text)
        stream = CallerStream()
        request = dataclasses.replace(parsed.request, output=stream)
        if parsed.error is not None:
            job = server.ledger.reject(request, parsed.error.code, parsed.error.message)
        else:
            job = server.ledger.submit(request)
        return Speech(job, stream)

    # -- writing ----------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        try:
            async for item in self._writing:
                if isinstance(item, Reply):
                    await self._send(item.event)
                    if item.hang_up:
                        break
                    continue
                ok = await self._write_speech(item)
                # Written: no longer the client's to abandon. (On a failed write it still is.)
                self._speeches.remove(item)
                self._slots.release()
                if not ok:
                    break
        except (OSError, TimeoutError) as exc:  # the client is gone (reset, broken pipe) or stopped reading
            log.info("wyoming_client_gone", peer=self.peer, error=str(exc) or type(exc).__name__)
            self.end(gone=True)
            return
        self.end(gone=False)

    async def _send(self, event: Event) -> None:
        """Write one event; a client that takes more than ``WRITE_TIMEOUT_S`` to take it is gone
        (it would otherwise hold the engine through the back-pressure of its stream)."""
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await async_write_event(event, self.writer)

    async def _write_speech(self, speech: Speech) -> bool:
        """One request's audio group; False (after an ``error`` event) when the request failed."""
        fmt = (self.server.sample_rate, SAMPLE_WIDTH, 1)
        job = speech.job
        started = False
        async for chunk in speech.stream.chunks(job.done):
            if not started:
                await self._send(AudioStart(*fmt).event())
                started = True
            await self._send(AudioChunk(*fmt, audio=pcm16(chunk)).event())
        await job.done.wait()  # the stream ended: the playback stage ends the job right after
        if job.status is Status.COMPLETED:
            if not started:
                await self._send(AudioStart(*fmt).event())
            await self._send(AudioStop().event())
            return True
        if started:
            await self._send(AudioStop().event())
        code = str(job.error.code) if job.error is not None else str(job.status)
        message = job.error.message if job.error is not None else f"the request ended {job.status}"
        log.info("wyoming_request_failed", peer=self.peer, request_id=job.request.id, code=code)
        await self._send(Error(message, code).event())
        return False


# -- the server ------------------------------------------------------------------------------


class WyomingServer:
    """The listener, its connections and its zeroconf advertisement: an ``Intake`` (``door.py``).
    The constructor does no I/O."""

    name = "wyoming"
    origins = frozenset({"wyoming"})

    def __init__(
        self, config: WyomingConfig, ledger: Ledger, rules: IntakeRules, info: EngineInfo, site_id: str
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.rules = rules
        self.sample_rate = info.sample_rate
        self.site_id = site_id
        self.engine_info = info
        self.info_event = describe(info, site_id).event()
        self.port = config.port
        """The port listened on (known once started)."""
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], WyomingConnection] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()
        self._stopped = asyncio.Event()
        """``run`` has returned."""
        self._zeroconf: Any = None
        self._refused = 0
        """Connections refused at ``max_connections`` since the last log line about them."""
        self._refused_logged_at = -REFUSED_LOG_S

    def info_now(self) -> Event:
        """The ``info`` answer with the voice library as it is now (scanned on each ``describe``)."""
        named = tuple(self.rules.voices.library_voices())
        return describe(self.engine_info, self.site_id, named).event() if named else self.info_event

    async def start(self) -> None:
        """Listen; a port that is taken (or an address this host lacks) is exit 69."""
        try:
            self._server = await asyncio.start_server(
                self._accept,
                self.config.host,
                self.config.port,
                limit=self.config.max_event_bytes,  # a header line longer is refused; the buffer is at most twice it
                start_serving=False,
            )
        except OSError as exc:
            raise UnavailableError(f"wyoming: cannot listen on {self.config.host}:{self.config.port}: {exc}") from exc
        self.port = self._server.sockets[0].getsockname()[1]

    async def run(self) -> None:
        """Serve until ``close()``; then let the connections write what they hold, and hang up."""
        server = self._server
        if server is None:
            raise RuntimeError("WyomingServer.run() before start()")
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                await server.start_serving()
                log.info("wyoming_listening", host=self.config.host, port=self.port)
                advertise = (
                    tg.create_task(self._advertise(), name="s2s.wyoming.zeroconf") if self.config.zeroconf else None
                )
                await self._closing.wait()
                if advertise is not None:
                    advertise.cancel()  # still probing: withdrawn below
                self.stop_accepting()
                for connection in self._connections.values():
                    connection.finish()
                if self._connections:
                    _, late = await asyncio.wait(set(self._connections), timeout=CLOSE_GRACE_S)
                    for task in late:
                        self._connections[task].end(gone=True)
        finally:
            self._tg = None
            self.stop_accepting()
            await self._unadvertise()
            self._stopped.set()

    def drain(self) -> None:
        """The daemon drains: no new connections (those open get ``shutting_down`` for new requests)."""
        self.stop_accepting()

    def stop_accepting(self) -> None:
        """Drain begins: no new connections (those open get ``shutting_down`` for new requests)."""
        if self._server is not None and self._server.sockets:
            self._server.close()
            log.info("wyoming_stopped_accepting")

    async def close(self) -> None:
        """Every synthesis has ended: let ``run()`` finish the connections, and wait until it returned
        (at most ``CLOSE_TIMEOUT_S``: the daemon then cancels it)."""
        self._closing.set()
        if self._server is not None:  # started: its run ends
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self._stopped.wait()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer_s = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._tg is None or self._closing.is_set():
            writer.transport.abort()
            return
        if len(self._connections) >= self.config.max_connections:
            self._refuse(writer, peer_s)
            return
        connection = WyomingConnection(self, reader, writer, peer_s)
        task = self._tg.create_task(connection.serve(), name="s2s.wyoming.connection")
        self._connections[task] = connection
        task.add_done_callback(self._connections.pop)

    def _refuse(self, writer: asyncio.StreamWriter, peer: str) -> None:
        """One connection past ``max_connections``: an ``error`` event (without waiting for the
        client to read it), then closed; its descriptor is free at once."""
        limit = self.config.max_connections
        why = f"too many connections: this server takes {limit} at once (wyoming.max_connections)"
        writer.transport.write(event_bytes(Error(why, "too_many_connections").event()))
        writer.transport.close()
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= REFUSED_LOG_S:
            log.warning("wyoming_connection_refused", peer=peer, refused=self._refused, max_connections=limit)
            self._refused, self._refused_logged_at = 0, now

    # -- zeroconf ---------------------------------------------------------------------------

    def _advertised_address(self) -> str | None:
        """The address Home Assistant should connect to; None on loopback (nobody else can)."""
        host = self.config.host
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        if (address is not None and address.is_loopback) or host == "localhost":
            return None
        if address is not None and not address.is_unspecified:
            return host
        # Every interface: the one the default route uses (no packet is sent).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("224.0.0.251", 5353))
            return str(probe.getsockname()[0])

    async def _advertise(self) -> None:
        """Register ``s2s-<site>._wyoming._tcp.local.``; a failure is a warning, never fatal."""
        try:
            from zeroconf import Error as ZeroconfError
            from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf
        except ImportError as exc:
            log.warning("wyoming_zeroconf_unavailable", error=str(exc), fix="pip install 's2s-daemon[wyoming]'")
            return
        try:
            address = self._advertised_address()
        except OSError as exc:
            log.warning("wyoming_zeroconf_failed", error=str(exc), reason="no address to advertise")
            return
        if address is None:  # the documented loopback case: nothing is wrong, nothing to advertise
            log.info("wyoming_zeroconf_skipped", host=self.config.host, reason="loopback: only this host can connect")
            return
        name = f"s2s-{self.site_id}"
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            parsed_addresses=[address],
            port=self.port,
            properties={"version": __version__},
        )
        try:
            self._zeroconf = AsyncZeroconf()
            async with asyncio.timeout(ZEROCONF_TIMEOUT_S):
                await (await self._zeroconf.async_register_service(info, allow_name_change=True))
        except (OSError, ZeroconfError, TimeoutError) as exc:
            log.warning("wyoming_zeroconf_failed", error=str(exc) or type(exc).__name__)
            await self._unadvertise()
            return
        log.info("wyoming_zeroconf_advertised", name=info.name, address=address, port=self.port)

    async def _unadvertise(self) -> None:
        zeroconf, self._zeroconf = self._zeroconf, None
        if zeroconf is None:
            return
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(ZEROCONF_TIMEOUT_S):
                await zeroconf.async_unregister_all_services()
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(ZEROCONF_TIMEOUT_S):
                await zeroconf.async_close()
