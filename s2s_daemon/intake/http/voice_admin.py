"""The voice library over HTTP, for the web page (and scripts): ``/api/voices``.

``GET /api/voices`` lists the model's preset speakers and every library voice (also those the
loaded model cannot speak, marked so); ``POST`` adds a cloned voice from an uploaded recording
(multipart ``audio``) or a designed one from an instruction, with the checks ``s2s-daemon voices
add`` makes (length, clipping, silence; ``dry_run`` checks without saving); ``GET``, ``PATCH``
(rename) and ``DELETE`` on ``/api/voices/{name}``; ``GET /api/voices/{name}/reference`` is the
recording. The edits are ``s2s-daemon voices``' (``pipeline.voice_edits``), run off the event loop one at a time.
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
from pathlib import Path
from typing import Any, Protocol

from aiohttp import BodyPartReader, web
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from s2s_daemon.intake.admission import IntakeRules
from s2s_daemon.intake.http.api import ApiError
from s2s_daemon.intake.http.guard import json_body
from s2s_daemon.intake.schemas import decode_json_object
from s2s_daemon.pipeline.vocabulary import EngineError, EngineInfo, normalize_language
from s2s_daemon.pipeline.voice_edits import (
    ReferenceStats,
    VoiceEditError,
    add_voice,
    check_audio,
    measure,
    read_audio,
    remove_voice,
    rename_voice,
)
from s2s_daemon.pipeline.voices import MAX_TEXT_BYTES, LibraryVoice, VoiceKind, VoiceLibrary, read_voice

READ_CHUNK_BYTES = 256 * 1024
"""A recording is sent in pieces of this size."""
MAX_REFERENCE_BYTES = 24 * 1024 * 1024
"""The largest recording accepted: 30 s of 48 kHz stereo float WAV (11.5 MB) fits twice."""
STATUS_OF_CODE = {"voice_exists": 409, "name_taken": 409, "voice_not_found": 404}
"""HTTP status of a refused edit (``VoiceEditError.code``); any other code is 400."""
PARAM_OF_CODE = {
    "bad_voice_name": "name",
    "voice_exists": "name",
    "name_taken": "name",
    "reference_length": "audio",
    "silent_reference": "audio",
    "unreadable_audio": "audio",
    "unsupported_audio": "audio",
}
MODELS_FOR = {VoiceKind.CLONE: "a Base model", VoiceKind.DESIGN: "a VoiceDesign model"}


class VoiceFields(BaseModel):
    """``POST /api/voices``: a multipart form (the recording as the file ``audio``) or a JSON object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr | None = None
    """Needed unless ``dry_run``."""
    ref_text: StrictStr | None = None
    """Transcript of the recording (better clones)."""
    instruct: StrictStr | None = None
    """A designed voice's description (VoiceDesign models)."""
    language: StrictStr | None = None
    description: StrictStr | None = None
    force: bool = False
    """Replace a voice of that name; take a recording of any length, or a silent one."""
    dry_run: bool = False
    """Check the recording, save nothing."""


