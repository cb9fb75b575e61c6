"""Run the daemon in-process (stage/MQTT tests) or as a real subprocess (lifecycle tests)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import yaml

from s2s_daemon.app import Daemon
from s2s_daemon.config import DaemonConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TONE_OPTIONS = {"speed": "0"}
"""What ``write_config`` gives the tone engine; another engine's config goes without them."""


def write_config(path: Path, port: int, **sections: Any) -> Path:
    """A daemon config on ``port`` with the tone engine and the discard sink, merged with ``sections``."""
    data: dict[str, Any] = {
        "site_id": "kitchen",
        "mqtt": {"broker": "external", "port": port},
        "tts": {"engine": "tone", "options": dict(TONE_OPTIONS), "warmup": False},
        "audio": {"sink": "discard"},
        "log": {"format": "json", "level": "info"},
        "shutdown": {"drain_timeout_s": 5},
        # One journal per config file: parallel tests never share one, a restart finds its own.
        "journal": {"path": str(path.with_suffix(".journal.sqlite3"))},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            merged = dict(data[key])
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            data[key] = merged
        else:
            data[key] = value
    if data["tts"].get("engine") != "tone":  # the tone engine's options are no other engine's
        options = {k: v for k, v in data["tts"].get("options", {}).items() if k not in TONE_OPTIONS}
        data["tts"] = {**data["tts"], "options": options}
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.asynccontextmanager
async def daemon_in_process(config_path: Path) -> AsyncIterator[Daemon]:
    config: DaemonConfig = load_config(config_path, environ={})
    daemon = Daemon(config)
    task = asyncio.create_task(daemon.run(), name="test.daemon")
    try:
        yield daemon
    finally:
        daemon.request_stop()
        code = await asyncio.wait_for(task, 30)
        assert code == 0


class DaemonProcess:
    def __init__(
        self,
        config_path: Path,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        preexec_fn: Callable[[], object] | None = None,
    ) -> None:
        self.config_path = config_path
        self.preexec_fn = preexec_fn
        """Run in the child before the daemon starts (``resource.setrlimit``: a smaller open-file limit)."""
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.log_path = log_path or config_path.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *args: str) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.tone_daemon", *(args or ("run", "-c", str(self.config_path)))],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=self.preexec_fn,
            )

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        proc = self.proc
        return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
