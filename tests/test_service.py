"""``s2s-daemon service``: templates, rendering checked by systemd's own tools, install logic."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import io
import os
import plistlib
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest

from s2s_daemon import service
from s2s_daemon.errors import EXIT_CONFIG, EXIT_NOPERM, EXIT_OK, EXIT_UNAVAILABLE
from s2s_daemon.service import (
    LAUNCHD_LABEL,
    TEMPLATES,
    UNIT_NAME,
    RenderContext,
    ServiceCommand,
    fill,
    render,
    render_launchd,
    render_systemd,
    render_sysusers,
    systemd_quote,
)

REPO = Path(__file__).resolve().parent.parent
PYTHON = Path(sys.executable)
ODD_NAME = 'odd dir & <x> 50% $HOME "q" back\\slash'
"""Characters that need quoting in a unit (space, %, $, quote, backslash) or escaping in XML (&, <, >)."""
SECURITY_THRESHOLD = 25
"""``systemd-analyze security`` exposure, x10 (2.5 of 10): the system unit measured 1.6 on systemd 252."""

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze missing: apt-get install systemd"
)


def unit_entries(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file as section -> [(key, value)] in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"entry outside a section: {line!r}"
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def values(text: str, section: str, key: str) -> list[str]:
    return [v for k, v in unit_entries(text)[section] if k == key]


def value(text: str, section: str, key: str) -> str:
    found = values(text, section, key)
    assert len(found) == 1, f"{section}.{key}: {found}"
    return found[0]


def seconds(spec: str) -> float:
    """A systemd time span as used in our units (``30s``, ``1h``, ``10min``)."""
    match = re.fullmatch(r"(\d+)(s|min|h)", spec)
    assert match, spec
    return int(match.group(1)) * {"s": 1, "min": 60, "h": 3600}[match.group(2)]


@pytest.fixture
def odd_config(tmp_path: Path) -> Path:
    folder = tmp_path / ODD_NAME
    folder.mkdir()
    path = folder / "config.yaml"
    path.write_text("site_id: kitchen\nshutdown: {drain_timeout_s: 12.5}\n", encoding="utf-8")
    return path


def context(config: Path, home: Path, *, drain_timeout_s: float = 12.5) -> RenderContext:
    return RenderContext(python=PYTHON, config=config, drain_timeout_s=drain_timeout_s, home=home)


# --- templates: one source of truth ------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_repository_copies_equal_the_packaged_templates(kind: str) -> None:
    name = TEMPLATES[kind]
    folder = "launchd" if name.endswith(".plist") else "systemd"
    copy = REPO / folder / name
    assert copy.read_bytes() == service.template_text(kind).encode("utf-8"), (
        f"{folder}/{name} drifted from s2s_daemon/service_templates/{name}: "
        f"cp s2s_daemon/service_templates/{name} {folder}/"
    )


def test_repository_folders_hold_only_templates() -> None:
    shipped = set(TEMPLATES.values())
    for folder in ("systemd", "launchd"):
        extra = {p.name for p in (REPO / folder).iterdir()} - shipped
        assert not extra, f"{folder}/ holds files that are not packaged templates: {extra}"


def test_templates_are_declared_package_data() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    globs = data.get("tool", {}).get("setuptools", {}).get("package-data", {}).get("s2s_daemon", [])
    for name in TEMPLATES.values():
        assert any(fnmatch.fnmatch(f"service_templates/{name}", g) for g in globs), (
            f"pyproject.toml: [tool.setuptools.package-data] s2s_daemon must include service_templates/{name}"
        )


def test_fill_refuses_an_unknown_placeholder() -> None:
    with pytest.raises(KeyError, match="@NOPE@"):
        fill("a=@NOPE@", {})
    assert fill("a=@X@ b=@X@ c@d.e", {"X": "1"}) == "a=1 b=1 c@d.e"


def test_every_rendering_fills_every_placeholder(tmp_path: Path) -> None:
    ctx = context(tmp_path / "c.yaml", tmp_path)
    for text in (render_systemd(ctx, "user"), render_systemd(ctx, "system"), render_launchd(ctx), render_sysusers()):
        assert not re.search(r"@[A-Z][A-Z_]*@", text)


def test_systemd_quote_escapes_specifiers_variables_quotes() -> None:
    assert systemd_quote(Path('/a b/%h/$X/"q"\\z')) == '"/a b/%%h/$$X/\\"q\\"\\\\z"'
    with pytest.raises(service.ServiceError, match="control characters"):
        systemd_quote(Path("/a\nb"))


# --- systemd units, checked by systemd-analyze -------------------------------------------


def verify(unit: Path, *, user: bool, tmp_path: Path) -> str:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_COLOR": "0"}
    argv = ["systemd-analyze", *(["--user"] if user else []), "verify", str(unit)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    return (done.stdout + done.stderr).strip() + ("" if done.returncode == 0 else f"\n(exit status {done.returncode})")


@pytest.mark.integration
@needs_systemd_analyze
@pytest.mark.parametrize("scope", ["user", "system"])
def test_rendered_unit_passes_systemd_analyze_verify(scope: service.Scope, odd_config: Path, tmp_path: Path) -> None:
    unit = tmp_path / UNIT_NAME
    unit.write_text(render_systemd(context(odd_config, tmp_path), scope), encoding="utf-8")
    assert verify(unit, user=scope == "user", tmp_path=tmp_path) == ""


@pytest.mark.integration
@needs_systemd_analyze
def test_verify_does_report_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: an unknown key and a missing interpreter are reported."""
    text = render_systemd(context(tmp_path / "c.yaml", tmp_path), "user")
    text = text.replace("[Service]\n", "[Service]\nNoSuchKey=1\n").replace(str(PYTHON), "/nonexistent/python")
    unit = tmp_path / UNIT_NAME
    unit.write_text(text, encoding="utf-8")
    output = verify(unit, user=True, tmp_path=tmp_path)
    assert "NoSuchKey" in output
    assert "/nonexistent/python" in output


