#!/opt/s2s/venv/bin/python
"""The image's HEALTHCHECK: exit 0 when the daemon's ``GET /ready`` answers 200, else 1.

``/ready`` is served by the monitor listener (``monitor.enabled``) and by the speech API's port
(``http.enabled``); this asks the first of them that is on. The address comes from the daemon's
own configuration (``S2S_CONFIG`` and the ``S2S_`` variables), so a port moved with
``S2S_HTTP__PORT`` is still the one asked. The reason for a failure is printed: the container
runtime keeps it in the health log (``podman healthcheck run``, ``docker inspect``).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError

TIMEOUT_S = 5.0
"""Longest wait for the answer; the runtime's own --timeout is the outer bound."""


def probe_url() -> str:
    """``/ready`` on the monitor listener or the speech API, over loopback when it listens on every interface."""
    config_file = os.environ.get("S2S_CONFIG")
    config = load_config(Path(config_file) if config_file else None)
    if config.monitor.enabled:
        host, port = config.monitor.host, config.monitor.port
    elif config.http.enabled:
        host, port = config.http.host, config.http.port
    else:
        raise ConfigError("monitor.enabled and http.enabled are both false: no listener serves /ready")
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/ready"


def main() -> int:
    try:
        url = probe_url()
    except ConfigError as exc:
        print(f"s2s-healthcheck: {exc}")
        return 1
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            print(f"s2s-healthcheck: {url} {response.status}")
            return 0
    except urllib.error.HTTPError as exc:  # 503 while loading, warming up or draining
        print(f"s2s-healthcheck: {url} {exc.code} {exc.read(500).decode('utf-8', 'replace').strip()}")
    except (urllib.error.URLError, OSError) as exc:
        print(f"s2s-healthcheck: {url} {getattr(exc, 'reason', exc)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
