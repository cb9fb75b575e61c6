"""The OpenAI-compatible speech API: ``POST /v1/audio/speech`` and friends, and the web page, served
by aiohttp in the daemon's event loop (``http.enabled``); and the monitor listener (``monitor.enabled``:
``/health``, ``/ready``, ``/metrics``), which the API's port serves too.

Their packages are the ``http`` extra. This module imports none of them, so that a missing extra
is a clear exit 69 before the model loads; ``server``, ``monitor`` and ``encoders`` import them.
Both listeners start before the model loads: probes answer while it loads.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from s2s_daemon.config import HttpConfig, MonitorConfig
from s2s_daemon.errors import UnavailableError

if TYPE_CHECKING:
    from s2s_daemon.intake.http.monitor import MetricsSource, MonitorServer, ReadinessSource
    from s2s_daemon.intake.http.server import HttpSpeechServer

EXTRA_MODULES = ("aiohttp", "soundfile", "lameenc", "soxr")
"""What the ``http`` extra installs (pyproject.toml)."""


def require_http_extra(config: HttpConfig) -> None:
    """Raise ``UnavailableError`` (exit 69) when the API is enabled but its packages are missing."""
    if not config.enabled:
        return
    missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise UnavailableError(
            f"http.enabled needs the http extra ({', '.join(missing)} not installed):"
            " pip install 's2s-daemon[http]' (in a checkout: pip install -e '.[http]')"
        )


def require_monitor_extra(config: MonitorConfig) -> None:
    """Raise ``UnavailableError`` (exit 69) when the monitor listener is enabled without aiohttp."""
    if config.enabled and importlib.util.find_spec("aiohttp") is None:
        raise UnavailableError(
            "monitor.enabled needs the http extra (aiohttp not installed):"
            " pip install 's2s-daemon[http]' (in a checkout: pip install -e '.[http]')"
        )


async def open_http_server(
    config: HttpConfig, readiness: ReadinessSource, metrics: MetricsSource
) -> HttpSpeechServer | None:
    """The started server (listening; its speech and its page's API answer 503 until ``attach``), or
    None when ``http.enabled`` is false."""
    if not config.enabled:
        return None
    require_http_extra(config)
    from s2s_daemon.intake.http.monitor import MonitorRoutes
    from s2s_daemon.intake.http.server import HttpSpeechServer

    server = HttpSpeechServer(config, MonitorRoutes(readiness, metrics))
    await server.start()
    return server


async def open_monitor_server(
    config: MonitorConfig, readiness: ReadinessSource, metrics: MetricsSource
) -> MonitorServer | None:
    """The started monitor listener, or None when ``monitor.enabled`` is false."""
    if not config.enabled:
        return None
    require_monitor_extra(config)
    from s2s_daemon.intake.http.monitor import MonitorRoutes, MonitorServer

    server = MonitorServer(config, MonitorRoutes(readiness, metrics))
    await server.start()
    return server
