"""Payload schemas at the MQTT edge: parse, validate, and classify bad input."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from s2s_daemon.pipeline.messages import ErrorCode, ReplyTo, RequestError, SayRequest
from s2s_daemon.pipeline.textfeed import TextFeed
from s2s_daemon.pipeline.vocabulary import EngineError, UnknownVoiceError, match_voice, normalize_language
from s2s_daemon.pipeline.voices import VoiceLibrary

MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
"""Larger payloads are refused before decoding."""
MAX_ID_CHARS = 200
MAX_NAME_CHARS = 200
"""The longest voice, language, ``sessionId`` or ``siteId`` a request may carry (refused ``bad_payload``)."""


def _id_to_str(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


RequestId = Annotated[StrictStr, BeforeValidator(_id_to_str), Field(min_length=1, max_length=MAX_ID_CHARS)]
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]


class SayPayload(BaseModel):
    """``<p>/<site>/tts/say`` JSON (camelCase, as in Hermes). Unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    id: RequestId | None = None
    text: StrictStr
    voice: Name | None = None
    language: Name | None = None
    lang: Name | None = None
    """Hermes spelling of ``language``."""
    instruct: StrictStr | None = None
    """At most ``IntakeRules.max_instruct_chars`` (checked with the rules)."""
    sessionId: Name | None = None
    siteId: Name | None = None
    priority: StrictInt = Field(0, ge=-1000, le=1000)
    interrupt: StrictBool = False
    ttlMs: StrictInt | None = Field(None, ge=0)
    volume: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)