@pytest.mark.integration
@needs_systemd_analyze
def test_system_unit_security_exposure_is_low(tmp_path: Path) -> None:
    unit = tmp_path / UNIT_NAME
    unit.write_text(render_systemd(context(tmp_path / "c.yaml", tmp_path), "system"), encoding="utf-8")
    argv = ["systemd-analyze", "security", "--offline=true", f"--threshold={SECURITY_THRESHOLD}", str(unit)]
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_COLORS": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", done.stdout)
    assert match, done.stdout + done.stderr
    assert done.returncode == 0, f"exposure {match.group(1)} above {SECURITY_THRESHOLD / 10}\n{done.stdout}"
    # The user unit, without the sandbox, is far more exposed: the threshold does discriminate.
    unit.write_text(render_systemd(context(tmp_path / "c.yaml", tmp_path), "user"), encoding="utf-8")
    loose = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert loose.returncode != 0


@pytest.mark.integration
@needs_systemd_analyze
def test_sysusers_file_creates_the_dedicated_user(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    conf = tmp_path / "s2s-daemon.conf"
    conf.write_text(render_sysusers(), encoding="utf-8")
    subprocess.run(["systemd-sysusers", f"--root={root}", str(conf)], check=True, capture_output=True, timeout=60)
    entry = next(line for line in (root / "etc/passwd").read_text().splitlines() if line.startswith("s2s-daemon:"))
    assert entry.split(":")[5] == "/var/lib/s2s-daemon"


@pytest.mark.parametrize("scope", ["user", "system"])
def test_unit_semantics(scope: service.Scope, odd_config: Path, tmp_path: Path) -> None:
    text = render_systemd(context(odd_config, tmp_path, drain_timeout_s=12.5), scope)
    assert value(text, "Service", "Type") == "notify"
    assert value(text, "Service", "NotifyAccess") == "main"
    assert value(text, "Service", "Restart") == "on-failure"
    assert value(text, "Service", "RestartPreventExitStatus").split() == [str(EXIT_NOPERM), str(EXIT_CONFIG)]
    assert seconds(value(text, "Service", "WatchdogSec")) >= 10
    assert seconds(value(text, "Service", "TimeoutStartSec")) >= 30 * 60, "a first model download takes long"
    assert seconds(value(text, "Service", "TimeoutStopSec")) == 13 + service.STOP_MARGIN_S
    exec_start = value(text, "Service", "ExecStart")
    assert exec_start.startswith(systemd_quote(PYTHON) + " -P -m s2s_daemon run -c ")
    assert exec_start.endswith(systemd_quote(odd_config))
    wanted = value(text, "Install", "WantedBy")
    assert wanted == ("default.target" if scope == "user" else "multi-user.target")
    if scope == "system":
        assert value(text, "Service", "User") == service.SYSTEM_USER
        assert set(value(text, "Service", "SupplementaryGroups").split()) <= {"audio", "video", "render"}
        allowed = {v.split()[0] for v in values(text, "Service", "DeviceAllow")}
        assert {"char-alsa", "char-drm", "char-nvidia-frontend", "char-nvidia-uvm"} <= allowed
        assert value(text, "Service", "DevicePolicy") == "closed"
        assert value(text, "Service", "PrivateDevices") == "no"
        assert value(text, "Service", "PrivateUsers") == "no"
        assert value(text, "Service", "ProtectSystem") == "strict"
        assert value(text, "Service", "NoNewPrivileges") == "yes"


# --- launchd -----------------------------------------------------------------------------


def test_launchd_plist_keys_and_types(odd_config: Path, tmp_path: Path) -> None:
    home = tmp_path / "Users" / "ann & bob"
    plist = plistlib.loads(render_launchd(context(odd_config, home, drain_timeout_s=12.5)).encode())
    expected_types = {
        "Label": str,
        "ProgramArguments": list,
        "RunAtLoad": bool,
        "KeepAlive": dict,
        "ThrottleInterval": int,
        "ProcessType": str,
        "ExitTimeOut": int,
        "WorkingDirectory": str,
        "EnvironmentVariables": dict,
        "StandardOutPath": str,
        "StandardErrorPath": str,
    }
    assert set(plist) == set(expected_types)
    for key, kind in expected_types.items():
        assert type(plist[key]) is kind, key
    assert plist["Label"] == LAUNCHD_LABEL
    assert plist["ProgramArguments"] == [str(PYTHON), "-P", "-m", "s2s_daemon", "run", "-c", str(odd_config)]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert plist["ProcessType"] == "Interactive"
    assert plist["ExitTimeOut"] == 13 + service.STOP_MARGIN_S
    assert plist["ExitTimeOut"] > 12.5
    logs = home / "Library" / "Logs" / "s2s-daemon"
    assert Path(plist["StandardOutPath"]).parent == logs
    assert Path(plist["StandardErrorPath"]).parent == logs
    assert plist["WorkingDirectory"] == str(home)


def test_launchd_has_no_system_variant(tmp_path: Path) -> None:
    with pytest.raises(service.ServiceError) as caught:
        render(context(tmp_path / "c.yaml", tmp_path), "launchd", "system")
    assert caught.value.exit_code == EXIT_UNAVAILABLE


# --- the command: install / uninstall / status / print -------------------------------------


class FakeHost:
    """Records the commands a ServiceCommand runs; every command succeeds unless told otherwise."""

    def __init__(self, failing: Sequence[str] = (), linger: str = "no") -> None:
        self.commands: list[list[str]] = []
        self.failing = failing
        self.linger = linger

    def run(self, argv: Sequence[str]) -> int:
        self.commands.append(list(argv))
        return 1 if any(word in argv for word in self.failing) else 0

    def query(self, argv: Sequence[str]) -> tuple[int, str]:
        self.commands.append(list(argv))
        return 0, self.linger + "\n"


def command(
    action: str,
    tmp_path: Path,
    host: FakeHost,
    *,
    manager: service.Manager = "systemd",
    scope: service.Scope = "user",
    config: Path | None = None,
    uid: int = 1000,
) -> tuple[ServiceCommand, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    cmd = ServiceCommand(
        action=action,  # type: ignore[arg-type]
        scope=scope,
        manager=manager,
        config=config,
        runner=host.run,
        query=host.query,
        env={"USER": "ann", "PATH": os.environ.get("PATH", "")},
        home=tmp_path / "home",
        python=PYTHON,
        uid=uid,
        out=out,
        err=err,
    )
    return cmd, out, err


@pytest.fixture
def as_systemd_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "host_manager", lambda platform=None: "systemd")
    monkeypatch.setattr(service, "systemd_problem", lambda: None)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("site_id: kitchen\nshutdown: {drain_timeout_s: 10}\n", encoding="utf-8")
    return path


@pytest.mark.usefixtures("as_systemd_host")
def test_user_install_status_uninstall(tmp_path: Path, config: Path) -> None:
    host = FakeHost(linger="no")
    cmd, out, err = command("install", tmp_path, host, config=config)
    assert cmd.execute() == EXIT_OK, err.getvalue()
    unit = tmp_path / "home" / ".config" / "systemd" / "user" / UNIT_NAME
    assert unit.read_text() == render_systemd(context(config, tmp_path / "home", drain_timeout_s=10), "user")
    assert [c for c in host.commands if c[0] == "systemctl"] == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", UNIT_NAME],
        ["systemctl", "--user", "restart", "--no-block", UNIT_NAME],
    ]
    assert "loginctl enable-linger ann" in out.getvalue()

    host.commands.clear()
    cmd, out, _ = command("status", tmp_path, host, config=config)
    assert cmd.execute() == EXIT_OK
    assert "matches" in out.getvalue()
    assert host.commands == [["systemctl", "--user", "status", "--no-pager", "--lines=20", UNIT_NAME]]

    config.write_text("shutdown: {drain_timeout_s: 40}\n", encoding="utf-8")
    cmd, out, _ = command("status", tmp_path, host, config=config)
    cmd.execute()
    assert "differs" in out.getvalue()

    host.commands.clear()
    cmd, out, _ = command("uninstall", tmp_path, host, config=config)
    assert cmd.execute() == EXIT_OK
    assert not unit.exists()
    assert host.commands == [
        ["systemctl", "--user", "disable", "--now", UNIT_NAME],
        ["systemctl", "--user", "daemon-reload"],
    ]


