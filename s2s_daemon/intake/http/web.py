"""The daemon's web page (``http.enabled``): voices, "try it" and a live view, on the speech API's server.

``GET /`` and ``/static/*`` are the page (plain HTML, CSS and JavaScript shipped in the package, no
build step, nothing fetched from elsewhere) and are served without the bearer token, as is
``GET /api/auth`` (whether calls need it); the page asks for the key and sends it with every call.
Its data calls are authenticated like the API:

- ``GET /api/status``: the engine, the machine (null for a caller without the key on a daemon with one,
  or on another machine when there is none), the state, the requests in hand and the recent history
  of latency and memory events;
- ``GET /api/events``: the same as a Server-Sent Events stream (``snapshot`` first), then every event
  the daemon publishes over MQTT, as published (``state``, ``started``, ``finished``, ``latency``,
  ``memory``, ``info``), and ``jobs`` after each change of the requests in hand;
- ``POST /api/say``: a say request (MQTT's JSON) spoken on the daemon's own speaker; ``POST /api/stop``
  stops as MQTT's ``tts/stop`` does (``{}``: what the speaker speaks, ``{"id": X}``, ``{"all": true}``);
- ``POST /api/text``: ``{text, language?, textOptions?}`` -> ``{spoken, changed}``, what the text
  stage makes of a text (``text/``): Try it shows what is spoken;
- ``/api/voices``: the voice library (``voice_admin``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import os
import platform
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import psutil
from aiohttp import web
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from s2s_daemon import __version__
from s2s_daemon.intake.admission import AskRefused, preview
from s2s_daemon.intake.http.api import ApiError, unanswered
from s2s_daemon.intake.http.encoders import FORMATS
from s2s_daemon.intake.http.guard import json_body
from s2s_daemon.intake.http.live import LiveEvent, LiveFeed
from s2s_daemon.intake.http.voice_admin import PipelineSource, VoiceAdmin
from s2s_daemon.intake.schemas import Name, StopPayload, decode_json_object, describe_error, parse_say
from s2s_daemon.pipeline.jobs import Job, Ledger, Phase
from s2s_daemon.pipeline.messages import ErrorCode, RequestError, Status
from s2s_daemon.text import TextOverrides

KEEPALIVE_S = 15.0
"""A comment line on an idle event stream this often keeps proxies from closing it."""
TEXT_SHOWN_CHARS = 200
"""Of a request's text, the live view shows at most this much."""
ORIGIN = "web"
"""The ``origin`` of the requests the page speaks on the speaker (``POST /api/say``)."""
JOB_EVENTS = frozenset({"state", "started", "finished"})
"""Events after which the page gets the requests in hand again (``jobs``)."""
PAGE_HEADERS = {
    # Everything the page loads comes from the daemon itself; media from blob: URLs it makes.
    "Content-Security-Policy": "default-src 'self'; media-src 'self' blob:; img-src 'self' data:;"
    " frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def static_dir() -> Path:
    return Path(str(resources.files("s2s_daemon.intake.http") / "static"))


@functools.cache
def machine() -> dict[str, Any]:
    """What the daemon runs on (read once)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    return {
        "hostname": platform.node(),
        "system": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_mib": round(psutil.virtual_memory().total / (1024 * 1024)),
        "python": sys.version.split()[0],
    }


class TextPayload(BaseModel):
    """``POST /api/text``: a text, and how a say of it would be read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: StrictStr
    language: Name | None = None
    textOptions: TextOverrides | None = None


def job_row(job: Job, now: float) -> dict[str, Any]:
    """One request in hand, for the live view (its text as it is spoken)."""
    request = job.request
    text = request.to_speak if request.feed is None else "(streamed text)"
    return {
        "id": request.id,
        "origin": request.origin,
        "phase": str(job.phase),
        "output": "speaker" if request.output is None else "caller",
        "voice": request.voice,
        "language": request.language,
        "text": text[:TEXT_SHOWN_CHARS],
        "chars": request.chars,
        "priority": request.priority,
        "ageMs": round((now - request.received_at) * 1000.0),
    }


class PageSource(PipelineSource, Protocol):
    """What the page reads from the server it is served by (the speech API's), at each request."""

    @property
    def ledger(self) -> Ledger: ...

    @property
    def feed(self) -> LiveFeed | None: ...

    @property
    def auth_required(self) -> bool: ...

    def require_attached(self) -> None: ...

    async def write_or_cut(self, request: web.Request, response: web.StreamResponse, data: bytes | None) -> None:
        """Write ``data`` (None: the end), cutting a client that takes none of it in time
        (``ConnectionResetError``)."""


class WebPage:
    """The page's routes on the speech API's app. The constructor does no I/O."""

    def __init__(self, server: PageSource, max_body_bytes: int) -> None:
        self.server = server
        self.voices = VoiceAdmin(server, max_body_bytes)

    @property
    def ledger(self) -> Ledger:
        return self.server.ledger

    def add_routes(self, app: web.Application) -> frozenset[str]:
        """Register the page, its files and its API; the paths served without the bearer token."""
        public = {"/", "/api/auth"}
        app.router.add_get("/", self._page)
        app.router.add_get("/api/auth", self._auth)
        for path in sorted(static_dir().iterdir()):
            if path.is_file() and path.suffix in STATIC_TYPES and path.name != "index.html":
                route = f"/static/{path.name}"
                app.router.add_get(route, functools.partial(self._static, path))
                public.add(route)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/events", self._events)
        app.router.add_post("/api/say", self._say)
        app.router.add_post("/api/stop", self._stop)
        app.router.add_post("/api/text", self._text)
        self.voices.add_routes(app)
        app.on_shutdown.append(self._close_streams)
        return frozenset(public)

    # -- the page ----------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return await self._static(static_dir() / "index.html", request)

    async def _static(self, path: Path, request: web.Request) -> web.StreamResponse:
        headers = {**PAGE_HEADERS, "Content-Type": STATIC_TYPES[path.suffix]}
        return web.FileResponse(path, headers=headers)

    async def _auth(self, request: web.Request) -> web.Response:
        """Whether the page must ask for the key before its first call (a refused call would
        leave an error in the browser's console)."""
        return web.json_response({"key_required": self.server.auth_required})

    # -- the live view -----------------------------------------------------------------

    def jobs(self) -> list[dict[str, Any]]:
        """The requests in hand: those being synthesized or spoken, then the queue in serving order."""
        now = time.monotonic()
        jobs = self.ledger.jobs
        busy = [job_row(j, now) for j in jobs.values() if j.phase is not Phase.QUEUED]
        waiting = [job_row(jobs[r.id], now) for r in self.ledger.queue.waiting() if r.id in jobs]
        return busy + waiting

    def state(self) -> dict[str, Any]:
        state, current = self.ledger.state()
        return {"state": state, "queue": len(self.ledger.queue), "currentId": current}

    def snapshot(self, machine_info: dict[str, Any] | None) -> dict[str, Any]:
        """Everything the live view shows, now (built without a pause: no event falls between it and
        a subscription made just before)."""
        info = self.server.info
        feed = self.server.feed
        return {
            "version": __version__,
            "siteId": self.server.rules.site_id,
            "engine": {
                "engine": info.engine,
                "model": info.model,
                "device": info.device,
                "dtype": info.dtype,
                "mode": info.mode,
                "sampleRate": info.sample_rate,
                "voices": list(info.voices),
                "languages": list(info.languages),
            },
            "formats": list(FORMATS),
            "machine": machine_info,
            "state": self.state(),
            "jobs": self.jobs(),
            "history": feed.history() if feed is not None else {"latency": [], "memory": []},
            "live": feed is not None,
        }

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot(await self._machine_for(request)))

    async def _machine_for(self, request: web.Request) -> dict[str, Any] | None:
        """The machine (host name, kernel, CPU, memory) for a caller that sent the key, or, on a
        daemon without one, a caller on this machine; None for others: it tells a stranger what to
        attack and helps nobody else."""
        if self.server.auth_required or _is_loopback(request.remote):
            return await asyncio.to_thread(machine)
        return None

    async def _events(self, request: web.Request) -> web.StreamResponse:
        self.server.require_attached()  # 503 while the model loads: said before the stream starts
        feed = self.server.feed
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        machine_info = await self._machine_for(request)
        try:
            # Every write through write_or_cut: a page that reads nothing for http.write_timeout_s
            # (a stopped tab, a client that never reads) is cut instead of holding its connection.
            write = functools.partial(self.server.write_or_cut, request, response)
            if feed is None:  # no live events (a server built without the feed): the snapshot only
                await write(_event("snapshot", self.snapshot(machine_info)))
                await write(None)
                return response
            with feed.subscribe() as subscription:
                await write(_event("snapshot", self.snapshot(machine_info)))
                while True:
                    try:
                        async with asyncio.timeout(KEEPALIVE_S):
                            event = await subscription.get()
                    except TimeoutError:
                        await write(b": keepalive\n\n")
                        continue
                    if event is None:  # the server is closing
                        break
                    await write(self._relayed(event))
            await write(None)
        except ConnectionResetError:
            pass  # the page went away, or was cut
        return response

    def _relayed(self, event: LiveEvent) -> bytes:
        """The stream's bytes for ``event``: itself, and after a job's event the jobs' list."""
        data = _event(event.kind, event.payload)
        if event.kind in JOB_EVENTS:
            data += _event("jobs", {"jobs": self.jobs()})
        return data

    async def _close_streams(self, app: web.Application) -> None:
        """The server is closing: end the event streams now instead of after the close timeout."""
        feed = self.server.feed
        if feed is not None:
            feed.close()

    # -- speaking on the speaker ---------------------------------------------------------

    async def _say(self, request: web.Request) -> web.Response:
        received = time.monotonic()
        parsed = parse_say(await json_body(request), self.server.rules, origin=ORIGIN, received_at=received)
        if parsed.error is not None:
            self.ledger.reject(parsed.request, parsed.error.code, parsed.error.message)
            raise _say_error(parsed.error)
        job = self.ledger.submit(parsed.request)
        if job.status is Status.REJECTED:
            raise unanswered(job.status, job.error, self.ledger.accepting)
        return web.json_response({"id": job.request.id, "status": "queued"}, status=202)

    async def _text(self, request: web.Request) -> web.Response:
        """What a say of the text would speak: ``{spoken, changed}`` (``spoken`` empty: nothing, a
        say of it is refused ``empty_text``). The text stage runs in line, as at admission."""
        data, why = decode_json_object(await json_body(request))
        if data is None:
            raise ApiError(400, f"request body: {why}", code="bad_payload")
        try:
            asked = TextPayload.model_validate(data)
        except ValidationError as exc:
            raise ApiError(400, describe_error(exc), code="bad_payload") from exc
        try:
            spoken = preview(asked.text, asked.language, self.server.rules, asked.textOptions)
        except AskRefused as refused:
            raise _say_error(RequestError(refused.code, refused.message)) from None
        return web.json_response({"spoken": spoken.text, "changed": spoken.changed})

    async def _stop(self, request: web.Request) -> web.Response:
        data, why = decode_json_object(await json_body(request))
        if data is None:
            raise ApiError(400, f"request body: {why}", code="bad_payload")
        try:
            stop = StopPayload.model_validate(data)
        except ValidationError as exc:
            raise ApiError(400, str(exc.errors()[0]["msg"]), code="bad_payload") from exc
        if stop.all:
            stopped = self.ledger.stop_all()
        elif stop.id is not None:
            stopped = int(self.ledger.stop_id(stop.id))
        else:
            stopped = int(self.ledger.stop_current())
        return web.json_response({"stopped": stopped})


def _is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


SAY_PARAM = {
    ErrorCode.EMPTY_TEXT: "text",
    ErrorCode.TEXT_TOO_LONG: "text",
    ErrorCode.UNKNOWN_VOICE: "voice",
    ErrorCode.UNSUPPORTED_LANGUAGE: "language",
}
"""``POST /api/say``'s ``param``: its body is a say request (MQTT's JSON), so its own field names
(``text``), not the speech API's (``input``)."""


def _say_error(error: RequestError) -> ApiError:
    """A refused ``/api/say`` request: 400, its code, and the field at fault (``id: must not be
    empty`` names ``id``)."""
    param = SAY_PARAM.get(error.code)
    if param is None and error.code is ErrorCode.BAD_PAYLOAD:
        key = error.message.partition(":")[0]
        param = key if key.isidentifier() else None
    return ApiError(400, error.message, code=error.code.value, param=param)


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()
