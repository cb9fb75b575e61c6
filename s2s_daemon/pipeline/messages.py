"""Typed messages that travel between stages. Times are ``time.monotonic()`` seconds."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from s2s_daemon.pipeline.channel import Channel
from s2s_daemon.pipeline.output import CallerStream
from s2s_daemon.pipeline.textfeed import TextFeed
from s2s_daemon.pipeline.vocabulary import Samples


class Status(enum.StrEnum):
    """``status`` of ``tts/finished``."""

    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REJECTED = "rejected"
    ERROR = "error"


class ErrorCode(enum.StrEnum):
    """``error.code`` of a rejected or failed request."""

    BAD_PAYLOAD = "bad_payload"
    EMPTY_TEXT = "empty_text"
    TEXT_TOO_LONG = "text_too_long"
    UNKNOWN_VOICE = "unknown_voice"
    UNSUPPORTED_LANGUAGE = "unsupported_language"
    QUEUE_FULL = "queue_full"
    DUPLICATE = "duplicate"
    SHUTTING_DOWN = "shutting_down"
    ENGINE_ERROR = "engine_error"
    AUDIO_ERROR = "audio_error"
    JOURNAL_ERROR = "journal_error"
    """The request could not be stored durably (disk full, I/O error)."""
    STREAM_IDLE = "stream_idle"
    """A streamed text's writer went quiet without closing it (what came was spoken)."""
    RESTARTED = "restarted"
    """The daemon restarted while the request's text was still being streamed."""

    @classmethod
    def parse(cls, code: str, default: ErrorCode | None = None) -> ErrorCode:
        """The member for ``code``; ``default`` (engine_error) for codes outside the contract."""
        try:
            return cls(code)
        except ValueError:
            return default or cls.ENGINE_ERROR


@dataclass(frozen=True, slots=True)
class ReplyTo:
    """MQTT v5 response routing carried by a request."""

    topic: str
    correlation_data: bytes | None


@dataclass(frozen=True, slots=True)
class SayRequest:
    """A validated say request."""

    id: str
    text: str
    """What was asked (the journal keeps it); what is spoken is ``spoken`` when set."""
    voice: str | None
    """Canonical preset speaker, or None for the engine's default."""
    language: str
    """Canonical language name."""
    site_id: str
    instruct: str | None = None
    session_id: str | None = None
    priority: int = 0
    """Higher is served first."""
    interrupt: bool = False
    """Stop the current utterance and be served next."""
    ttl_ms: int | None = None
    """Milliseconds after receipt after which it expires unspoken."""
    volume: float = 1.0
    """Linear gain, 0..2."""
    received_at: float = field(default_factory=time.monotonic)
    """Monotonic seconds at receipt."""
    origin: str = "mqtt"
    """``mqtt``, ``pool``, ``hermes``, ``cli`` or the intake that made it."""
    reply_to: ReplyTo | None = None
    output: CallerStream | None = None
    """Where the audio goes: None is the daemon's own sink (the speaker, through the playback
    stage); otherwise the caller's stream that the intake made, which the TTS stage writes into
    itself. The speaker's requests are synthesized one at a time, a caller's beside them."""
    feed: TextFeed | None = None
    """The text still being written (a streamed say, ``say -``): ``text`` is then empty and the
    TTS stage reads sentences from the feed as they come (through its text stage)."""
    spoken: str | None = None
    """What the text stage (``text/``) made of ``text``: what the TTS stage speaks; None: ``text``
    as it is (unchanged, or already the stage's: a sentence of a Wyoming stream)."""
    text_changed: bool | None = False
    """The text stage changed more than white space (``tts/started``'s ``textChanged``); None
    where it is not known for the request alone: a streamed text, a sentence of a Wyoming stream."""

    @property
    def to_speak(self) -> str:
        """The whole text the TTS stage speaks (a streamed text's comes through its feed)."""
        return self.text if self.spoken is None else self.spoken

    @property
    def chars(self) -> int:
        """Characters to speak: the prepared text's, or what a streamed text has given so far."""
        return self.feed.spoken_chars if self.feed is not None else len(self.to_speak)


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why a request was rejected or failed."""

    code: ErrorCode
    message: str
    field: str | None = None
    """The request's field at fault, when one is (``instruct``); the speech API names it as ``param``."""


@dataclass(frozen=True, slots=True)
class Utterance:
    """A speaker's request's audio on its way to the sink; the chunk channel closes at its end."""

    request: SayRequest
    sample_rate: int
    """Hertz of the chunks."""
    chunks: Channel[Samples]


OnFirstSample = Callable[[float], None]
"""A sink's callback (``AudioSink.play``): called once with the monotonic time the first sample was
handed to the device (the ledger's event of that moment is ``jobs.FirstSample``)."""


@dataclass(frozen=True, slots=True)
class PlaybackReport:
    """What a sink observed while playing one utterance."""

    first_sample_at: float | None
    """Monotonic seconds when the first sample was handed to the device."""
    last_sample_at: float | None
    """Monotonic seconds when the last sample finished playing."""
    audio_ms: float
    """Milliseconds of audio played."""
    underruns: int = 0
    """Times the buffer ran dry mid-utterance (a run of starved device periods is one)."""
    underrun_ms: float = 0.0
    """Milliseconds of silence played while it was dry (all the underruns together)."""
