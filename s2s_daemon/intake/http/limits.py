"""What one HTTP listener lets a client hold: a cap on its connections, a deadline for a request's
head and for its body, and aiohttp's keep-alive for the idle time between requests.

Every connection is a file descriptor and a buffer: without a cap, a few hundred idle ones took
the process to its open-file limit, where the memory sampler failed and the daemon with it. Past
``max_connections`` a new connection is answered 503 ``too_many_connections`` and closed at
accept, before anything is read (its descriptor is free at once); a connection whose first request
head is not complete within ``header_timeout_s`` is closed; a request body not complete within
``body_timeout_s`` is answered 408 and the connection closed; between requests (and before the
first one), aiohttp's keep-alive closes a connection idle for ``idle_timeout_s``. Header lines and
fields are bounded by aiohttp (8 KiB each), bodies by ``client_max_size``.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from s2s_daemon.intake.http.api import ApiError

log = structlog.get_logger(__name__)

REFUSED_LOG_S = 1.0
"""Connections refused at the cap are logged at most this often (with how many since)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """One listener's bounds; ``section`` names its configuration (``http``, ``monitor``)."""

    section: str
    max_connections: int
    header_timeout_s: float
    """From the connection's start to its first request's complete head."""
    idle_timeout_s: float
    """aiohttp's keep-alive: a connection waiting for its next request this long is closed."""
    body_timeout_s: float | None = None
    """From a request's head to the end of its body; None: not watched (no endpoint reads one)."""


class ConnectionGuard:
    """Counts one listener's connections and keeps their deadlines. The constructor does no I/O."""

    def __init__(self, limits: ListenerLimits) -> None:
        self.limits = limits
        self._open: weakref.WeakSet[_Counted] = weakref.WeakSet()
        """Connections accepted and not yet closed (one that never started is forgotten with it)."""
        self._refused = 0
        self._refused_logged_at = -REFUSED_LOG_S
        refusal = ApiError(
            503,
            f"too many connections: this server takes {limits.max_connections} at once"
            f" ({limits.section}.max_connections)",
            kind="server_error",
            code="too_many_connections",
        )
        body = json.dumps(refusal.body()).encode()
        self._refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def runner_options(self) -> dict[str, Any]:
        """What ``web.AppRunner`` takes from these limits."""
        return {"keepalive_timeout": self.limits.idle_timeout_s}

    def site(self, runner: web.AppRunner, host: str, port: int) -> web.TCPSite:
        """A TCP site of ``runner`` whose connections this guard counts and watches."""
        return _GuardedSite(runner, host, port, self)

    def middleware(self) -> Any:
        """Marks a connection's request head as complete, and holds its body to ``body_timeout_s``."""
        body_timeout_s = self.limits.body_timeout_s
        section = self.limits.section

        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            transport = request.transport
            if transport is not None and isinstance(counted := transport.get_protocol(), _Counted):
                counted.heard()
            if body_timeout_s is None or request.content.is_eof():
                return await handler(request)
            reading = True

            def body_read() -> None:
                if reading:
                    scope.reschedule(None)  # the body is whole: the handler takes its time

            try:
                async with asyncio.timeout(body_timeout_s) as scope:
                    request.content.on_eof(body_read)
                    return await handler(request)
            except TimeoutError:
                if not scope.expired():
                    raise
                log.info("http_body_timeout", path=request.path, timeout_s=body_timeout_s)
                message = f"the request body did not arrive within {body_timeout_s:g} s ({section}.body_timeout_s)"
                response = web.json_response(ApiError(408, message, code="request_timeout").body(), status=408)
                response.force_close()
                return response
            finally:
                reading = False

        return guard

    # -- connections ---------------------------------------------------------------------

    def protocol(self, server: web.Server) -> asyncio.Protocol:
        """A new connection's protocol: aiohttp's handler, counted; past the cap, a refusal."""
        if len(self._open) >= self.limits.max_connections:
            self._log_refused()
            return _Refusal(self._refusal)
        handler = server()
        counted = _Counted(self, handler)
        self._open.add(counted)
        return counted

    def _log_refused(self) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= REFUSED_LOG_S:
            log.warning(
                "http_connection_refused",
                listener=self.limits.section,
                refused=self._refused,
                max_connections=self.limits.max_connections,
            )
            self._refused, self._refused_logged_at = 0, now

    def _closed(self, counted: _Counted) -> None:
        self._open.discard(counted)


class _Counted(asyncio.Protocol):
    """aiohttp's handler of one connection, behind a protocol that counts it while it is open and
    closes it when its first request head is late (every call passes through)."""

    def __init__(self, guard: ConnectionGuard, handler: RequestHandler) -> None:
        self._guard = guard
        self.handler = handler
        self._head_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        self._head_due = loop.call_later(self._guard.limits.header_timeout_s, self._head_late)
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        self.handler.eof_received()  # aiohttp's keeps the transport open: it answers, then closes
        return None

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.heard()
        self._guard._closed(self)
        self.handler.connection_lost(exc)

    def heard(self) -> None:
        """A request head came whole: no header deadline from now on (keep-alive's idle one holds)."""
        if self._head_due is not None:
            self._head_due.cancel()
            self._head_due = None

    def _head_late(self) -> None:
        self._head_due = None
        log.info(
            "http_header_timeout", listener=self._guard.limits.section, timeout_s=self._guard.limits.header_timeout_s
        )
        self.handler.force_close()


class _Refusal(asyncio.Protocol):
    """A connection past the cap: the 503 answer (written without waiting for the client), closed."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._answer)
        transport.close()

    def data_received(self, data: bytes) -> None:
        return None


class _GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose listener makes its connections' protocols through the guard."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner, host, port)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        guard = self._guard
        self._server = await asyncio.get_running_loop().create_server(
            lambda: guard.protocol(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
