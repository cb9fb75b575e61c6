"""The Home Assistant add-on (homeassistant/s2s_daemon): options to settings, discovery, health.

What the add-on does inside its container is tried by scripts/addon_check.sh (podman); these tests
hold its parts to the daemon's own configuration and to the protocols it speaks: the options
become settings the daemon's loader accepts, the discovery message reaches an HTTP server as the
Supervisor's API takes it, and the health check reads a Wyoming ``info`` through the wyoming
library's framing.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib
import json
import re
import threading
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from wyoming.event import async_read_event, async_write_event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice

from s2s_daemon.config import load_config
from s2s_daemon.pipeline.vocabulary import LANGUAGE_ALIASES
from s2s_daemon.tts.torch_qwen3.options import TorchSection

ROOT = Path(__file__).resolve().parents[1]
ADDON = ROOT / "homeassistant" / "s2s_daemon"
SCRIPTS = ADDON / "rootfs" / "opt" / "s2s-addon"
ADDON_CONFIG = ADDON / "rootfs" / "etc" / "s2s-daemon" / "config.yaml"


@pytest.fixture
def addon(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, ModuleType]]:
    """The add-on's ``run`` and ``health`` modules, imported as the image runs them (side by side)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    for name in ("run", "health"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    yield importlib.import_module("run"), importlib.import_module("health")


def manifest() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ADDON / "config.yaml").read_text(encoding="utf-8"))
    return data


def settings(env: dict[str, str]) -> Any:
    """The daemon's configuration inside the add-on: its config file plus the S2S_ variables."""
    return load_config(ADDON_CONFIG, {k: v for k, v in env.items() if k.startswith("S2S_")})


def test_the_default_options_become_the_daemons_settings(addon: tuple[ModuleType, ModuleType]) -> None:
    run, _ = addon
    config = settings(run.daemon_environment(manifest()["options"], {}))
    assert config.tts.model == "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
    assert config.tts.voice == "auto" and config.tts.named_voice is None  # the model's own
    assert config.tts.language == "auto"
    assert config.tts.torch.quantization == "auto"
    assert config.log.level == "info"
    # What the add-on fixes: Wyoming for Home Assistant, announced by the Supervisor, no speaker.
    assert (config.wyoming.enabled, config.wyoming.host, config.wyoming.port) == (True, "0.0.0.0", 10200)
    assert config.wyoming.zeroconf is False
    assert config.audio.sink == "discard"
    assert config.tts.voices_dir == Path("/share/s2s_daemon/voices")


def test_each_option_reaches_its_setting(addon: tuple[ModuleType, ModuleType]) -> None:
    run, _ = addon
    options = {
        "model": "/share/s2s_daemon/models/mine",
        "voice": "Vivian",
        "language": "german",
        "quantization": "int4",
        "debug_logging": True,
    }
    config = settings(run.daemon_environment(options, {"PATH": "/usr/bin"}))
    assert config.tts.model == "/share/s2s_daemon/models/mine"
    assert config.tts.voice == "Vivian"
    assert config.tts.language == "german"
    assert config.tts.torch.quantization == "int4"
    assert config.log.level == "debug"


@pytest.mark.parametrize("voice", ["no", "on", "Yes", "1.0", "null", "~", "[a]"])
def test_a_voice_name_that_yaml_would_read_as_something_else_stays_text(
    addon: tuple[ModuleType, ModuleType], voice: str
) -> None:
    """The daemon parses S2S_ values as YAML (``no`` is false there); the add-on quotes them."""
    run, _ = addon
    options = {**manifest()["options"], "voice": voice}
    assert settings(run.daemon_environment(options, {})).tts.voice == voice


def test_an_empty_option_keeps_the_daemons_default(addon: tuple[ModuleType, ModuleType]) -> None:
    run, _ = addon
    env = run.daemon_environment({"voice": "", "model": None}, {"S2S_TTS__VOICE": "ignored-before"})
    assert env["S2S_TTS__VOICE"] == "ignored-before"  # left as the environment had it
    assert "S2S_TTS__MODEL" not in env


