"""``GET /health``, ``GET /ready`` and ``GET /metrics`` in aiohttp: routes the speech API's app adds,
and the monitor listener of their own (``monitor.enabled``) for a daemon without the API.

Both listeners start before the model loads (``events/readiness.py`` says why). Probes carry no
token: ``/health`` and ``/ready`` are open everywhere; ``/metrics`` is open on the monitor listener
and behind the speech API's bearer token on its port (when it has one).
"""

from __future__ import annotations

from typing import Any, Protocol

import structlog
from aiohttp import web

from s2s_daemon.config import MonitorConfig
from s2s_daemon.errors import UnavailableError
from s2s_daemon.intake.http.limits import ConnectionGuard, ListenerLimits

log = structlog.get_logger(__name__)

CLOSE_TIMEOUT_S = 2.0


class ReadinessSource(Protocol):
    """What the probes answer from (``events/readiness.py``'s ``Readiness``)."""

    def health(self) -> dict[str, Any]: ...

    def report(self) -> tuple[bool, dict[str, Any]]: ...


class MetricsSource(Protocol):
    """What ``/metrics`` answers from (``events/metrics.py``'s ``DaemonMetrics``)."""

    content_type: str

    def exposition(self) -> bytes: ...


class MonitorRoutes:
    """The three handlers, over the daemon's readiness and metrics."""

    def __init__(self, readiness: ReadinessSource, metrics: MetricsSource) -> None:
        self.readiness = readiness
        self.metrics = metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.exposition)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(self.readiness.health())

    async def ready(self, request: web.Request) -> web.Response:
        ready, body = self.readiness.report()
        return web.json_response(body, status=200 if ready else 503)

    async def exposition(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": self.metrics.content_type})


class MonitorServer:
    """The monitor listener. The constructor does no I/O; ``start`` listens (a taken port is exit 69)."""

    def __init__(self, config: MonitorConfig, routes: MonitorRoutes) -> None:
        self.config = config
        self.routes = routes
        self.port: int | None = None
        """The port listened on, once started."""
        self._runner: web.AppRunner | None = None
        self.connections = ConnectionGuard(
            ListenerLimits("monitor", config.max_connections, config.header_timeout_s, config.idle_timeout_s)
        )
        """The listener's connection cap and read deadlines."""

    async def start(self) -> None:
        cfg = self.config
        app = web.Application(middlewares=[self.connections.middleware()])
        self.routes.add_to(app)
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=CLOSE_TIMEOUT_S,
            **self.connections.runner_options(),
        )
        await runner.setup()
        try:
            await self.connections.site(runner, cfg.host, cfg.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise UnavailableError(
                f"monitor: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc} (set monitor.port)"
            ) from exc
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("monitor_listening", host=cfg.host, port=self.port, paths=["/health", "/ready", "/metrics"])

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
