"""systemd's sd_notify protocol (READY, STOPPING, WATCHDOG) over NOTIFY_SOCKET.

A no-op when the daemon is not started by systemd (no NOTIFY_SOCKET).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)


class SystemdNotifier:
    """Sends datagrams to ``$NOTIFY_SOCKET``; never raises."""

    def __init__(self, address: str | None, watchdog_usec: int | None) -> None:
        self.address = address
        self.watchdog_interval_s = watchdog_usec / 1e6 if watchdog_usec else None
        """The service manager's WatchdogSec; pings go at half of it."""
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        watchdog: int | None = None
        raw = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if raw and raw.isdigit() and (not pid or pid == str(os.getpid())):
            watchdog = int(raw)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _send(self, message: str) -> None:
        if self.address is None:
            return
        target = self.address
        if target.startswith("@"):
            target = "\0" + target[1:]
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message.encode(), target)
        except OSError as exc:
            log.warning("sd_notify_failed", message=message, error=str(exc))

    def ready(self, status: str = "ready") -> None:
        self._send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def stopping(self) -> None:
        self._send("STOPPING=1\nSTATUS=draining")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def status(self, text: str) -> None:
        self._send(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
