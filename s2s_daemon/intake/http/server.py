"""The speech API's aiohttp server, in the daemon's event loop (task ``s2s.http``).

A speech request becomes a say request like MQTT's (same rules, queue, engine and ledger, origin
``http``) whose audio goes back to the caller (``CallerStream``) instead of the speaker. Bytes go
out as they are synthesized; a client that disconnects stops its synthesis.

It listens before the model loads, so that ``/health`` and ``/ready`` answer meanwhile; the API's
own paths answer 503 ``model_loading`` until the daemon ``attach``es its pipeline.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import hmac
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
from aiohttp import web

from s2s_daemon.config import HttpConfig
from s2s_daemon.errors import UnavailableError
from s2s_daemon.intake.admission import IntakeRules, admit
from s2s_daemon.intake.http.api import (
    MODEL_ALIASES,
    ApiError,
    SpeechPayload,
    invalid_request,
    parse_speech,
    speech_ask,
    unanswered,
    with_openai_names,
)
from s2s_daemon.intake.http.api_key import key_file_exposure, read_api_key
from s2s_daemon.intake.http.encoders import CONTENT_TYPES, AudioEncoder, WavEncoder, encoder_factory
from s2s_daemon.intake.http.guard import RequestGuard, json_body
from s2s_daemon.intake.http.limits import ConnectionGuard, Handler, ListenerLimits
from s2s_daemon.intake.http.live import LiveFeed
from s2s_daemon.intake.http.monitor import MonitorRoutes
from s2s_daemon.intake.http.web import ORIGIN, WebPage
from s2s_daemon.pipeline.jobs import Job, Ledger
from s2s_daemon.pipeline.messages import ErrorCode, Status
from s2s_daemon.pipeline.output import CallerStream
from s2s_daemon.pipeline.vocabulary import EngineInfo, Samples, model_name

log = structlog.get_logger(__name__)

CLOSE_TIMEOUT_S = 5.0
"""After the drain: longest wait for responses still being written before they are cancelled."""
FRAMES_PER_S = 12.5
"""Codec frames per second of audio: ``usage.output_tokens`` of the SSE ``speech.audio.done``."""
ENCODER_THREADS = 2
FIRST_SLICE_S = 0.08
"""Seconds of a response's first chunk that a costly encoder (mp3, opus) encodes and sends alone."""
OPEN_PATHS = frozenset({"/health", "/ready"})
"""Served without the bearer token (probes); ``/metrics`` needs it when there is one."""
LOADING_RETRY_S = 5
"""``Retry-After`` of the API's answers while the model loads."""


