"""The add-on's HEALTHCHECK: a Wyoming ``describe`` on this container's Wyoming port.

Exit 0 when the answer is an ``info`` with an installed TTS program (the daemon opens its Wyoming
port once the model is loaded, so this also says the model is there), else 1 with the reason on
standard output (kept in the container's health log). ``run.py`` waits on the same check before
it announces the add-on to Home Assistant.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError

TIMEOUT_S = 10.0
"""Longest wait for the connection and for the answer."""


def wyoming_port() -> int:
    """The port the daemon listens on: its configuration file and S2S_ variables, as it reads them."""
    config_file = os.environ.get("S2S_CONFIG")
    return load_config(Path(config_file) if config_file else None).wyoming.port


async def describe(host: str, port: int, timeout_s: float = TIMEOUT_S) -> str:
    """The TTS program's name and voice count; raises ``LookupError`` when the answer has none."""
    async with asyncio.timeout(timeout_s), AsyncTcpClient(host, port) as client:
        await client.write_event(Describe().event())
        while (event := await client.read_event()) is not None:
            if Info.is_type(event.type):
                info = Info.from_event(event)
                programs = [program for program in info.tts if program.installed]
                if not programs:
                    raise LookupError("the info names no installed TTS program")
                return f"{programs[0].name} ({len(programs[0].voices)} voices)"
    raise LookupError("the connection closed before an info")


def check(host: str = "127.0.0.1", port: int | None = None) -> tuple[bool, str]:
    """(healthy, what was seen) for the daemon on ``host``:``port`` (default: its configured port)."""
    try:
        port = wyoming_port() if port is None else port
        return True, f"tcp://{host}:{port} describe: {asyncio.run(describe(host, port))}"
    except (OSError, TimeoutError, LookupError, ConfigError) as exc:
        return False, f"tcp://{host}:{port} describe: {type(exc).__name__}: {exc}"


def main() -> int:
    healthy, seen = check()
    print(seen)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