@pytest.mark.usefixtures("as_systemd_host")
def test_install_without_linger_hint_when_lingering(tmp_path: Path, config: Path) -> None:
    cmd, out, _ = command("install", tmp_path, FakeHost(linger="yes"), config=config)
    assert cmd.execute() == EXIT_OK
    assert "enable-linger" not in out.getvalue()


@pytest.mark.usefixtures("as_systemd_host")
def test_install_refuses_a_missing_or_invalid_config(tmp_path: Path) -> None:
    host = FakeHost()
    cmd, _, err = command("install", tmp_path, host, config=tmp_path / "absent.yaml")
    assert cmd.execute() == EXIT_CONFIG
    assert "absent.yaml" in err.getvalue()
    bad = tmp_path / "bad.yaml"
    bad.write_text("shutdown: {drain_timeout_s: -1}\nnope: 1\n", encoding="utf-8")
    cmd, _, err = command("install", tmp_path, host, config=bad)
    assert cmd.execute() == EXIT_CONFIG
    assert "nope" in err.getvalue()
    assert host.commands == []
    assert not (tmp_path / "home" / ".config").exists()


@pytest.mark.usefixtures("as_systemd_host")
def test_failing_systemctl_is_reported(tmp_path: Path, config: Path) -> None:
    cmd, _, err = command("install", tmp_path, FakeHost(failing=["enable"]), config=config)
    assert cmd.execute() == 1
    assert "enable" in err.getvalue()


