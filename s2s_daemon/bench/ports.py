"""Loopback ports for a daemon a benchmark (or a test) starts: its MQTT, HTTP and other listeners."""

from __future__ import annotations

import socket

_GIVEN: set[int] = set()
"""Ports ``free_port`` has handed out in this process: a daemon that takes several for one
configuration (MQTT, HTTP, Wyoming, monitor) gets distinct ones, though none is held open."""


def free_port() -> int:
    """A free loopback port, never one this process was given before (the kernel may hand out a
    port it just handed out, once its socket is closed: two listeners of one daemon then collide)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
