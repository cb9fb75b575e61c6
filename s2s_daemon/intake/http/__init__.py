"""The OpenAI-compatible speech API: ``POST /v1/audio/speech`` and friends, and the web page, served
by aiohttp in the daemon's event loop (``http.enabled``).

Its packages are the ``http`` extra. This module imports none of them, so that a missing extra
is a clear exit 69 before the model loads; ``server`` and ``encoders`` import them.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from s2s_daemon.config import HttpConfig
from s2s_daemon.errors import UnavailableError

if TYPE_CHECKING:
    from s2s_daemon.intake.http.live import LiveFeed
    from s2s_daemon.intake.http.server import HttpSpeechServer
    from s2s_daemon.intake.schemas import IntakeRules
    from s2s_daemon.pipeline.jobs import Dispatcher
    from s2s_daemon.pipeline.vocabulary import EngineInfo

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


async def open_http_server(
    config: HttpConfig, dispatcher: Dispatcher, rules: IntakeRules, info: EngineInfo, feed: LiveFeed | None = None
) -> HttpSpeechServer | None:
    """The started server (listening), or None when ``http.enabled`` is false; ``feed`` gives the web
    page's live view the events the daemon publishes."""
    if not config.enabled:
        return None
    require_http_extra(config)
    from s2s_daemon.intake.http.server import HttpSpeechServer

    server = HttpSpeechServer(config, dispatcher, rules, info, feed)
    await server.start()
    return server
