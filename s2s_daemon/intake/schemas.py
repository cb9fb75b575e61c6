"""Payload schemas at the MQTT edge (and the web page's ``/api/say``, which takes MQTT's JSON):
decode, validate, classify bad input, and read a say into the ``SayAsk`` every door hands to
``admission.admit``."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from s2s_daemon.intake.admission import AskRefused, IntakeRules, Parsed, SayAsk, admit, refusal
from s2s_daemon.pipeline.messages import ErrorCode, ReplyTo, RequestError
from s2s_daemon.text import TextOverrides

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
    textOptions: TextOverrides | None = None
    """The text stage's keys for this request (``{"emoji": "name", "codeBlocks": "read"}``); an
    unknown key or a wrong value is refused ``bad_payload`` naming it."""

    def ask(self) -> SayAsk:
        """What it asks, for ``admission.admit``."""
        return SayAsk(
            text=self.text,
            id=self.id,
            voice=self.voice,
            language=self.language or self.lang,
            instruct=self.instruct,
            session_id=self.sessionId,
            priority=self.priority,
            interrupt=self.interrupt,
            ttl_ms=self.ttlMs,
            volume=self.volume,
            text_options=self.textOptions,
        )


class StopPayload(BaseModel):
    """``<p>/<site>/tts/stop``: ``{}``, ``{"id": X}`` or ``{"all": true}``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: RequestId | None = None
    all: StrictBool = False


def _peek_fields(data: object) -> tuple[str | None, str | None]:
    """Best-effort id and sessionId from an invalid payload, so the rejection is addressable."""
    if not isinstance(data, dict):
        return None, None
    rid = data.get("id")
    sid = data.get("sessionId")
    rid_s = str(rid)[:MAX_ID_CHARS] if isinstance(rid, str | int) and not isinstance(rid, bool) and str(rid) else None
    return rid_s, sid if isinstance(sid, str) and len(sid) <= MAX_NAME_CHARS else None


def describe_error(exc: ValidationError) -> str:
    """A validation error in a person's words, each key at fault named (``textOptions.emoji: ...``)."""
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


def _read_payload(payload: bytes) -> SayPayload:
    """A JSON object or plain UTF-8 text as a ``SayPayload``; ``AskRefused`` when it is neither."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise AskRefused(ErrorCode.BAD_PAYLOAD, f"payload of {len(payload)} bytes is larger than {MAX_PAYLOAD_BYTES}")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AskRefused(
            ErrorCode.BAD_PAYLOAD, f"payload is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from exc
    text = text.removeprefix("\ufeff")
    if not text.lstrip().startswith("{"):
        return SayPayload(text=text)
    data, why = decode_json_object(payload.removeprefix(b"\xef\xbb\xbf"))
    if data is None:
        raise AskRefused(ErrorCode.BAD_PAYLOAD, why or "bad payload")
    rid, session = _peek_fields(data)
    try:
        return SayPayload.model_validate(data)
    except ValidationError as exc:
        raise AskRefused(ErrorCode.BAD_PAYLOAD, describe_error(exc), rid, session) from exc


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
    except AskRefused as refused:
        return refusal(refused, rules, origin, reply_to, received)
    return admit(say.ask(), rules, origin=origin, reply_to=reply_to, received_at=received)


# -- streamed text -------------------------------------------------------------------------

MAX_STREAM_SEQ = 1_000_000


class StreamPayload(SayPayload):
    """``<p>/<site>/tts/stream``: one piece of a text still being written.

    ``{"id": "r1", "seq": 0, "text": "Hel", "voice": "Ryan"}``, ``{"id": "r1", "seq": 1, "text":
    "lo."}``, ..., ``{"id": "r1", "seq": 7, "end": true}``. Piece 0 opens the stream and carries
    the say fields (voice, language, priority, interrupt, ttlMs, textOptions, ...); they are ignored on the
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
    rid, _ = _peek_fields(data)
    try:
        piece = StreamPayload.model_validate(data)
    except ValidationError as exc:
        return StreamPiece(rid, None, "", False, RequestError(ErrorCode.BAD_PAYLOAD, describe_error(exc)))
    if "\x00" in piece.text:
        return StreamPiece(piece.id, piece.seq, "", False, RequestError(ErrorCode.BAD_PAYLOAD, "text contains NUL"))
    opening = None
    if piece.seq == 0:
        ask = piece.ask()
        opening = admit(ask, rules, origin=origin, reply_to=reply_to, received_at=received, streamed=True)
    return StreamPiece(piece.id, piece.seq, piece.text, piece.end, None, opening, received)