@pytest.mark.usefixtures("as_systemd_host")
def test_system_install_needs_root(tmp_path: Path, config: Path) -> None:
    host = FakeHost()
    cmd, _, err = command("install", tmp_path, host, scope="system", config=config, uid=1000)
    assert cmd.execute() == 1
    assert "sudo" in err.getvalue()
    assert host.commands == []


@pytest.mark.usefixtures("as_systemd_host")
def test_system_install_as_root(tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "TMP_ROOTS", ())  # pytest's tmp_path, where the config is, lies under /tmp
    monkeypatch.setattr(service, "SYSTEM_UNIT_PATH", tmp_path / "etc/systemd/system" / UNIT_NAME)
    monkeypatch.setattr(service, "SYSUSERS_PATH", tmp_path / "etc/sysusers.d/s2s-daemon.conf")
    host = FakeHost()
    cmd, _, err = command("install", tmp_path, host, scope="system", config=config, uid=0)
    assert cmd.execute() == EXIT_OK, err.getvalue()
    assert (tmp_path / "etc/sysusers.d/s2s-daemon.conf").read_text() == render_sysusers()
    unit = (tmp_path / "etc/systemd/system" / UNIT_NAME).read_text()
    assert value(unit, "Service", "User") == service.SYSTEM_USER
    assert host.commands == [
        ["systemd-sysusers", str(tmp_path / "etc/sysusers.d/s2s-daemon.conf")],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", UNIT_NAME],
        ["systemctl", "restart", "--no-block", UNIT_NAME],
    ]