def _json_error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request, max_body_bytes: int) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no such endpoint: {request.method} {request.path}", code="not_found")
    if exc.status == 405:
        allow = exc.headers.get("Allow", "")
        return ApiError(
            405,
            f"{request.method} is not allowed on {request.path} (allowed: {allow})",
            code="method_not_allowed",
            headers={"Allow": allow},
        )
    if exc.status == 413:
        return ApiError(413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large")
    return ApiError(exc.status, exc.reason, code=None)


class ThreadedEncoder:
    """Runs a costly encoder on the server's threads, one call at a time; closes it only when idle."""

    def __init__(self, encoder: AudioEncoder, executor: concurrent.futures.Executor) -> None:
        self.encoder = encoder
        self._executor = executor
        self._pending: concurrent.futures.Future[bytes] | None = None

    async def _call(self, fn: Callable[..., bytes], *args: Any) -> bytes:
        if not self.encoder.blocking:
            return fn(*args)
        self._pending = self._executor.submit(fn, *args)
        return await asyncio.wrap_future(self._pending)

    async def encode(self, samples: Samples) -> bytes:
        return await self._call(self.encoder.encode, samples)

    async def finish(self) -> bytes:
        return await self._call(self.encoder.finish)

    def close(self) -> None:
        pending = self._pending
        if pending is not None and not pending.done():  # cancelled mid-call: close after it
            pending.add_done_callback(lambda _: self.encoder.close())
        else:
            self.encoder.close()


@dataclass(frozen=True, slots=True)
class _Attached:
    """What the API serves with, once the model is loaded."""

    ledger: Ledger
    rules: IntakeRules
    info: EngineInfo


class HttpSpeechServer:
    """``POST /v1/audio/speech``, ``GET /v1/models``, ``GET /v1/audio/voices``, the monitor's
    ``GET /health``, ``/ready``, ``/metrics``, and the web page (``web``), its live view fed by ``feed``.

    An ``Intake`` (``door.py``). The constructor does no I/O; ``start`` reads the key and listens
    (before the model loads), ``attach`` hands it the pipeline, ``run`` serves until ``close`` (the
    end of the daemon's drain, once the queue is answered: the probes answer through the drain).
    """

    name = "http"
    origins = frozenset({"http", ORIGIN})

    def __init__(self, config: HttpConfig, monitor: MonitorRoutes) -> None:
        self.config = config
        self.monitor = monitor
        self._attachment: _Attached | None = None
        self.feed: LiveFeed | None = None
        """The events the daemon publishes, for the web page's live view (from ``attach``)."""
        self.open_paths = set(OPEN_PATHS)
        """Served without the bearer token: ``OPEN_PATHS`` and the web page's own files."""
        self.port: int | None = None
        """The port listened on, once started."""
        self._api_key: str | None = None
        self.browsers = RequestGuard(config.host, config.allowed_hosts)
        """The Host allow-list and the same-origin rule, checked before the key."""
        self._runner: web.AppRunner | None = None
        self._closed = asyncio.Event()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._created = int(time.time())
        self.connections = ConnectionGuard(
            ListenerLimits(
                "http", config.max_connections, config.header_timeout_s, config.idle_timeout_s, config.body_timeout_s
            )
        )
        """The listener's connection cap and read deadlines."""

    # -- what it serves with -------------------------------------------------------------

    def attach(self, ledger: Ledger, rules: IntakeRules, info: EngineInfo, feed: LiveFeed | None) -> None:
        """The model is loaded: serve speech with this pipeline, the page's live view from ``feed``."""
        self._attachment = _Attached(ledger, rules, info)
        self.feed = feed

    def require_attached(self) -> None:
        """Raise the 503 ``model_loading`` answer while the model loads (before a stream starts)."""
        self._attached()

    def _attached(self) -> _Attached:
        if self._attachment is None:
            raise ApiError(
                503,
                "the model is loading; try again shortly (GET /ready says when it is ready)",
                kind="server_error",
                code="model_loading",
                headers={"Retry-After": str(LOADING_RETRY_S)},
            )
        return self._attachment

    @property
    def ledger(self) -> Ledger:
        return self._attached().ledger

    @property
    def rules(self) -> IntakeRules:
        return self._attached().rules

    @property
    def info(self) -> EngineInfo:
        return self._attached().info

    # -- lifecycle ---------------------------------------------------------------------

    def _read_api_key(self) -> str | None:
        path = self.config.api_key_file
        if path is None:
            return None
        key = read_api_key(path)
        if (readers := key_file_exposure(path)) is not None:
            log.warning("api_key_file_readable", path=str(path), by=readers, hint=f"chmod 600 {path}")
        return key

    def app(self) -> web.Application:
        middlewares = [self.connections.middleware(), self._middleware()]
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=middlewares)
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_get("/v1/audio/voices", self._voices)
        self.monitor.add_to(app)  # /health, /ready, /metrics
        self.open_paths |= WebPage(self, self.config.max_body_bytes).add_routes(app)
        return app

    async def start(self) -> None:
        cfg = self.config
        self._api_key = self._read_api_key()
        runner = web.AppRunner(
            self.app(),
            handle_signals=False,  # the daemon owns SIGTERM/SIGINT
            access_log=None,  # one structured event per speech response instead
            handler_cancellation=True,  # a client that goes away cancels its handler: synthesis stops
            shutdown_timeout=CLOSE_TIMEOUT_S,
            **self.connections.runner_options(),
        )
        await runner.setup()
        try:
            await self.connections.site(runner, cfg.host, cfg.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise UnavailableError(f"http: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from exc
        self._runner = runner
        self._executor = concurrent.futures.ThreadPoolExecutor(ENCODER_THREADS, thread_name_prefix="s2s.http.encode")
        self.port = int(runner.addresses[0][1])
        log.info("http_listening", host=cfg.host, port=self.port, auth=self._api_key is not None)
        if self._api_key is None and not _is_loopback(cfg.host):
            log.warning("http_without_api_key", host=cfg.host, hint="set http.api_key_file")

    async def run(self) -> None:
        """Serve until ``close`` (or until cancelled: then it closes)."""
        try:
            await self._closed.wait()
        finally:
            await self.close()

    def drain(self) -> None:
        """Nothing to stop: the ledger answers new speech ``shutting_down`` (503) and the probes say
        ``draining`` until ``close``."""

    async def close(self) -> None:
        """Stop listening, let responses being written finish (at most ``CLOSE_TIMEOUT_S``) and cancel the rest."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            log.info("http_closed")
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self._closed.set()

    @property
    def auth_required(self) -> bool:
        """Whether calls need the bearer token (``api_key_file`` is set)."""
        return self._api_key is not None

    # -- middleware: OpenAI's error JSON, the bearer token ------------------------------

    def _middleware(self) -> Any:
        max_body = self.config.max_body_bytes

        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                if request.path not in OPEN_PATHS:  # the probes answer any name (they tell nothing)
                    self.browsers.check(request)
                if request.path not in self.open_paths:
                    self._authorize(request)
                return await handler(request)
            except ApiError as exc:
                return _json_error(exc)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return _json_error(_from_http_exception(exc, request, max_body))

        return middleware

    def _authorize(self, request: web.Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401, "missing bearer token (Authorization: Bearer <key>)", code="invalid_api_key", headers=_BEARER
            )
        if not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers=_BEARER)

    # -- small endpoints ---------------------------------------------------------------

    def _model_object(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self._created, "owned_by": "s2s-daemon"}

    async def _models(self, request: web.Request) -> web.Response:
        name = model_name(self.info.model)  # a local checkpoint by its folder's name, not its path
        ids = [name, *(a for a in MODEL_ALIASES if a != name)]
        return web.json_response({"object": "list", "data": [self._model_object(i) for i in ids]})

    async def _model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model"]
        if model_id != model_name(self.info.model) and model_id not in MODEL_ALIASES:
            raise ApiError(404, f"model {model_id!r} does not exist", code="model_not_found", param="model")
        return web.json_response(self._model_object(model_id))

    async def _voices(self, request: web.Request) -> web.Response:
        policy = self.rules.voices
        named = [{"id": n, "name": n, "kind": str(k)} for n, k in policy.library_voices().items()]
        return web.json_response(
            {
                "voices": [{"id": v, "name": v} for v in self.info.voices] + named,
                "default": policy.default_voice(),  # None: a request must name its voice
                "languages": list(self.info.languages),
            }
        )

    # -- speech ------------------------------------------------------------------------

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        speech = parse_speech(await json_body(request))
        parsed = admit(speech_ask(speech, self.rules), self.rules, origin="http", received_at=received)
        if parsed.error is not None and parsed.error.code is ErrorCode.UNKNOWN_VOICE:
            parsed = dataclasses.replace(parsed, error=with_openai_names(parsed.error, self.rules))
        if parsed.error is not None:
            self.ledger.reject(parsed.request, parsed.error.code, parsed.error.message)
            raise invalid_request(parsed.error)
        stream = CallerStream(speed=speech.speed, whole=sent_whole(speech))
        job = self.ledger.submit(dataclasses.replace(parsed.request, output=stream))
        with structlog.contextvars.bound_contextvars(request_id=job.request.id):
            return await self._respond(request, speech, job, stream)

    async def _respond(
        self, request: web.Request, speech: SpeechPayload, job: Job, stream: CallerStream
    ) -> web.StreamResponse:
        if stream.whole:
            return await self._respond_whole(request, speech, job, stream)
        sse = speech.stream_format == "sse"
        response: web.StreamResponse | None = None
        encoder: ThreadedEncoder | None = None
        sent = 0

        async def begin() -> tuple[web.StreamResponse, ThreadedEncoder]:
            assert self._executor is not None
            rate = stream.sample_rate or self.info.sample_rate
            enc = ThreadedEncoder(encoder_factory(speech.response_format)(rate), self._executor)
            headers = {
                "Content-Type": "text/event-stream" if sse else CONTENT_TYPES[speech.response_format],
                "X-Request-Id": job.request.id,
                "Cache-Control": "no-cache",
            }
            resp = web.StreamResponse(status=200, headers=headers)
            await resp.prepare(request)
            return resp, enc

        async def send(data: bytes) -> None:
            nonlocal sent
            if not data:
                return
            sent += len(data)
            if sse:
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
                data = b"data: " + json.dumps(event).encode() + b"\n\n"
            assert response is not None
            await self.write_or_cut(request, response, data)

        try:
            async for chunk in stream.chunks(job.done):
                head = b""
                if response is None or encoder is None:
                    response, encoder = await begin()
                    head = encoder.encoder.header()
                    first = round((stream.sample_rate or self.info.sample_rate) * FIRST_SLICE_S)
                    if encoder.encoder.blocking and len(chunk) > first:
                        # mp3/opus cost ms per chunk: the first 80 ms go out before the rest is encoded
                        await send(head + await encoder.encode(chunk[:first]))
                        head, chunk = b"", chunk[first:]
                await send(head + await encoder.encode(chunk))
            await job.done.wait()  # the stream has ended: its request ends with it
            if response is None:
                if job.status is not Status.COMPLETED:
                    raise unanswered(job.status, job.error, self.ledger.accepting)
                response, encoder = await begin()  # completed without audio: an empty file
                await send(encoder.encoder.header())
            assert encoder is not None
            if job.status is not Status.COMPLETED:
                # Part of the audio went out with 200: SSE says so in its last event, raw audio
                # only by a broken body.
                self._log_failed(job, sent, "error event sent" if sse else "connection closed before the body's end")
                if not sse:
                    self._abort(request)
                    return response
            await send(await encoder.finish())
            if sse:
                await self.write_or_cut(request, response, self._final_event(job))
            await self.write_or_cut(request, response, None)
        except ConnectionResetError:
            pass  # a write found the client gone, or not reading: its request is stopped below
        finally:
            if not job.done.is_set():  # the client went away (cancelled handler or a failed write)
                log.info("http_client_gone", sent_bytes=sent)
                stream.abandon()
                self.ledger.cancel(job, Status.INTERRUPTED)
            if encoder is not None:
                encoder.close()
        log.info(
            "http_speech",
            status=str(job.status),
            format=speech.response_format,
            stream_format=speech.stream_format,
            sent_bytes=sent,
        )
        return response if response is not None else web.Response(status=499)

    async def _respond_whole(
        self, request: web.Request, speech: SpeechPayload, job: Job, stream: CallerStream
    ) -> web.StreamResponse:
        """A file sent once complete, with its length: FLAC (libsndfile cannot stream it), and WAV
        unless ``stream_format: audio`` asks for it streamed (a streamed WAV's header cannot know its
        length). A request that fails is an error answer, not a short file."""
        parts: list[Samples] = []
        try:
            async for chunk in stream.chunks(job.done):
                parts.append(chunk)
            await job.done.wait()
        finally:
            if not job.done.is_set():  # the client went away (its handler was cancelled)
                log.info("http_client_gone", sent_bytes=0)
                stream.abandon()
                self.ledger.cancel(job, Status.INTERRUPTED)
        if job.status is not Status.COMPLETED:  # what was made is not sent: the events say cancelled too
            made = (speech.response_format, job.timeline.audio_s)
            raise unanswered(job.status, job.error, self.ledger.accepting, made)
        samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        rate = stream.sample_rate or self.info.sample_rate
        if speech.response_format == "wav":
            wav = WavEncoder(rate, len(samples))
            body = wav.header() + wav.encode(samples)
        else:
            assert self._executor is not None
            encoder = encoder_factory(speech.response_format)(rate)
            body = await asyncio.get_running_loop().run_in_executor(self._executor, _encode_all, encoder, samples)
        log.info("http_speech", status=str(job.status), format=speech.response_format, stream_format="whole",
                 sent_bytes=len(body))  # fmt: skip
        headers = {
            "X-Request-Id": job.request.id,
            "Cache-Control": "no-cache",
            "Content-Type": CONTENT_TYPES[speech.response_format],
        }
        response = web.StreamResponse(headers=headers)
        response.content_length = len(body)
        await response.prepare(request)
        try:
            await self.write_or_cut(request, response, body)
            await self.write_or_cut(request, response, None)
        except ConnectionResetError:
            pass  # the request is answered; only the connection is gone
        return response

    async def write_or_cut(self, request: web.Request, response: web.StreamResponse, data: bytes | None) -> None:
        """Write ``data`` (None: the body's end); a client that takes none of it for
        ``http.write_timeout_s`` is cut (``ConnectionResetError``), so that a caller that never reads
        cannot hold a synthesis slot, and the requests behind it, for as long as it stays connected
        (nor a connection, for a page's event stream)."""
        try:
            async with asyncio.timeout(self.config.write_timeout_s):
                if data is None:
                    await response.write_eof()
                else:
                    await response.write(data)
        except TimeoutError:
            log.warning("http_client_not_reading", timeout_s=self.config.write_timeout_s, action="connection cut")
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client took none of its answer in time") from None

    @staticmethod
    def _log_failed(job: Job, sent: int, action: str) -> None:
        error = job.error
        log.warning(
            "http_stream_failed",
            status=str(job.status),
            code=str(error.code) if error is not None else str(job.status),
            error=error.message if error is not None else f"the speech ended {job.status}",
            sent_bytes=sent,
            action=action,
        )

    @staticmethod
    def _abort(request: web.Request) -> None:
        """End a streamed response whose request failed after its first bytes: close the connection
        without the terminating chunk (HTTP/1.1) or with a reset (no chunked framing to break), as
        servers do, so that the client reports an incomplete body instead of a short file (curl:
        exit 18; aiohttp: ``ClientPayloadError``; httpx: ``RemoteProtocolError``, which the openai
        SDK raises as ``APIConnectionError`` when it reads the body itself). The bytes already
        written still reach the client."""
        transport = request.transport
        if transport is None:  # the client is gone already
            return
        if request.version >= (1, 1):
            transport.close()  # what was written is flushed first; the last chunk never comes
        else:
            transport.abort()
        request.protocol.force_close()

    @staticmethod
    def _final_event(job: Job) -> bytes:
        if job.status is Status.COMPLETED:
            frames = round(job.timeline.audio_s * FRAMES_PER_S)
            chars = len(job.request.text)
            usage = {"input_tokens": chars, "output_tokens": frames, "total_tokens": chars + frames}
            event: dict[str, Any] = {"type": "speech.audio.done", "usage": usage}
        else:
            message = job.error.message if job.error is not None else f"the speech ended {job.status}"
            code = job.error.code.value if job.error is not None else str(job.status)
            event = {
                "type": "error",
                "error": {"message": message, "type": "server_error", "param": None, "code": code},
            }
        return b"data: " + json.dumps(event).encode() + b"\n\n"


_BEARER = {"WWW-Authenticate": "Bearer"}


def sent_whole(speech: SpeechPayload) -> bool:
    """Whether the answer is a file sent once complete, with its length: FLAC (libsndfile cannot
    stream it), and WAV unless ``stream_format`` asks for it streamed (a streamed WAV's header cannot
    know its length). Its first audio out is when it is complete (``CallerStream.whole``)."""
    if speech.stream_format == "sse":
        return False
    fmt = speech.response_format
    return fmt == "flac" or (fmt == "wav" and "stream_format" not in speech.model_fields_set)


def _encode_all(encoder: AudioEncoder, samples: Samples) -> bytes:
    try:
        return encoder.header() + encoder.encode(samples) + encoder.finish()
    finally:
        encoder.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
