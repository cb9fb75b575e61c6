"""The container image's own files (container/): its configuration, its health check, its build context.

Building and running the image is scripts/container_check.sh (podman, minutes); these hold the
files to the daemon's configuration loader and to HTTP as the health check speaks it.
"""

from __future__ import annotations

import http.server
import importlib.util
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

from s2s_daemon.config import DaemonConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONTAINER = ROOT / "container"
IMAGE_CONFIG = CONTAINER / "s2s-daemon.yaml"


@pytest.fixture
def healthcheck(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """container/healthcheck.py (the image's s2s-healthcheck), reading the image's configuration."""
    for name in [n for n in __import__("os").environ if n.startswith("S2S_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("S2S_CONFIG", str(IMAGE_CONFIG))
    spec = importlib.util.spec_from_file_location("s2s_healthcheck", CONTAINER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Daemon(http.server.BaseHTTPRequestHandler):
    """Answers ``/ready`` with ``status`` (and counts the requests), anything else 404."""

    status: ClassVar[int] = 200
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        code = self.status if self.path == "/ready" else 404
        body = b'{"ready": true}' if code == 200 else b'{"ready": false, "waiting_for": ["model"]}'
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no line per request on stderr
        pass


@pytest.fixture
def daemon() -> Iterator[int]:
    _Daemon.asked = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Daemon)
    thread = threading.Thread(target=server.serve_forever, name="test.ready", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_image_configuration_opens_the_doors_and_keeps_state_in_the_volume() -> None:
    config = load_config(IMAGE_CONFIG, {})
    assert (config.http.enabled, config.http.host, config.http.port) == (True, "0.0.0.0", 5050)
    assert (config.wyoming.enabled, config.wyoming.host, config.wyoming.port) == (True, "0.0.0.0", 10200)
    assert config.wyoming.zeroconf is False
    assert config.tts.voices_dir == Path("/data/voices")


@pytest.mark.parametrize(("status", "code"), [(200, 0), (503, 1)])
def test_the_health_check_is_ready_on_200_only(
    healthcheck: ModuleType,
    daemon: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: int,
    code: int,
) -> None:
    monkeypatch.setattr(_Daemon, "status", status)
    monkeypatch.setenv("S2S_HTTP__PORT", str(daemon))  # the port as the daemon reads it
    assert healthcheck.main() == code
    assert _Daemon.asked == ["/ready"]
    out = capsys.readouterr().out
    assert f"http://127.0.0.1:{daemon}/ready {status}" in out
    if status != 200:
        assert '"waiting_for": ["model"]' in out  # the daemon's reason, for the health log


def test_the_health_check_fails_when_nothing_listens(
    healthcheck: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with http.server.HTTPServer(("127.0.0.1", 0), _Daemon) as closed:
        port = closed.server_address[1]
    monkeypatch.setenv("S2S_HTTP__PORT", str(port))
    assert healthcheck.main() == 1
    assert "Connection refused" in capsys.readouterr().out


def test_the_health_check_says_when_no_listener_serves_ready(
    healthcheck: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("S2S_HTTP__ENABLED", "false")
    assert healthcheck.main() == 1
    assert "no listener serves /ready" in capsys.readouterr().out


@pytest.mark.skipif("monitor" not in DaemonConfig.model_fields, reason="this daemon has no monitor listener")
def test_the_health_check_prefers_the_monitor_listener(
    healthcheck: ModuleType, daemon: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("S2S_MONITOR__ENABLED", "true")
    monkeypatch.setenv("S2S_MONITOR__PORT", str(daemon))
    monkeypatch.setenv("S2S_HTTP__PORT", "9")  # the speech API's port is not the one asked
    assert healthcheck.main() == 0
    assert _Daemon.asked == ["/ready"]


def test_the_build_context_lets_through_what_the_containerfile_copies() -> None:
    """.dockerignore keeps .venv and .git out of the context by naming only what is copied."""
    sources = [
        part
        for line in (CONTAINER / "Containerfile").read_text(encoding="utf-8").splitlines()
        if line.startswith("COPY ")
        for part in line.split()[1:-1]
        if not part.startswith("--")
    ]
    allowed = {
        line[1:] for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines() if line[:1] == "!"
    }
    assert sources
    for source in sources:
        assert any(source == entry or source.startswith(f"{entry}/") for entry in allowed), source
        assert (ROOT / source).exists(), source


def test_the_images_torch_is_the_one_the_project_is_tested_with() -> None:
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "scripts" / "test").read_text(encoding="utf-8"))
    assert pinned is not None
    containerfile = (CONTAINER / "Containerfile").read_text(encoding="utf-8")
    assert f"ARG TORCH_VERSION={pinned.group(1)}\n" in containerfile
    build = (ROOT / "homeassistant" / "s2s_daemon" / "build.yaml").read_text(encoding="utf-8")
    assert f"torch=={pinned.group(1)}+cpu" in build


def test_the_container_checks_settings_are_not_configuration_keys() -> None:
    """CI may export S2S_CONTAINER_* for scripts/container_check.sh; daemons it also starts must not
    take them for an unknown ``container`` section (exit 78)."""
    config = load_config(
        None, {"S2S_CONTAINER_BASE": "docker.io/library/debian:bookworm-slim", "S2S_CONTAINER_KEEP": "1"}
    )
    assert config == load_config(None, {})