def test_system_unit_under_home_protects_home_read_only(tmp_path: Path) -> None:
    cmd, out, err = command("print", tmp_path, FakeHost(), scope="system", config=Path("/home/ann/s2s/config.yaml"))
    assert cmd.execute() == EXIT_OK
    assert value(out.getvalue(), "Service", "ProtectHome") == "read-only"
    assert "/home/ann/s2s/config.yaml" in err.getvalue()
    cmd, out, _ = command("print", tmp_path, FakeHost(), scope="system", config=Path("/etc/s2s-daemon/config.yaml"))
    assert cmd.execute() == EXIT_OK
    code_in_home = any(service._under_home(p) for p in (PYTHON, *service.code_paths()))
    assert value(out.getvalue(), "Service", "ProtectHome") == ("read-only" if code_in_home else "yes")


@pytest.mark.usefixtures("as_systemd_host")
def test_a_system_unit_that_would_run_from_tmp_is_warned_or_refused(tmp_path: Path, config: Path) -> None:
    """PrivateTmp=yes hides /tmp from the service: an interpreter or configuration there cannot start."""
    cmd, out, err = command("print", tmp_path, FakeHost(), scope="system", config=Path("/tmp/s2s/config.yaml"))
    cmd = dataclasses.replace(cmd, python=Path("/tmp/s2s/.venv/bin/python"))
    assert cmd.execute() == EXIT_OK
    assert "ExecStart" in out.getvalue()
    warning = err.getvalue()
    # the code's own folders are named too where the checkout itself lies under /tmp (a CI clone)
    named = warning.split(" lie under /tmp or /var/tmp")[0].removeprefix(warning.split("warning: ")[0] + "warning: ")
    assert named.split(", ")[0] == "/tmp/s2s/.venv/bin/python" and "/tmp/s2s/config.yaml" in named.split(", ")
    assert "PrivateTmp=yes" in warning and "/opt" in warning
    host = FakeHost()
    cmd, _, err = command("install", tmp_path, host, scope="system", config=config, uid=0)
    cmd = dataclasses.replace(cmd, python=Path("/var/tmp/venv/bin/python"))
    assert cmd.execute() == EXIT_CONFIG
    assert "PrivateTmp=yes" in err.getvalue() and host.commands == []
    cmd, _, err = command("print", tmp_path, FakeHost(), scope="system", config=Path("/etc/s2s-daemon/config.yaml"))
    assert cmd.execute() == EXIT_OK
    assert "PrivateTmp" not in err.getvalue() or service._under(PYTHON, service.TMP_ROOTS)


def test_system_unit_lists_only_existing_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "existing_groups", lambda: ("audio", "render"))
    cmd, out, _ = command("print", tmp_path, FakeHost(), scope="system", config=Path("/etc/s2s-daemon/config.yaml"))
    assert cmd.execute() == EXIT_OK
    assert value(out.getvalue(), "Service", "SupplementaryGroups") == "audio render"


def test_existing_groups_skips_unknown() -> None:
    assert service.existing_groups(("root", "no-such-group-s2s")) == ("root",)


