"""The add-on's entry point (PID 1): options in, the daemon running, Home Assistant told where it is.

1. ``/data/options.json`` (what the add-on's Configuration page saved) becomes ``S2S_`` environment
   variables for the daemon (``OPTION_ENV``); everything the add-on fixes is in
   ``/etc/s2s-daemon/config.yaml``. Values are passed JSON-quoted: the daemon reads ``S2S_`` values
   as YAML, where a voice named ``no`` or ``on`` would otherwise be a boolean.
2. ``s2s-daemon run`` starts as a child; SIGTERM and SIGINT are passed on to it (it finishes the
   utterance it is speaking, within the add-on's ``timeout``), and its exit status is ours.
3. Once the daemon answers a Wyoming ``describe`` (``health.py``), the add-on sends the Supervisor a
   ``wyoming`` discovery message, ``tcp://<this container's hostname>:<port>``: Home Assistant then
   offers the Wyoming integration on its own. Without ``SUPERVISOR_TOKEN`` (not under the
   Supervisor) this step is skipped and said so.

Its own settings, for tests and the stand-in run of scripts/addon_check.sh: ``ADDON_OPTIONS``
(the options file) and ``ADDON_SUPERVISOR_URL`` (default ``http://supervisor``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import health

OPTION_ENV = {
    "model": "S2S_TTS__MODEL",
    "voice": "S2S_TTS__VOICE",
    "language": "S2S_TTS__LANGUAGE",
    "quantization": "S2S_TTS__TORCH__QUANTIZATION",
}
"""Add-on option -> the daemon's environment override of the same setting."""

EXIT_CONFIG = 78
"""The daemon's exit status for an invalid configuration (here: an options file that cannot be read)."""
DISCOVERY_POLL_S = 2.0
"""Seconds between Wyoming describes while the daemon loads its model."""
DISCOVERY_TIMEOUT_S = 10.0
"""Longest wait for the Supervisor's answer to the discovery message."""


class OptionsError(Exception):
    """The options file is missing, not JSON, or holds a value of the wrong type."""


def log(event: str, **fields: object) -> None:
    """One line on stderr beside the daemon's own (the add-on's log page shows both)."""
    details = " ".join(f"{key}={value}" for key, value in fields.items())
    print(f"s2s-addon: {event}{' ' + details if details else ''}", file=sys.stderr, flush=True)


def read_options(path: Path) -> dict[str, Any]:
    try:
        options = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise OptionsError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise OptionsError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise OptionsError(f"{path}: the options must be a JSON object, not {type(options).__name__}")
    return options


def daemon_environment(options: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus the overrides the options ask for (an empty option keeps the daemon's default)."""
    env = dict(environ)
    for option, name in OPTION_ENV.items():
        value = options.get(option)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise OptionsError(f"option {option}: expected text, got {value!r}")
        env[name] = json.dumps(value)
    debug = options.get("debug_logging", False)
    if not isinstance(debug, bool):
        raise OptionsError(f"option debug_logging: expected true or false, got {debug!r}")
    env["S2S_LOG__LEVEL"] = "debug" if debug else "info"
    return env


def discovery_message(hostname: str, port: int) -> dict[str, Any]:
    """What the Supervisor's ``POST /discovery`` takes for Home Assistant's Wyoming integration."""
    return {"service": "wyoming", "config": {"uri": f"tcp://{hostname}:{port}"}}


def send_discovery(supervisor_url: str, token: str, message: Mapping[str, Any]) -> str:
    """POST the message; the Supervisor's answer (its uuid for the message). Raises ``OSError``."""
    request = urllib.request.Request(
        f"{supervisor_url.rstrip('/')}/discovery",
        data=json.dumps(message).encode("utf-8"),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=DISCOVERY_TIMEOUT_S) as response:
        answer: bytes = response.read(2000)
    return answer.decode("utf-8", "replace")


def announce(
    alive: Callable[[], bool],
    supervisor_url: str,
    token: str,
    check: Callable[[], tuple[bool, str]] = health.check,
    port: Callable[[], int] = health.wyoming_port,
    hostname: Callable[[], str] = socket.gethostname,
) -> bool:
    """Wait until the daemon answers a describe (while it is ``alive``), then send the discovery."""
    while alive():
        healthy, _seen = check()
        if healthy:
            break
        time.sleep(DISCOVERY_POLL_S)
    else:
        return False
    message = discovery_message(hostname(), port())
    try:
        answer = send_discovery(supervisor_url, token, message)
    except (OSError, urllib.error.URLError) as exc:
        log("discovery_failed", uri=message["config"]["uri"], reason=exc)
        return False
    log("discovery_sent", uri=message["config"]["uri"], answer=answer.strip())
    return True


def main() -> int:
    options_file = Path(os.environ.get("ADDON_OPTIONS", "/data/options.json"))
    try:
        env = daemon_environment(read_options(options_file), os.environ)
    except OptionsError as exc:
        log("options_invalid", reason=exc)
        return EXIT_CONFIG
    log("starting", **{name: env[name] for name in OPTION_ENV.values() if name in env})
    daemon = subprocess.Popen(["s2s-daemon", "run"], env=env)

    def pass_on(signum: int, _frame: FrameType | None) -> None:
        if daemon.poll() is None:
            daemon.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)

    token = os.environ.get("SUPERVISOR_TOKEN")
    if token:
        supervisor_url = os.environ.get("ADDON_SUPERVISOR_URL", "http://supervisor")
        threading.Thread(
            target=announce,
            args=(lambda: daemon.poll() is None, supervisor_url, token),
            name="s2s.addon_discovery",
            daemon=True,
        ).start()
    else:
        log("discovery_skipped", reason="no SUPERVISOR_TOKEN: not started by Home Assistant's Supervisor")
    code = daemon.wait()
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N


if __name__ == "__main__":
    sys.exit(main())