class RenameFields(BaseModel):
    """``PATCH /api/voices/{name}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr


def _edit_error(exc: VoiceEditError) -> ApiError:
    param = PARAM_OF_CODE.get(exc.code)
    return ApiError(STATUS_OF_CODE.get(exc.code, 400), str(exc), code=exc.code, param=param)


def _bad_fields(exc: ValidationError) -> ApiError:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return ApiError(400, f"{param}: {err['msg']}", code="bad_payload", param=param)


def _stats(stats: ReferenceStats | None) -> dict[str, float] | None:
    if stats is None:
        return None
    return {
        "seconds": round(stats.seconds, 2),
        "rms": round(stats.rms, 5),
        "clipped_share": round(stats.clipped_share, 5),
    }


class PipelineSource(Protocol):
    """Where the rules and the engine's facts are read, at each request (the speech API's server)."""

    @property
    def rules(self) -> IntakeRules: ...

    @property
    def info(self) -> EngineInfo: ...


class VoiceAdmin:
    """The ``/api/voices`` endpoints over ``rules.voices.library``. The constructor does no I/O."""

    def __init__(self, source: PipelineSource, max_fields_bytes: int) -> None:
        self.source = source
        self.max_fields_bytes = max_fields_bytes
        """A form's fields together, the recording aside (``http.max_body_bytes``)."""
        self._edits = asyncio.Lock()
        """One library edit at a time."""

    @property
    def rules(self) -> IntakeRules:
        return self.source.rules

    @property
    def info(self) -> EngineInfo:
        return self.source.info

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/voices", self._list)
        app.router.add_post("/api/voices", self._add)
        app.router.add_get("/api/voices/{name}", self._get)
        app.router.add_patch("/api/voices/{name}", self._rename)
        app.router.add_delete("/api/voices/{name}", self._remove)
        app.router.add_get("/api/voices/{name}/reference", self._reference)

    @property
    def library(self) -> VoiceLibrary:
        library = self.rules.voices.library
        if library is None:
            raise ApiError(404, "this daemon has no voice library", code="no_voice_library")
        return library

    # -- reading -------------------------------------------------------------------------

    def _detail_blocking(self, voice: LibraryVoice) -> dict[str, Any]:
        kind = self.library.kind
        seconds = None
        if voice.ref_audio is not None:
            import soundfile

            try:
                seconds = round(soundfile.info(str(voice.ref_audio)).duration, 2)
            except (soundfile.LibsndfileError, RuntimeError, OSError):
                seconds = None
        kinds = [str(k) for k in voice.kinds]
        return {
            "name": voice.name,
            "kind": kinds[0] if kinds else None,
            "kinds": kinds,
            "speakable": kind is not None and kind in voice.kinds,
            "transcript": voice.ref_text,
            "instruct": voice.instruct,
            "language": voice.language,
            "description": voice.description,
            "seconds": seconds,
        }

    def _list_blocking(self) -> dict[str, Any]:
        library = self.library
        preset = str(VoiceKind.PRESET)
        presets = [{"name": v, "kind": preset, "kinds": [preset], "speakable": True} for v in self.info.voices]
        named: list[dict[str, Any]] = []
        for folder in library.folder_names():
            if self.rules.voices.is_preset(folder):
                continue  # a preset of that name wins: requests naming it get the preset
            voice = read_voice(library.root, folder)
            if voice is None:  # unreadable, or leading outside the folder: listed to be removed
                named.append({"name": folder, "kind": None, "kinds": [], "speakable": False, "unreadable": True})
            else:
                named.append(self._detail_blocking(voice))
        default = self.rules.voices.default_voice()
        return {
            "mode": self.info.mode,
            "can_clone": library.kind is VoiceKind.CLONE,
            "can_design": library.kind is VoiceKind.DESIGN,
            "default": default,
            "languages": list(self.info.languages),
            "folder": str(library.root),
            "voices": presets + named,
        }

    def _find_blocking(self, name: str) -> LibraryVoice:
        """The library voice ``name`` (its own spelling, else any case); 404 when there is none."""
        library = self.library
        voice = read_voice(library.root, name)
        if voice is None:
            spelled = next((n for n in library.folder_names() if n.lower() == name.lower()), None)
            voice = read_voice(library.root, spelled) if spelled is not None else None
        if voice is None:
            raise ApiError(404, f"no voice {name!r} in the library", code="voice_not_found", param="name")
        return voice

    def _folder_blocking(self, name: str) -> str:
        """The library folder called ``name`` (its own spelling, else any case), readable or not."""
        folders = self.library.folder_names()
        if name in folders:
            return name
        spelled = next((n for n in folders if n.lower() == name.lower()), None)
        if spelled is None:
            raise ApiError(404, f"no voice {name!r} in the library", code="voice_not_found", param="name")
        return spelled

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(self._list_blocking))

    async def _get(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        detail = await asyncio.to_thread(lambda: self._detail_blocking(self._find_blocking(name)))
        return web.json_response(detail)

    async def _reference(self, request: web.Request) -> web.StreamResponse:
        voice = await asyncio.to_thread(self._find_blocking, request.match_info["name"])
        fd = await asyncio.to_thread(self._open_reference_blocking, voice)
        try:
            response = web.StreamResponse(headers={"Content-Type": "audio/wav", "Cache-Control": "no-store"})
            response.content_length = os.fstat(fd).st_size
            await response.prepare(request)
            while chunk := await asyncio.to_thread(os.read, fd, READ_CHUNK_BYTES):
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            os.close(fd)

    def _open_reference_blocking(self, voice: LibraryVoice) -> int:
        """The voice's recording, opened once and served from that descriptor: a regular file (not a
        link: ``O_NOFOLLOW``) that is the very file its path resolves to inside the voices folder. A
        check of the path and then a second open could serve whatever the path was swapped for
        between them (a link to a file outside the folder)."""
        path = voice.ref_audio
        missing = ApiError(404, f"voice {voice.name!r} has no recording", code="no_reference", param="name")
        if path is None:
            raise missing
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise missing from exc
        try:
            served = _is_the_file_inside(fd, path, self.library.root)
        except BaseException:
            os.close(fd)
            raise
        if not served:
            os.close(fd)
            raise missing
        return fd

    # -- editing -------------------------------------------------------------------------

    async def _add(self, request: web.Request) -> web.Response:
        raw, upload, filename = await self._read_add(request)
        try:
            fields = VoiceFields.model_validate(raw)
        except ValidationError as exc:
            raise _bad_fields(exc) from exc
        language = self._language(fields.language)
        for key in ("ref_text", "instruct", "description"):
            value = getattr(fields, key)
            if value is not None and len(value.encode()) > MAX_TEXT_BYTES:
                raise ApiError(400, f"{key} is longer than {MAX_TEXT_BYTES} bytes", code="bad_payload", param=key)
        if fields.dry_run:
            if upload is None:
                why = "dry_run checks a recording: send the file as audio"
                raise ApiError(400, why, code="bad_payload", param="audio")
            checked = await asyncio.to_thread(self._check_blocking, upload, filename, fields.force)
            # A recording the checks refuse is 422 (the error in OpenAI's shape, beside the checks)
            return web.json_response(checked, status=200 if checked["error"] is None else 422)
        if fields.name is None:
            raise ApiError(400, "name: a voice needs a name", code="bad_payload", param="name")
        async with self._edits:
            answer = await asyncio.to_thread(self._add_blocking, fields, language, upload, filename)
        return web.json_response(answer, status=201, headers={"Location": f"/api/voices/{fields.name}"})

    def _language(self, value: str | None) -> str | None:
        if value is None or not value.strip() or value.strip().lower() == "auto":
            return None
        try:
            return normalize_language(value, self.info.languages)
        except EngineError as exc:
            raise ApiError(400, str(exc), code="unsupported_language", param="language") from exc

    def _check_blocking(self, upload: bytes, filename: str | None, force: bool) -> dict[str, Any]:
        try:
            audio = read_audio(io.BytesIO(upload), label=filename or "the uploaded file")
        except VoiceEditError as exc:
            raise _edit_error(exc) from exc
        error = None
        warnings: list[str] = []
        try:
            warnings = check_audio(audio, force)
        except VoiceEditError as exc:
            error = {"code": exc.code, "message": str(exc), "param": PARAM_OF_CODE.get(exc.code, "audio")}
        warnings += self._unspeakable(VoiceKind.CLONE)
        return {"checks": _stats(measure(audio)), "warnings": warnings, "error": error}

    def _unspeakable(self, kind: VoiceKind) -> list[str]:
        if self.library.kind is kind:
            return []
        return [
            f"this {self.info.mode} model cannot speak {kind} voices: the voice is kept in the library"
            f" for {MODELS_FOR[kind]}"
        ]

    def _add_blocking(
        self, fields: VoiceFields, language: str | None, upload: bytes | None, filename: str | None
    ) -> dict[str, Any]:
        assert fields.name is not None
        audio = None
        stats = None
        warnings: list[str] = []
        try:
            if upload is not None:
                audio = read_audio(io.BytesIO(upload), label=filename or "the uploaded file")
                warnings = check_audio(audio, fields.force)
                stats = measure(audio)
            add_voice(
                self.library.root,
                fields.name,
                audio=audio,
                ref_text=fields.ref_text,
                instruct=fields.instruct,
                language=language,
                description=fields.description,
                replace=fields.force,
            )
        except VoiceEditError as exc:
            raise _edit_error(exc) from exc
        warnings += self._unspeakable(VoiceKind.CLONE if audio is not None else VoiceKind.DESIGN)
        voice = self._find_blocking(fields.name)
        return {"voice": self._detail_blocking(voice), "warnings": warnings, "checks": _stats(stats)}

    async def _read_add(self, request: web.Request) -> tuple[dict[str, Any], bytes | None, str | None]:
        """The fields, the uploaded recording and its file name, from multipart or JSON."""
        if request.content_type == "application/json":
            data, why = decode_json_object(await request.read())
            if data is None:
                raise ApiError(400, f"request body: {why}", code="bad_payload")
            return data, None, None
        if request.content_type != "multipart/form-data":
            raise ApiError(
                415,
                f"send multipart/form-data (a recording as the file 'audio') or application/json,"
                f" not {request.content_type or 'no content type'}",
                code="unsupported_media_type",
            )
        # Read part by part, each name once and only the known ones, so that a form is never read
        # past its bounds: the recording's MAX_REFERENCE_BYTES and the fields' max_fields_bytes.
        fields: dict[str, Any] = {}
        upload: bytes | None = None
        filename: str | None = None
        left = self.max_fields_bytes
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            name = part.name if isinstance(part, BodyPartReader) else None
            if not isinstance(part, BodyPartReader) or name is None:
                raise ApiError(400, "every part of the form needs a name", code="bad_payload")
            if name != "audio" and name not in VoiceFields.model_fields:
                known = ", ".join(["audio", *VoiceFields.model_fields])
                raise ApiError(400, f"{name}: unknown field (the fields: {known})", code="bad_payload", param=name)
            if name in fields or (name == "audio" and upload is not None):
                raise ApiError(400, f"{name}: sent twice", code="bad_payload", param=name)
            if name == "audio":
                upload = await _read_part(
                    part, MAX_REFERENCE_BYTES, f"audio is larger than {MAX_REFERENCE_BYTES} bytes"
                )
                filename = part.filename
                continue
            if left < MAX_TEXT_BYTES:
                value = await _read_part(
                    part, left, f"the form's fields are larger than {self.max_fields_bytes} bytes (http.max_body_bytes)"
                )
            else:
                value = await _read_part(part, MAX_TEXT_BYTES, f"{name} is larger than {MAX_TEXT_BYTES} bytes")
            left -= len(value)
            fields[name] = value.decode("utf-8", "replace")
        if upload is not None and not upload:
            raise ApiError(400, "audio: the file is empty", code="bad_payload", param="audio")
        return fields, upload, filename

    async def _rename(self, request: web.Request) -> web.Response:
        data, why = decode_json_object(await json_body(request))
        if data is None:
            raise ApiError(400, f"request body: {why}", code="bad_payload")
        try:
            fields = RenameFields.model_validate(data)
        except ValidationError as exc:
            raise _bad_fields(exc) from exc

        def rename_blocking() -> dict[str, Any]:
            folder = self._folder_blocking(request.match_info["name"])
            try:
                rename_voice(self.library.root, folder, fields.name)
            except VoiceEditError as exc:
                raise _edit_error(exc) from exc
            return {"voice": self._detail_blocking(self._find_blocking(fields.name))}

        async with self._edits:
            return web.json_response(await asyncio.to_thread(rename_blocking))

    async def _remove(self, request: web.Request) -> web.Response:
        def remove_blocking() -> dict[str, Any]:
            folder = self._folder_blocking(request.match_info["name"])
            try:
                remove_voice(self.library.root, folder)
            except VoiceEditError as exc:
                raise _edit_error(exc) from exc
            return {"name": folder, "deleted": True}

        async with self._edits:
            return web.json_response(await asyncio.to_thread(remove_blocking))


def _is_the_file_inside(fd: int, path: Path, root: Path) -> bool:
    """Whether ``fd`` is a regular file and the very file ``path`` resolves to, inside ``root``."""
    opened = os.fstat(fd)
    try:
        real = path.resolve(strict=True)
        inside = real.is_relative_to(root.resolve(strict=True))
        return stat.S_ISREG(opened.st_mode) and inside and os.path.samestat(opened, os.stat(real))
    except (OSError, RuntimeError):  # gone meanwhile, or a loop of links
        return False


async def _read_part(part: BodyPartReader, limit: int, too_large: str) -> bytes:
    """The part's bytes; 413 ``too_large`` as soon as more than ``limit`` came (nothing more is read)."""
    data = bytearray()
    while chunk := await part.read_chunk():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, too_large, code="request_too_large", param=part.name)
    return bytes(data)