@pytest.mark.parametrize(
    ("options", "message"),
    [({"voice": 3}, "option voice: expected text"), ({"debug_logging": "yes"}, "option debug_logging")],
)
def test_an_option_of_the_wrong_type_is_refused(
    addon: tuple[ModuleType, ModuleType], options: dict[str, Any], message: str
) -> None:
    run, _ = addon
    with pytest.raises(run.OptionsError, match=message):
        run.daemon_environment(options, {})


@pytest.mark.parametrize(
    ("content", "message"), [(None, "cannot read"), ("{not json", "is not JSON"), ("[1, 2]", "must be a JSON object")]
)
def test_an_unreadable_options_file_is_exit_78_before_the_daemon_starts(
    addon: tuple[ModuleType, ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    message: str,
) -> None:
    run, _ = addon
    options = tmp_path / "options.json"
    if content is not None:
        options.write_text(content, encoding="utf-8")
    monkeypatch.setenv("ADDON_OPTIONS", str(options))
    started: list[object] = []
    monkeypatch.setattr(run.subprocess, "Popen", lambda *a, **k: started.append(a))
    assert run.main() == 78
    assert started == []
    assert message in capsys.readouterr().err


def test_the_schema_offers_what_the_daemon_accepts(addon: tuple[ModuleType, ModuleType]) -> None:
    """Every option has a schema entry and a run.py translation, and each choice is a valid value."""
    run, _ = addon
    data = manifest()
    assert set(data["options"]) == set(data["schema"]) == {*run.OPTION_ENV, "debug_logging"}

    def choices(entry: str) -> list[str]:
        found = re.fullmatch(r"list\((.+)\)", entry)
        assert found, entry
        return found.group(1).split("|")

    assert sorted(choices(data["schema"]["quantization"])) == sorted(
        typing.get_args(TorchSection.model_fields["quantization"].annotation)
    )
    assert set(choices(data["schema"]["language"])) == set(LANGUAGE_ALIASES.values())
    for option in ("language", "quantization"):
        assert data["options"][option] in choices(data["schema"][option])


def test_the_addon_ships_the_projects_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert str(manifest()["version"]) == version
    build = yaml.safe_load((ADDON / "build.yaml").read_text(encoding="utf-8"))
    assert build["args"]["S2S_DAEMON_SPEC"].endswith(f"=={version}")
    assert "wyoming" in manifest()["discovery"]


class _Supervisor(http.server.BaseHTTPRequestHandler):
    """Records what is POSTed; answers as the Supervisor's API does."""

    seen: typing.ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, "authorization": self.headers["Authorization"], "body": body})
        answer = json.dumps({"result": "ok", "data": {"uuid": "ab" * 16}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no line per request on stderr
        pass


@pytest.fixture
def supervisor() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    _Supervisor.seen = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Supervisor)
    thread = threading.Thread(target=server.serve_forever, name="test.supervisor", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Supervisor.seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_discovery_waits_for_wyoming_then_tells_the_supervisor(
    addon: tuple[ModuleType, ModuleType],
    supervisor: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, _ = addon
    url, seen = supervisor
    monkeypatch.setattr(run, "DISCOVERY_POLL_S", 0.01)
    answers = iter([(False, "refused"), (False, "refused"), (True, "s2s default")])
    checks: list[int] = []

    def check() -> tuple[bool, str]:
        checks.append(len(seen))  # no message before the daemon answered
        return next(answers)

    sent = run.announce(lambda: True, url, "token-1", check=check, port=lambda: 10200, hostname=lambda: "s2s-addon")
    assert sent is True
    assert checks == [0, 0, 0]
    assert seen == [
        {
            "path": "/discovery",
            "authorization": "Bearer token-1",
            "body": {"service": "wyoming", "config": {"uri": "tcp://s2s-addon:10200"}},
        }
    ]


def test_no_discovery_when_the_daemon_ends_before_it_answers(
    addon: tuple[ModuleType, ModuleType],
    supervisor: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, _ = addon
    url, seen = supervisor
    monkeypatch.setattr(run, "DISCOVERY_POLL_S", 0.01)
    alive = iter([True, True, False])
    sent = run.announce(lambda: next(alive), url, "t", check=lambda: (False, "refused"), port=lambda: 1, hostname=str)
    assert sent is False
    assert seen == []


def test_a_supervisor_that_cannot_be_reached_is_logged_not_raised(
    addon: tuple[ModuleType, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = addon
    with http.server.HTTPServer(("127.0.0.1", 0), _Supervisor) as closed:
        url = f"http://127.0.0.1:{closed.server_address[1]}"  # nothing listens once the with ends
    sent = run.announce(lambda: True, url, "t", check=lambda: (True, ""), port=lambda: 10200, hostname=lambda: "h")
    assert sent is False
    assert "discovery_failed uri=tcp://h:10200" in capsys.readouterr().err


async def _wyoming_server(info: Info | None) -> asyncio.Server:
    """A Wyoming peer (the wyoming library's framing) that answers a describe with ``info``
    (None: closes the connection instead)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        event = await async_read_event(reader)
        if event is not None and Describe.is_type(event.type) and info is not None:
            await async_write_event(info.event(), writer)
        writer.close()
        await writer.wait_closed()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def _info(installed: bool) -> Info:
    attribution = Attribution(name="test", url="https://example.invalid")
    voice = TtsVoice(
        name="Ryan", description="Ryan", attribution=attribution, installed=True, languages=["en"], version=None
    )
    program = TtsProgram(
        name="s2s default",
        description="test",
        attribution=attribution,
        installed=installed,
        voices=[voice],
        version=None,
    )
    return Info(tts=[program])


@pytest.mark.parametrize(
    ("info", "healthy", "seen"),
    [
        (_info(installed=True), True, "describe: s2s default (1 voices)"),
        (_info(installed=False), False, "no installed TTS program"),
        (Info(), False, "no installed TTS program"),
        (None, False, "closed before an info"),
    ],
)
async def test_the_health_check_is_a_wyoming_describe(
    addon: tuple[ModuleType, ModuleType], info: Info | None, healthy: bool, seen: str
) -> None:
    _, health = addon
    server = await _wyoming_server(info)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await asyncio.to_thread(health.check, "127.0.0.1", port)
    assert result[0] is healthy
    assert seen in result[1]


def test_the_health_check_fails_when_nothing_listens(addon: tuple[ModuleType, ModuleType]) -> None:
    _, health = addon
    with http.server.HTTPServer(("127.0.0.1", 0), _Supervisor) as closed:
        port = closed.server_address[1]
    healthy, seen = health.check("127.0.0.1", port)
    assert healthy is False
    assert "ConnectionRefusedError" in seen


def test_the_health_check_asks_the_port_the_daemon_listens_on(
    addon: tuple[ModuleType, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, health = addon
    monkeypatch.setenv("S2S_CONFIG", str(ADDON_CONFIG))
    assert health.wyoming_port() == 10200
    monkeypatch.setenv("S2S_WYOMING__PORT", "10300")
    assert health.wyoming_port() == 10300


def test_the_addon_is_built_for_amd64_and_aarch64() -> None:
    """config.yaml's arch lists what Home Assistant installs it on; build.yaml gives each one its base."""
    assert manifest()["arch"] == ["amd64", "aarch64"]
    build = yaml.safe_load((ADDON / "build.yaml").read_text(encoding="utf-8"))
    assert build["build_from"] == {
        arch: f"ghcr.io/home-assistant/{arch}-base-debian:bookworm" for arch in manifest()["arch"]
    }
