"""One way in: what a caller asks (``SayAsk``), checked against the rules every door shares
(``IntakeRules``), becomes the request the ledger takes (``admit``), or the rejection that answers it.

Each door reads its own wire format into a ``SayAsk`` (MQTT's and the web page's JSON:
``schemas.py``; the speech API's fields: ``http/api.py``; Wyoming's events; ``say``'s arguments)
and hands it to ``admit``; no door encodes a request to decode it again. ``admit`` checks the text
(``asked_text``), the instruction, the language and the voice (``pipeline/voice_policy.py``) in
that order, so every door answers the same request with the same code and message, then prepares
the text (``prepare``: the text stage, ``text/``, the one place a request's whole text is made
into what is spoken); a streamed text gets its own stage (``Parsed.stream``) for the feed its door
attaches.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

import structlog

from s2s_daemon.config import TextConfig
from s2s_daemon.pipeline.messages import ErrorCode, ReplyTo, RequestError, SayRequest
from s2s_daemon.pipeline.vocabulary import EngineError, normalize_language
from s2s_daemon.pipeline.voice_policy import VoicePolicy
from s2s_daemon.text import SpokenText, StreamingTextStage, TextOverrides, TextStage

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class IntakeRules:
    """What a say request is checked against."""

    site_id: str
    max_text_chars: int
    voices: VoicePolicy
    """What a voice name means for this model and its library, and the default voice."""
    languages: tuple[str, ...]
    default_language: str
    stream_idle_s: float = 20.0
    """A streamed text with no piece for this long (and no end) ends (``tts.stream_idle_s``)."""
    max_instruct_chars: int = 1000
    """The longest ``instruct`` a request may have (``tts.max_instruct_chars``)."""
    text: TextStage = field(default_factory=lambda: TextStage(TextConfig()))
    """The text stage, built once from the ``text:`` section (its defaults when none is given)."""


@dataclass(frozen=True, slots=True)
class SayAsk:
    """A say request as its door read it: typed, not yet checked against the rules."""

    text: str
    """What to speak, as asked (empty for a streamed text: it comes through its feed)."""
    id: str | None = None
    """The caller's id; None: one is made."""
    voice: str | None = None
    language: str | None = None
    """Any spelling ``normalize_language`` reads (``en``, ``English``); None or empty: the default."""
    instruct: str | None = None
    session_id: str | None = None
    priority: int = 0
    interrupt: bool = False
    ttl_ms: int | None = None
    """Milliseconds after receipt after which it expires unspoken."""
    volume: float = 1.0
    """Linear gain, 0..2."""
    text_options: TextOverrides | None = None
    """The request's own choices for the text stage (an MQTT payload's ``textOptions``)."""
    prepared: bool = False
    """``text`` is the text stage's already (a sentence its door cut from a stream's stage):
    checked, not prepared again."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """A say request, and the error that rejects it (None when it is good)."""

    request: SayRequest
    error: RequestError | None
    stream: StreamingTextStage | None = None
    """A streamed request's text stage (its language, its options), for the feed its door attaches."""