def test_launchd_install_and_uninstall(tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "host_manager", lambda platform=None: "launchd")
    host = FakeHost()
    cmd, out, err = command("install", tmp_path, host, manager="launchd", config=config, uid=501)
    assert cmd.execute() == EXIT_OK, err.getvalue()
    plist_path = tmp_path / "home/Library/LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    assert plistlib.loads(plist_path.read_bytes())["ProgramArguments"][-1] == str(config)
    assert (tmp_path / "home/Library/Logs/s2s-daemon").is_dir()
    assert str(tmp_path / "home/Library/Logs/s2s-daemon") in out.getvalue()
    assert host.commands == [
        ["launchctl", "bootout", f"gui/501/{LAUNCHD_LABEL}"],
        ["launchctl", "enable", f"gui/501/{LAUNCHD_LABEL}"],
        ["launchctl", "bootstrap", "gui/501", str(plist_path)],
    ]
    host.commands.clear()
    cmd, _, _ = command("uninstall", tmp_path, host, manager="launchd", config=config, uid=501)
    assert cmd.execute() == EXIT_OK
    assert not plist_path.exists()
    assert host.commands == [["launchctl", "bootout", f"gui/501/{LAUNCHD_LABEL}"]]


def test_wrong_platform_is_refused(tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "host_manager", lambda platform=None: "systemd")
    host = FakeHost()
    cmd, _, err = command("install", tmp_path, host, manager="launchd", config=config)
    assert cmd.execute() == EXIT_UNAVAILABLE
    assert "systemd" in err.getvalue()
    cmd, _, err = command("print", tmp_path, host, manager="launchd", scope="system", config=config)
    assert cmd.execute() == EXIT_UNAVAILABLE
    assert "LaunchAgent" in err.getvalue()
    monkeypatch.setattr(service, "systemd_problem", lambda: "systemd is not the running init here")
    cmd, _, err = command("status", tmp_path, host, config=config)
    assert cmd.execute() == EXIT_UNAVAILABLE
    assert "not the running init" in err.getvalue()
    assert host.commands == []


def test_host_manager() -> None:
    assert service.host_manager("darwin") == "launchd"
    assert service.host_manager("linux") == "systemd"
    assert service.host_manager("win32") is None


def test_default_config_path(tmp_path: Path) -> None:
    home = tmp_path
    assert service.default_config_path("user", {}, home) == home / ".config/s2s-daemon/config.yaml"
    assert service.default_config_path("user", {"XDG_CONFIG_HOME": "/x"}, home) == Path("/x/s2s-daemon/config.yaml")
    assert service.default_config_path("system", {}, home) == Path("/etc/s2s-daemon/config.yaml")
    assert service.default_config_path("system", {"S2S_CONFIG": "/c.yaml"}, home) == Path("/c.yaml")


# --- the argparse wiring ---------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="s2s-daemon")
    service.add_parser(main.add_subparsers(dest="command", required=True))
    return main


def test_parser_wiring() -> None:
    args = parser().parse_args(["service", "print", "--system", "-c", "/etc/x.yaml", "--platform", "systemd"])
    assert args.func is service.handler
    assert (args.service_action, args.system, args.config, args.platform) == (
        "print",
        True,
        Path("/etc/x.yaml"),
        "systemd",
    )
    args = parser().parse_args(["service", "install", "--no-start"])
    assert (args.service_action, args.system, args.no_start) == ("install", False, True)
    with pytest.raises(SystemExit):
        parser().parse_args(["service", "install", "--user", "--system"])
    with pytest.raises(SystemExit):
        parser().parse_args(["service", "status", "--platform", "launchd"])


def test_print_through_the_handler(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    args = parser().parse_args(["service", "print", "--platform", "launchd", "-c", str(config)])
    assert args.func(args) == EXIT_OK
    assert plistlib.loads(capsys.readouterr().out.encode())["Label"] == LAUNCHD_LABEL
    args = parser().parse_args(["service", "print", "--platform", "systemd", "-c", str(config)])
    assert args.func(args) == EXIT_OK
    assert value(capsys.readouterr().out, "Service", "Type") == "notify"


@pytest.mark.integration
@pytest.mark.parametrize("platform", ["systemd", "launchd"])
def test_cli_print_writes_only_the_rendered_file(platform: str, config: Path, tmp_path: Path) -> None:
    """`s2s-daemon service print > file` must give a usable file: nothing else on stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_")}
    argv = [sys.executable, "-m", "s2s_daemon", "service", "print", "--platform", platform, "-c", str(config)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=60, check=False)
    assert done.returncode == EXIT_OK, done.stderr
    ctx = context(config, Path.home(), drain_timeout_s=10)
    expected = render_launchd(ctx) if platform == "launchd" else render_systemd(ctx, "user")
    assert done.stdout == expected