class StopPayload(BaseModel):
    """``<p>/<site>/tts/stop``: ``{}``, ``{"id": X}`` or ``{"all": true}``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: RequestId | None = None
    all: StrictBool = False


@dataclass(frozen=True, slots=True)
class IntakeRules:
    """What a say request is checked against."""

    site_id: str
    max_text_chars: int
    voices: tuple[str, ...]
    languages: tuple[str, ...]
    default_voice: str | None
    default_language: str
    library: VoiceLibrary | None = None
    """Named cloned / designed voices (``tts.voices_dir``); preset speakers win a clash of names."""
    stream_idle_s: float = 20.0
    """A streamed text with no piece for this long (and no end) ends (``tts.stream_idle_s``)."""
    no_default: str | None = None
    """Why a request must name its voice (a Base model with no ``tts.voice``: nothing to clone); a
    request that names none is rejected ``unknown_voice`` with it. None: the default applies."""
    max_instruct_chars: int = 1000
    """The longest ``instruct`` a request may have (``tts.max_instruct_chars``)."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """A say request, and the error that rejects it (None when it is good)."""

    request: SayRequest
    error: RequestError | None


def resolve_voice(value: str | None, rules: IntakeRules) -> str | None:
    """The canonical name of the requested voice (a preset or a library voice); None: the model's own.

    ``None`` or blank picks ``rules.default_voice``. Raises UnknownVoiceError for any other name.
    """
    wanted = value.strip() if value is not None and value.strip() else None
    if wanted is None and rules.no_default is not None:
        raise UnknownVoiceError(rules.no_default)
    library = rules.library
    if library is not None:
        presets = {v.lower() for v in rules.voices}
        name = wanted if wanted is not None else rules.default_voice
        if name is not None and name.strip().lower() not in presets:
            found = library.lookup(name)
            if found is not None:
                return found.name
            if wanted is not None:
                choices = [*rules.voices, *library.names()]
                listed = f"choose one of {', '.join(choices)}" if choices else "this model has no voices to choose"
                raise UnknownVoiceError(f"voice {wanted!r} is unknown; {listed}")
    return match_voice(value, rules.voices, rules.default_voice)


def new_request_id() -> str:
    return uuid.uuid4().hex


def _peek_fields(data: object) -> tuple[str | None, str | None]:
    """Best-effort id and sessionId from an invalid payload, so the rejection is addressable."""
    if not isinstance(data, dict):
        return None, None
    rid = data.get("id")
    sid = data.get("sessionId")
    rid_s = str(rid)[:MAX_ID_CHARS] if isinstance(rid, str | int) and not isinstance(rid, bool) and str(rid) else None
    return rid_s, sid if isinstance(sid, str) and len(sid) <= MAX_NAME_CHARS else None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        key = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{key}: {_readable(err)}")
    return "; ".join(parts)


def _readable(err: Any) -> str:
    """pydantic's words, where they are a person's (``"id": ""`` said "Value should have at least
    1 item after validation, not 0")."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in ("too_short", "string_too_short"):
        least = ctx.get("min_length", 1)
        return "must not be empty" if least == 1 else f"must have at least {least} characters"
    if kind in ("too_long", "string_too_long"):
        return f"must have at most {ctx.get('max_length')} characters"
    return str(err["msg"])


def decode_json_object(payload: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """``(object, None)`` or ``(None, why)``; also accepts an empty payload as ``{}``."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        return None, f"payload of {len(payload)} bytes is larger than {MAX_PAYLOAD_BYTES}"
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"payload is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    if not text.strip():
        return {}, None
    try:
        data = json.loads(text, parse_constant=lambda c: math.nan)
    except (json.JSONDecodeError, RecursionError) as exc:
        return None, f"payload is not valid JSON: {exc}"
    if not isinstance(data, dict):
        return None, f"payload must be a JSON object, not {type(data).__name__}"
    return data, None


class _Refused(Exception):
    """Why a payload becomes a rejection; the id and session when they could be read."""

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


def _read_payload(payload: bytes) -> SayPayload:
    """A JSON object or plain UTF-8 text as a ``SayPayload``; ``_Refused`` when it is neither."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise _Refused(ErrorCode.BAD_PAYLOAD, f"payload of {len(payload)} bytes is larger than {MAX_PAYLOAD_BYTES}")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Refused(ErrorCode.BAD_PAYLOAD, f"payload is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    text = text.removeprefix("\ufeff")
    if not text.lstrip().startswith("{"):
        return SayPayload(text=text)
    data, why = decode_json_object(payload.removeprefix(b"\xef\xbb\xbf"))
    if data is None:
        raise _Refused(ErrorCode.BAD_PAYLOAD, why or "bad payload")
    rid, session = _peek_fields(data)
    try:
        return SayPayload.model_validate(data)
    except ValidationError as exc:
        raise _Refused(ErrorCode.BAD_PAYLOAD, _describe(exc), rid, session) from exc


def _spoken_text(say: SayPayload, rules: IntakeRules, rid: str, session: str | None) -> str:
    """The text to speak, stripped; ``_Refused`` when it is empty, too long or has NULs."""
    if "\x00" in say.text:
        raise _Refused(ErrorCode.BAD_PAYLOAD, "text contains NUL characters", rid, session)
    spoken = say.text.strip()
    if not spoken:
        raise _Refused(ErrorCode.EMPTY_TEXT, "text is empty", rid, session)
    if len(spoken) > rules.max_text_chars:
        message = f"text has {len(spoken)} characters; the limit is {rules.max_text_chars}"
        raise _Refused(ErrorCode.TEXT_TOO_LONG, message, rid, session)
    return spoken


def parse_say(
    payload: bytes,
    rules: IntakeRules,
    *,
    origin: str = "mqtt",
    reply_to: ReplyTo | None = None,
    received_at: float | None = None,
) -> Parsed:
    """Turn a say payload (JSON object or plain UTF-8 text) into a request or a rejection."""
    received = time.monotonic() if received_at is None else received_at
    try:
        say = _read_payload(payload)
        rid = say.id or new_request_id()
        request = _request(say, rules, rid, _spoken_text(say, rules, rid, say.sessionId), origin, reply_to, received)
    except _Refused as refused:
        return _rejection(refused, rules, origin, reply_to, received)
    return Parsed(request, None)


def _request(
    say: SayPayload,
    rules: IntakeRules,
    rid: str,
    spoken: str,
    origin: str,
    reply_to: ReplyTo | None,
    received: float,
    feed: TextFeed | None = None,
) -> SayRequest:
    """The request ``say`` asks for, its voice, language and instruction checked; ``_Refused`` when one is bad."""
    instruct = say.instruct.strip() if say.instruct and say.instruct.strip() else None
    if instruct is not None and len(instruct) > rules.max_instruct_chars:
        limit = rules.max_instruct_chars
        message = f"instruct has {len(instruct)} characters; the limit is {limit} (tts.max_instruct_chars)"
        raise _Refused(ErrorCode.TEXT_TOO_LONG, message, rid, say.sessionId, field="instruct")
    try:
        language = normalize_language(say.language or say.lang or rules.default_language, rules.languages)
        voice = resolve_voice(say.voice, rules)
    except EngineError as exc:
        raise _Refused(ErrorCode.parse(exc.code, ErrorCode.BAD_PAYLOAD), str(exc), rid, say.sessionId) from exc
    return SayRequest(
        id=rid,
        text=spoken,
        voice=voice,
        language=language,
        site_id=rules.site_id,
        instruct=instruct,
        session_id=say.sessionId,
        priority=say.priority,
        interrupt=say.interrupt,
        ttl_ms=say.ttlMs,
        volume=say.volume,
        received_at=received,
        origin=origin,
        reply_to=reply_to,
        feed=feed,
    )


def _rejection(refused: _Refused, rules: IntakeRules, origin: str, reply_to: ReplyTo | None, received: float) -> Parsed:
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


# -- streamed text -------------------------------------------------------------------------

MAX_STREAM_SEQ = 1_000_000


class StreamPayload(SayPayload):
    """``<p>/<site>/tts/stream``: one piece of a text still being written.

    ``{"id": "r1", "seq": 0, "text": "Hel", "voice": "Ryan"}``, ``{"id": "r1", "seq": 1, "text":
    "lo."}``, ..., ``{"id": "r1", "seq": 7, "end": true}``. Piece 0 opens the stream and carries
    the say fields (voice, language, priority, interrupt, ttlMs, ...); they are ignored on the
    others. ``end`` marks the last piece (its text is optional).
    """

    id: RequestId
    text: StrictStr = ""
    seq: StrictInt = Field(ge=0, le=MAX_STREAM_SEQ)
    end: StrictBool = False


@dataclass(frozen=True, slots=True)
class StreamPiece:
    """One streamed piece as read: its place, its text, and (piece 0) the request it opens."""

    id: str | None
    """None when not even the id could be read."""
    seq: int | None
    text: str
    last: bool
    error: RequestError | None
    """Why the piece is bad (then its stream, if it has one, ends with it)."""
    opening: Parsed | None = None
    """Piece 0: the request, or the rejection, that it makes (its feed not attached yet)."""
    received_at: float = 0.0


def parse_stream_piece(
    payload: bytes,
    rules: IntakeRules,
    *,
    origin: str = "mqtt",
    reply_to: ReplyTo | None = None,
    received_at: float | None = None,
) -> StreamPiece:
    """Read a ``tts/stream`` payload. Never raises."""
    received = time.monotonic() if received_at is None else received_at
    data, why = decode_json_object(payload.removeprefix(b"\xef\xbb\xbf"))
    if data is None:
        return StreamPiece(None, None, "", False, RequestError(ErrorCode.BAD_PAYLOAD, why or "bad payload"))
    rid, session = _peek_fields(data)
    try:
        piece = StreamPayload.model_validate(data)
    except ValidationError as exc:
        return StreamPiece(rid, None, "", False, RequestError(ErrorCode.BAD_PAYLOAD, _describe(exc)))
    if "\x00" in piece.text:
        return StreamPiece(piece.id, piece.seq, "", False, RequestError(ErrorCode.BAD_PAYLOAD, "text contains NUL"))
    opening = None
    if piece.seq == 0:
        try:
            opening = Parsed(_request(piece, rules, piece.id, "", origin, reply_to, received), None)
        except _Refused as refused:
            refused.rid, refused.session = piece.id, session
            opening = _rejection(refused, rules, origin, reply_to, received)
    return StreamPiece(piece.id, piece.seq, piece.text, piece.end, None, opening, received)
