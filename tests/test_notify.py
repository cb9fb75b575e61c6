"""systemd's sd_notify protocol: the client alone, then the real daemon as a subprocess."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from s2s_daemon.errors import EXIT_OK
from s2s_daemon.notify import SystemdNotifier
from tests.support.wait import until_blocking

REPO = Path(__file__).resolve().parent.parent
WATCHDOG_USEC = 400_000
"""Watchdog interval given to the daemon: pings are due every 0.2 s."""


@dataclass(frozen=True, slots=True)
class Datagram:
    """One notification as received."""

    at_s: float
    """time.monotonic() on receipt, seconds."""
    fields: dict[str, str]


def parse(payload: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in payload.decode().split("\n") if line)


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket the test owns, at a short path (AF_UNIX paths are limited to ~107 bytes)."""
    folder = tempfile.mkdtemp(prefix="s2s-notify-", dir="/tmp")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield sock, path
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(folder)


def receive(sock: socket.socket, timeout_s: float) -> Datagram | None:
    sock.settimeout(timeout_s)
    try:
        payload = sock.recv(4096)
    except TimeoutError:
        return None
    return Datagram(time.monotonic(), parse(payload))


# --- the client ------------------------------------------------------------------------------


def test_messages_reach_the_socket(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    assert notifier.enabled
    assert notifier.watchdog_interval_s == pytest.approx(0.4)
    notifier.ready("loaded")
    notifier.watchdog()
    notifier.status("busy")
    notifier.stopping()
    notifier.close()
    got = [receive(sock, 2.0) for _ in range(4)]
    assert [g.fields if g else None for g in got] == [
        {"READY": "1", "STATUS": "loaded", "MAINPID": str(os.getpid())},
        {"WATCHDOG": "1"},
        {"STATUS": "busy"},
        {"STOPPING": "1", "STATUS": "draining"},
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
def test_abstract_socket_address() -> None:
    name = f"s2s-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": "@" + name})
        notifier.watchdog()
        got = receive(sock, 2.0)
        assert got is not None
        assert got.fields == {"WATCHDOG": "1"}
        notifier.close()
    finally:
        sock.close()


def test_without_systemd_everything_is_a_no_op() -> None:
    notifier = SystemdNotifier.from_env({})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    notifier.ready()
    notifier.watchdog()
    notifier.stopping()
    notifier.close()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": ""}, None),
    ],
)
def test_watchdog_interval_from_env(environ: dict[str, str], expected: float | None) -> None:
    assert SystemdNotifier.from_env({"NOTIFY_SOCKET": "/nonexistent", **environ}).watchdog_interval_s == expected


def test_a_vanished_socket_never_raises(tmp_path: Path) -> None:
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    notifier.ready()
    notifier.watchdog()
    notifier.close()


# --- the daemon, for real --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[str]:
    """The ``mqtt:`` section: a real mosquitto on a free loopback port, else the embedded broker."""
    port = free_port()
    if shutil.which("mosquitto") is None:
        yield f"{{broker: embedded, port: {port}}}"
        return
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n", encoding="utf-8")
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"mosquitto exited {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    try:
        until_blocking(listening, 10, "mosquitto listening")
        yield f"{{broker: external, host: 127.0.0.1, port: {port}}}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def wait_for(
    sock: socket.socket,
    seen: list[Datagram],
    done: Callable[[Datagram], bool],
    timeout_s: float,
    proc: subprocess.Popen[bytes],
    log: Path,
) -> Datagram:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        got = receive(sock, min(left, 0.5))
        if got is not None:
            seen.append(got)
            if done(got):
                return got
        elif proc.poll() is not None:
            pytest.fail(f"daemon exited with {proc.returncode} before the notification:\n{log.read_text()[-4000:]}")
    pytest.fail(f"no such notification within {timeout_s} s; got {[d.fields for d in seen]}\n{log.read_text()[-4000:]}")


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_daemon_sends_ready_watchdog_stopping_in_order(
    notify_socket: tuple[socket.socket, str], broker: str, tmp_path: Path
) -> None:
    sock, path = notify_socket
    load_s = 1.0
    config = tmp_path / "config.yaml"
    config.write_text(
        "site_id: notifytest\n"
        f"mqtt: {broker}\n"
        f'tts: {{engine: tone, model: tone, options: {{speed: "0", load_s: "{load_s}"}}}}\n'
        "audio: {sink: discard}\n"
        "log: {format: json, level: info}\n"
        "shutdown: {drain_timeout_s: 2}\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("S2S_", "WATCHDOG_", "NOTIFY_"))}
    env.update(NOTIFY_SOCKET=path, WATCHDOG_USEC=str(WATCHDOG_USEC), PYTHONUNBUFFERED="1")
    log = tmp_path / "daemon.log"
    seen: list[Datagram] = []
    with log.open("wb") as sink:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.tone_daemon", "run", "-c", str(config)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        try:
            ready = wait_for(sock, seen, lambda d: d.fields.get("READY") == "1", 90, proc, log)
            assert ready.fields.get("MAINPID") == str(proc.pid)
            assert ready.at_s - started >= load_s, "READY=1 must wait for the model to load"
            assert not any("WATCHDOG" in d.fields for d in seen), "WATCHDOG=1 before READY=1"

            # Watch the pings for a while: they must keep coming at about half the interval.
            window_end = time.monotonic() + 1.6
            while (left := window_end - time.monotonic()) > 0:
                got = receive(sock, left)
                if got is not None:
                    seen.append(got)
            assert proc.poll() is None, log.read_text()[-4000:]
            pings = [d.at_s for d in seen if d.fields.get("WATCHDOG") == "1"]
            assert len(pings) >= 4, f"only {len(pings)} WATCHDOG=1 in 1.6 s"
            gaps = [b - a for a, b in itertools.pairwise(pings)]
            half = WATCHDOG_USEC / 2e6
            assert 0.5 * half <= statistics.median(gaps) <= 1.5 * half, gaps
            assert not any("STOPPING" in d.fields for d in seen), "STOPPING=1 before SIGTERM"

            proc.send_signal(signal.SIGTERM)
            wait_for(sock, seen, lambda d: d.fields.get("STOPPING") == "1", 20, proc, log)
            assert proc.wait(timeout=30) == EXIT_OK, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    kinds = [next(k for k in ("READY", "WATCHDOG", "STOPPING", "STATUS") if k in d.fields) for d in seen]
    first_ready, first_ping, stopping = kinds.index("READY"), kinds.index("WATCHDOG"), kinds.index("STOPPING")
    assert first_ready < first_ping < stopping, kinds
    assert kinds.count("READY") == 1, kinds
