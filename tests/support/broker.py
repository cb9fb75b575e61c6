"""A real mosquitto on a free loopback port, started and stopped by tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from s2s_daemon.bench.ports import free_port
from tests.support.wait import until_blocking

__all__ = ["Mosquitto", "free_port", "listens", "wait_port"]


def listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(port: int, timeout_s: float = 10.0) -> None:
    until_blocking(lambda: listens(port), timeout_s, f"a listener on 127.0.0.1:{port}")


class Mosquitto:
    """``persistence=True`` keeps sessions and queued QoS 1 messages across ``restart()``."""

    def __init__(self, workdir: Path, persistence: bool = False, extra_conf: str = "") -> None:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(binary).exists():
            raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.host = "127.0.0.1"
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", "max_queued_messages 100000"]
        if os.geteuid() == 0:
            lines.append("user root")  # as root mosquitto would drop to a user who cannot write tmp_path
        if persistence:
            data = workdir / "mosquitto-data"
            data.mkdir(exist_ok=True)
            lines += ["persistence true", f"persistence_location {data}/", "autosave_interval 1"]
        else:
            lines.append("persistence false")
        if extra_conf:
            lines.append(extra_conf)
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        self.log = workdir / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.5) -> None:
        self.stop()
        time.sleep(down_s)  # the outage itself: clients see the broker gone for this long
        self.start()
