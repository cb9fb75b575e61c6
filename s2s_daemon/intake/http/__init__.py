"""The OpenAI-compatible speech API: ``POST /v1/audio/speech`` and friends, and the web page, served
by aiohttp in the daemon's event loop (``http.enabled``); and the monitor listener (``monitor.enabled``:
``/health``, ``/ready``, ``/metrics``), which the API's port serves too.

Their packages are the ``http`` extra. This module imports none of them, so that a missing extra
is a clear exit 69 before the model loads; ``server``, ``monitor`` and ``encoders`` import them.
Both listeners start before the model loads: probes answer while it loads.
"""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from s2s_daemon.config import HttpConfig, MonitorConfig
from s2s_daemon.errors import ConfigError, UnavailableError

if TYPE_CHECKING:
    from s2s_daemon.intake.http.monitor import MetricsSource, MonitorServer, ReadinessSource
    from s2s_daemon.intake.http.server import HttpSpeechServer

EXTRA_MODULES = ("aiohttp", "soundfile", "lameenc", "soxr")
"""What the ``http`` extra installs (pyproject.toml)."""
MIN_API_KEY_CHARS = 16
"""A shorter bearer token is refused: a few characters are guessed in minutes over loopback."""


def read_api_key(path: Path) -> str:
    """The bearer token in ``path`` (``http.api_key_file``); ConfigError (exit 78) naming the key
    when it cannot be read, is empty or is shorter than ``MIN_API_KEY_CHARS``."""
    try:
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"http.api_key_file: cannot read {path}: {why}") from exc
    if not key:
        raise ConfigError(f"http.api_key_file: {path} is empty")
    if len(key) < MIN_API_KEY_CHARS:
        raise ConfigError(
            f"http.api_key_file: the key in {path} is {len(key)} characters; use at least {MIN_API_KEY_CHARS}"
            " (openssl rand -hex 16 makes one)"
        )
    return key


def key_file_exposure(path: Path) -> str | None:
    """Who else may read the key file (``group``, ``others``), as its mode says; None when only its owner."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    readers = [who for who, bit in (("group", stat.S_IRGRP), ("others", stat.S_IROTH)) if mode & bit]
    return " and ".join(readers) or None


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