class AskRefused(Exception):
    """Why an ask becomes a rejection; the id and session when they could be read."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        rid: str | None = None,
        session: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.rid = rid
        self.session = session
        self.field = field


def new_request_id() -> str:
    return uuid.uuid4().hex


def asked_text(text: str, rules: IntakeRules, rid: str | None = None, session: str | None = None) -> str:
    """The text a request asks for, stripped and checked (no NULs, not empty, at most
    ``max_text_chars``); ``AskRefused`` otherwise. Every door's whole text passes here, then
    ``prepare``, before ``Ledger.submit``."""
    if "\x00" in text:
        raise AskRefused(ErrorCode.BAD_PAYLOAD, "text contains NUL characters", rid, session)
    asked = text.strip()
    if not asked:
        raise AskRefused(ErrorCode.EMPTY_TEXT, "text is empty", rid, session)
    if len(asked) > rules.max_text_chars:
        message = f"text has {len(asked)} characters; the limit is {rules.max_text_chars}"
        raise AskRefused(ErrorCode.TEXT_TOO_LONG, message, rid, session)
    return asked


def admit(
    ask: SayAsk,
    rules: IntakeRules,
    *,
    origin: str,
    reply_to: ReplyTo | None = None,
    received_at: float | None = None,
    streamed: bool = False,
) -> Parsed:
    """The request ``ask`` makes, or its rejection. ``streamed``: its text comes later, through the
    feed its door attaches (``tts/stream``, ``say -``), and is not checked here."""
    received = time.monotonic() if received_at is None else received_at
    rid = ask.id or new_request_id()
    try:
        asked = "" if streamed else asked_text(ask.text, rules, rid, ask.session_id)
        request = _request(ask, rules, rid, asked, origin, reply_to, received)
        if streamed:
            stream = rules.text.stream(request.language, ask.text_options)
            return Parsed(replace(request, text_changed=None), None, stream)
        if ask.prepared:
            return Parsed(replace(request, text_changed=None), None)
        request = prepare(request, rules, ask.text_options)
    except AskRefused as refused:
        return refusal(refused, rules, origin, reply_to, received)
    return Parsed(request, None)


def prepare(request: SayRequest, rules: IntakeRules, options: TextOverrides | None = None) -> SayRequest:
    """``request`` with its text made into what is spoken (``rules.text``: the text stage, in its
    language, with the request's ``options``); ``AskRefused`` (``empty_text``) when nothing is left
    to say. In line on the event loop: the text is at most ``tts.max_text_chars`` (checked before)
    and the stage is linear in its length (its cost a sentence: ``scripts/bench_text.py``)."""
    prepared = rules.text.prepare(request.text, request.language, options)
    log.debug(
        "text_prepared",
        request_id=request.id,
        asked_chars=len(request.text),
        spoken_chars=len(prepared.text),
        changed=prepared.changed,
    )
    if not prepared.text.strip():
        why = "text has nothing to speak once prepared: only emoji, markup or code (the text: section, docs/text.md)"
        raise AskRefused(ErrorCode.EMPTY_TEXT, why, request.id, request.session_id)
    spoken = prepared.text if prepared.text != request.text else None
    return replace(request, spoken=spoken, text_changed=prepared.changed)


def preview(text: str, language: str | None, rules: IntakeRules, options: TextOverrides | None = None) -> SpokenText:
    """What a say of ``text`` would speak (the web page's Try it shows it), checked as a say's text
    and language are; ``AskRefused`` when one is bad. An empty result is what a say refuses
    ``empty_text``."""
    asked = asked_text(text, rules)
    try:
        canonical = normalize_language(language or rules.default_language, rules.languages)
    except EngineError as exc:
        raise AskRefused(ErrorCode.parse(exc.code, ErrorCode.BAD_PAYLOAD), str(exc)) from exc
    return rules.text.prepare(asked, canonical, options)


def _request(
    ask: SayAsk, rules: IntakeRules, rid: str, asked: str, origin: str, reply_to: ReplyTo | None, received: float
) -> SayRequest:
    """The request ``ask`` asks for, its instruction, language and voice checked; ``AskRefused`` when one is bad."""
    instruct = ask.instruct.strip() if ask.instruct and ask.instruct.strip() else None
    if instruct is not None and len(instruct) > rules.max_instruct_chars:
        limit = rules.max_instruct_chars
        message = f"instruct has {len(instruct)} characters; the limit is {limit} (tts.max_instruct_chars)"
        raise AskRefused(ErrorCode.TEXT_TOO_LONG, message, rid, ask.session_id, field="instruct")
    try:
        language = normalize_language(ask.language or rules.default_language, rules.languages)
        voice = rules.voices.resolve(ask.voice)
    except EngineError as exc:
        raise AskRefused(ErrorCode.parse(exc.code, ErrorCode.BAD_PAYLOAD), str(exc), rid, ask.session_id) from exc
    return SayRequest(
        id=rid,
        text=asked,
        voice=voice,
        language=language,
        site_id=rules.site_id,
        instruct=instruct,
        session_id=ask.session_id,
        priority=ask.priority,
        interrupt=ask.interrupt,
        ttl_ms=ask.ttl_ms,
        volume=ask.volume,
        received_at=received,
        origin=origin,
        reply_to=reply_to,
    )


def refusal(refused: AskRefused, rules: IntakeRules, origin: str, reply_to: ReplyTo | None, received: float) -> Parsed:
    """The rejection ``refused`` makes: a placeholder request (its id when it was read) and the error."""
    request = SayRequest(
        id=refused.rid or new_request_id(),
        text="",
        voice=None,
        language="auto",
        site_id=rules.site_id,
        session_id=refused.session,
        received_at=received,
        origin=origin,
        reply_to=reply_to,
    )
    return Parsed(request, RequestError(refused.code, refused.message, refused.field))
