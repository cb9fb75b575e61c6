"""The speech API's edge: OpenAI's request fields validated, our requests' outcomes as OpenAI's
error JSON ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from s2s_daemon.intake.admission import IntakeRules, SayAsk
from s2s_daemon.intake.http.encoders import FORMATS
from s2s_daemon.intake.schemas import MAX_NAME_CHARS, Name, decode_json_object
from s2s_daemon.pipeline.messages import ErrorCode, RequestError, Status
from s2s_daemon.pipeline.stretch import SPEED_RANGE, StretchUnavailableError, needs_stretch, require_stretch
from s2s_daemon.pipeline.voice_policy import OPENAI_VOICES

MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
"""Listed by ``/v1/models`` beside the daemon's model; ``model`` itself is accepted and ignored."""
STREAM_FORMATS = ("audio", "sse")
PARAM_OF_CODE = {
    ErrorCode.EMPTY_TEXT: "input",
    ErrorCode.TEXT_TOO_LONG: "input",
    ErrorCode.BAD_PAYLOAD: "input",
    ErrorCode.UNKNOWN_VOICE: "voice",
    ErrorCode.UNSUPPORTED_LANGUAGE: "language",
}
PARAM_OF_FIELD = {"instruct": "instructions", "text": "input"}
"""A say request's field as the speech API names it (its ``param``)."""


class ApiError(Exception):
    """An error answer; ``retry`` sets the OpenAI SDK's ``x-should-retry`` (None: its default)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry: bool | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        if retry is not None:
            self.headers["x-should-retry"] = "true" if retry else "false"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class VoiceRef(BaseModel):
    """OpenAI's custom-voice object ``{"id": ...}``; the id names one of our voices."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: StrictStr


class SpeechPayload(BaseModel):
    """``POST /v1/audio/speech``: OpenAI's fields, and ``language`` (ours). Unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: Name | None = None
    """Accepted and ignored: the daemon serves the one model it loaded."""
    input: StrictStr
    voice: StrictStr | VoiceRef | None = None
    """A name of at most ``MAX_NAME_CHARS``, as such or as ``{"id": name}``."""
    instructions: StrictStr | None = None
    """The request's ``instruct`` (style for CustomVoice, description for VoiceDesign): at most
    ``tts.max_instruct_chars``, checked with the say rules."""
    response_format: Name = "mp3"
    speed: float = Field(1.0, allow_inf_nan=False)
    """Playback speed, 0.25..4.0: the audio is time-stretched as it streams, its pitch kept."""
    stream_format: Name = "audio"
    language: Name | None = None
    """Ours: ``auto``, the model's names or codes (``en``, ``de-DE``); default ``tts.language``."""

    @field_validator("voice")
    @classmethod
    def _voice_is_a_name(cls, value: str | VoiceRef | None) -> str | VoiceRef | None:
        name = value.id if isinstance(value, VoiceRef) else value
        if name is not None and len(name) > MAX_NAME_CHARS:  # checked here: the union's error would name its member
            raise PydanticCustomError(
                "string_too_long", "String should have at most {max_length} characters", {"max_length": MAX_NAME_CHARS}
            )
        return value

    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


def parse_speech(body: bytes) -> SpeechPayload:
    """The request body as a speech request whose format and speed the daemon can serve."""
    data, why = decode_json_object(body)
    if data is None:
        raise ApiError(400, f"request body: {why}", code=ErrorCode.BAD_PAYLOAD.value)
    try:
        speech = SpeechPayload.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{param}: {err['msg']}", code=ErrorCode.BAD_PAYLOAD.value, param=param) from exc
    fmt = speech.response_format.lower()
    if fmt not in FORMATS:
        why = "needs an AAC encoder (FFmpeg), which this daemon does not ship" if fmt == "aac" else "is unknown"
        raise ApiError(
            400,
            f"response_format {speech.response_format!r} {why}; choose one of {', '.join(FORMATS)}",
            code="unsupported_response_format",
            param="response_format",
        )
    if speech.stream_format not in STREAM_FORMATS:
        raise ApiError(
            400, f"stream_format must be one of {', '.join(STREAM_FORMATS)}", code="bad_payload", param="stream_format"
        )
    low, high = SPEED_RANGE
    if not low <= speech.speed <= high:
        raise ApiError(
            400,
            f"speed {speech.speed:g} is out of range: it must be between {low:g} and {high:g} (1.0: the model's pace)",
            code="bad_payload",
            param="speed",
        )
    if needs_stretch(speech.speed):
        try:
            require_stretch()
        except StretchUnavailableError as exc:
            raise ApiError(400, f"speed {speech.speed:g}: {exc}", code="unsupported_speed", param="speed") from exc
    return speech.model_copy(update={"response_format": fmt})


def speech_ask(speech: SpeechPayload, rules: IntakeRules) -> SayAsk:
    """What ``speech`` asks, for ``admission.admit`` (the same rules as every door's): an OpenAI
    voice name that is none of ours speaks with the default voice."""
    return SayAsk(
        text=speech.input,
        voice=rules.voices.from_openai(speech.voice_name()),
        language=speech.language,
        instruct=speech.instructions,
    )


def with_openai_names(error: RequestError, rules: IntakeRules) -> RequestError:
    """An ``unknown_voice`` answer that names OpenAI's voices too, which speak with the default
    voice (not when there is none: a Base model without ``tts.voice``, whose answer says why)."""
    if rules.voices.no_default is not None:
        return error
    names = ", ".join(sorted(OPENAI_VOICES))
    return RequestError(
        error.code, f"{error.message}, or one of OpenAI's names, which speak with the default voice: {names}"
    )


def invalid_request(error: RequestError) -> ApiError:
    """A say request the intake rules rejected (text, voice, language, instruction)."""
    param = PARAM_OF_FIELD.get(error.field, error.field) if error.field is not None else PARAM_OF_CODE.get(error.code)
    return ApiError(400, error.message, code=error.code.value, param=param)


def unanswered(
    status: Status | None, error: RequestError | None, accepting: bool, whole: tuple[str, float] | None = None
) -> ApiError:
    """A request that ended without audio for its caller: rejected at admission, stopped while queued,
    failed, or (``whole``: the format of a file sent once complete, and the seconds of audio made)
    stopped before its file was complete."""
    code = error.code if error is not None else None
    if error is not None:
        message = error.message
    elif whole is not None and whole[1] > 0:
        message = (
            f"the request was stopped ({status}) after {whole[1]:.1f} s of audio was made; a {whole[0]} file is"
            " sent only once complete, so none was sent (stream_format: audio sends audio as it is made)"
        )
    else:
        message = f"the request ended {status} before any audio was made"
    if code is ErrorCode.QUEUE_FULL:
        return ApiError(429, message, kind="rate_limit_error", code=code.value, headers={"Retry-After": "1"})
    if code is ErrorCode.SHUTTING_DOWN or (code is None and not accepting):
        return ApiError(503, message, kind="server_error", code=ErrorCode.SHUTTING_DOWN.value)
    if code in (ErrorCode.ENGINE_ERROR, ErrorCode.AUDIO_ERROR):
        return ApiError(500, message, kind="server_error", code=code.value if code else None, retry=False)
    if code is not None:
        return invalid_request(error) if error is not None else ApiError(400, message)
    # Stopped while it waited (tts/stop on MQTT) or expired: not the client's fault, not to retry.
    return ApiError(409, message, code=str(status) if status is not None else None, retry=False)
