"""``s2s-daemon service``: install, remove, inspect and print the systemd / launchd service.

The templates (package data in ``s2s_daemon/service_templates/``, copied verbatim to
``systemd/`` and ``launchd/`` in the repository) carry placeholders between at-signs
(``@PYTHON@``); rendering fills them with absolute paths (this interpreter, the
configuration file) and the stop timeout derived from ``shutdown.drain_timeout_s``.
"""

from __future__ import annotations

import argparse
import grp
import math
import os
import plistlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Literal, TextIO
from xml.sax.saxutils import escape as xml_escape

from s2s_daemon.config import DaemonConfig, load_config
from s2s_daemon.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE, ConfigError, DaemonError

Manager = Literal["systemd", "launchd"]
Scope = Literal["user", "system"]

UNIT_NAME = "s2s-daemon.service"
LAUNCHD_LABEL = "io.s2s.daemon"
SYSTEM_USER = "s2s-daemon"
SYSTEM_CONFIG = Path("/etc/s2s-daemon/config.yaml")
SYSTEM_UNIT_PATH = Path("/etc/systemd/system") / UNIT_NAME
SYSUSERS_PATH = Path("/etc/sysusers.d/s2s-daemon.conf")
STOP_MARGIN_S = 20
"""Seconds granted beyond ``shutdown.drain_timeout_s`` to close the engine and the audio device."""
DEVICE_GROUPS = ("audio", "video", "render")
"""Supplementary groups of the system service (sound card, GPUs), where they exist."""
HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))
"""What ``ProtectHome=yes`` hides."""
TMP_ROOTS = (Path("/tmp"), Path("/var/tmp"))
"""What ``PrivateTmp=yes`` replaces with empty folders of the service's own."""

TEMPLATES: dict[str, str] = {
    "systemd-user": "s2s-daemon.service",
    "systemd-system": "s2s-daemon-system.service",
    "sysusers": "s2s-daemon.sysusers.conf",
    "launchd": f"{LAUNCHD_LABEL}.plist",
}
"""Template kind -> file name, the same in the package and in ``systemd/`` / ``launchd/``."""

_PLACEHOLDER = re.compile(r"@([A-Z][A-Z_]*)@")


class ServiceError(Exception):
    """A service command cannot proceed; ``exit_code`` is the process exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class RenderContext:
    """Everything a template needs; paths are absolute."""

    python: Path
    """The interpreter that runs the daemon (``sys.executable``, not resolved: a venv stays a venv)."""
    config: Path
    """The YAML configuration file."""
    drain_timeout_s: float
    """``shutdown.drain_timeout_s`` of that configuration, seconds."""
    home: Path
    """The user's home folder (launchd working directory and logs)."""
    supplementary_groups: tuple[str, ...] = DEVICE_GROUPS
    """Groups of the system service's user."""
    protect_home: Literal["yes", "read-only"] = "yes"
    """``ProtectHome=`` of the system service."""

    @property
    def stop_timeout_s(self) -> int:
        """Seconds from SIGTERM to SIGKILL: the drain timeout plus a margin."""
        return math.ceil(self.drain_timeout_s) + STOP_MARGIN_S

    @property
    def log_dir(self) -> Path:
        """launchd's log folder (``~/Library/Logs/s2s-daemon``)."""
        return self.home / "Library" / "Logs" / "s2s-daemon"


# --- rendering -------------------------------------------------------------------------


def template_text(kind: str) -> str:
    """The raw template of ``kind`` (a key of ``TEMPLATES``), read from package data."""
    return (files("s2s_daemon") / "service_templates" / TEMPLATES[kind]).read_text(encoding="utf-8")


def fill(template: str, values: Mapping[str, str]) -> str:
    """Replace every ``@NAME@``; a placeholder without a value is an error, never left behind."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"template placeholder @{name}@ has no value")
        return values[name]

    return _PLACEHOLDER.sub(substitute, template)


def _check_path_text(path: Path) -> str:
    text = str(path)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise ServiceError(f"path {text!r} contains control characters; a service cannot use it")
    return text


def systemd_quote(path: Path) -> str:
    """One ExecStart= argument, double-quoted, with specifiers (%) and variables ($) escaped."""
    text = _check_path_text(path)
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{text}"'


def render_systemd(ctx: RenderContext, scope: Scope) -> str:
    kind = "systemd-user" if scope == "user" else "systemd-system"
    return fill(
        template_text(kind),
        {
            "PYTHON": systemd_quote(ctx.python),
            "CONFIG": systemd_quote(ctx.config),
            "TIMEOUT_STOP_S": f"{ctx.stop_timeout_s}s",
            "SUPPLEMENTARY_GROUPS": " ".join(ctx.supplementary_groups),
            "PROTECT_HOME": ctx.protect_home,
        },
    )


def render_sysusers() -> str:
    return fill(template_text("sysusers"), {})


def render_launchd(ctx: RenderContext) -> str:
    def text(path: Path) -> str:
        return xml_escape(_check_path_text(path))

    rendered = fill(
        template_text("launchd"),
        {
            "PYTHON": text(ctx.python),
            "CONFIG": text(ctx.config),
            "TIMEOUT_STOP_S": str(ctx.stop_timeout_s),
            "HOME": text(ctx.home),
            "LOG_DIR": text(ctx.log_dir),
        },
    )
    plistlib.loads(rendered.encode())  # a rendering bug must not reach launchctl
    return rendered


def render(ctx: RenderContext, manager: Manager, scope: Scope) -> str:
    if manager == "launchd":
        if scope == "system":
            raise ServiceError(
                "launchd: only a LaunchAgent (--user) is provided; sound on macOS belongs to the "
                "logged-in user's session",
                EXIT_UNAVAILABLE,
            )
        return render_launchd(ctx)
    return render_systemd(ctx, scope)


# --- where things go -------------------------------------------------------------------


def host_manager(platform: str | None = None) -> Manager | None:
    """The service manager this host uses, or None where neither fits."""
    platform = sys.platform if platform is None else platform
    if platform == "darwin":
        return "launchd"
    if platform.startswith("linux"):
        return "systemd"
    return None


def _xdg_config_home(env: Mapping[str, str], home: Path) -> Path:
    raw = env.get("XDG_CONFIG_HOME", "")
    return Path(raw) if raw and Path(raw).is_absolute() else home / ".config"


def default_config_path(scope: Scope, env: Mapping[str, str], home: Path) -> Path:
    """``$S2S_CONFIG``, else ``~/.config/s2s-daemon/config.yaml`` (user) or ``/etc/s2s-daemon/config.yaml``."""
    if env.get("S2S_CONFIG"):
        return Path(env["S2S_CONFIG"])
    if scope == "system":
        return SYSTEM_CONFIG
    return _xdg_config_home(env, home) / "s2s-daemon" / "config.yaml"


def service_file_path(manager: Manager, scope: Scope, env: Mapping[str, str], home: Path) -> Path:
    if manager == "launchd":
        return home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    if scope == "system":
        return SYSTEM_UNIT_PATH
    return _xdg_config_home(env, home) / "systemd" / "user" / UNIT_NAME


def existing_groups(names: Sequence[str] = DEVICE_GROUPS) -> tuple[str, ...]:
    """The subset of ``names`` that exist here (systemd refuses to start with an unknown group)."""
    found: list[str] = []
    for name in names:
        try:
            grp.getgrnam(name)
        except KeyError:
            continue
        found.append(name)
    return tuple(found)


def systemd_problem() -> str | None:
    """Why systemd cannot manage a service here, or None when it can."""
    if shutil.which("systemctl") is None:
        return "systemctl is not installed: this host does not run systemd"
    if not Path("/run/systemd/system").is_dir():
        return "systemd is not the running init here (no /run/systemd/system)"
    return None


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _under_home(path: Path) -> bool:
    return _under(path, HOME_ROOTS)


def code_paths() -> tuple[Path, ...]:
    """What the service must be able to read: the environment's prefix and this package."""
    return (Path(sys.prefix), Path(__file__).resolve().parent)


# --- commands ----------------------------------------------------------------------------

Runner = Callable[[Sequence[str]], int]
"""Runs one command (output to the terminal) and returns its exit status."""


Query = Callable[[Sequence[str]], tuple[int, str]]
"""Runs one command quietly and returns its exit status and standard output."""


def run_command(argv: Sequence[str]) -> int:
    try:
        return subprocess.run(list(argv), check=False).returncode
    except FileNotFoundError:
        return 127


HaRemover = Callable[[DaemonConfig], int]
"""Clears a site's Home Assistant discovery configs on its broker; returns how many."""


def remove_ha_entities(config: DaemonConfig) -> int:
    import asyncio

    from s2s_daemon.events.discovery import remove_discovery

    return len(asyncio.run(remove_discovery(config)))


def query_command(argv: Sequence[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 127, ""
    return done.returncode, done.stdout


@dataclass(frozen=True, slots=True)
class ServiceCommand:
    """One invocation of ``s2s-daemon service``, with its surroundings injectable for tests."""

    action: Literal["install", "uninstall", "status", "print"]
    scope: Scope
    manager: Manager
    config: Path | None = None
    start: bool = True
    runner: Runner = run_command
    query: Query = query_command
    ha_remove: HaRemover = remove_ha_entities
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    home: Path = field(default_factory=Path.home)
    python: Path = field(default_factory=lambda: Path(sys.executable))
    uid: int = field(default_factory=os.getuid)
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)

    # -- helpers --

    def say(self, text: str) -> None:
        self.out.write(text + "\n")

    def warn(self, text: str) -> None:
        self.err.write(text + "\n")

    def config_path(self) -> Path:
        path = self.config if self.config is not None else default_config_path(self.scope, self.env, self.home)
        return Path(os.path.abspath(path.expanduser()))

    def context(self, *, require_config: bool) -> RenderContext:
        config = self.config_path()
        drain_timeout_s = 10.0
        if config.is_file():
            try:
                # The installer's S2S_ variables do not reach the service: ignore them here.
                drain_timeout_s = load_config(config, environ={}).shutdown.drain_timeout_s
            except ConfigError as exc:
                raise ServiceError(str(exc), EXIT_CONFIG) from exc
        elif require_config:
            raise ServiceError(
                f"no configuration at {config}: write one (see configs/ in the source tree) or pass --config PATH",
                EXIT_CONFIG,
            )
        else:
            self.warn(f"note: {config} does not exist yet; rendering with shutdown.drain_timeout_s=10")
        python = self.python
        if not python.is_absolute():
            raise ServiceError(f"cannot tell this interpreter's absolute path ({python})")
        protect_home: Literal["yes", "read-only"] = "yes"
        groups: tuple[str, ...] = DEVICE_GROUPS
        if self.scope == "system":
            groups = existing_groups()
            private = [p for p in (python, config, *code_paths()) if _under(p, TMP_ROOTS)]
            if private:
                why = (
                    ", ".join(str(p) for p in private) + " lie under /tmp or /var/tmp: the system unit's"
                    " PrivateTmp=yes gives the service empty folders of its own there, so it would not find"
                    " them (the start fails, 203/EXEC); install into a virtual environment under /opt and"
                    f" keep the configuration in {SYSTEM_CONFIG.parent}"
                )
                if self.action == "install":
                    raise ServiceError(why, EXIT_CONFIG)
                self.warn("warning: " + why)
            exposed = [p for p in (python, config, *code_paths()) if _under_home(p)]
            if exposed:
                protect_home = "read-only"
                self.warn(
                    "note: " + ", ".join(str(p) for p in exposed) + " lie under a home folder: the unit "
                    f"uses ProtectHome=read-only, and user {SYSTEM_USER} must be able to read them "
                    "(a system install is best made from a virtual environment under /opt)"
                )
        return RenderContext(
            python=python,
            config=config,
            drain_timeout_s=drain_timeout_s,
            home=self.home,
            supplementary_groups=groups,
            protect_home=protect_home,
        )

    def check_host(self) -> None:
        host = host_manager()
        if host != self.manager:
            where = host or sys.platform
            raise ServiceError(
                f"this host uses {where}, not {self.manager}: `{self.action}` only works where "
                f"{self.manager} runs (`print --platform {self.manager}` renders it anywhere)",
                EXIT_UNAVAILABLE,
            )
        if self.manager == "systemd":
            problem = systemd_problem()
            if problem is not None:
                raise ServiceError(problem, EXIT_UNAVAILABLE)
        if self.scope == "system" and self.uid != 0 and self.action in ("install", "uninstall"):
            raise ServiceError(
                f"--system {self.action} needs root: sudo {self.python} -m s2s_daemon service {self.action} --system"
                + (f" --config {self.config_path()}" if self.action == "install" else "")
            )

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *(["--user"] if self.scope == "user" else []), *args]

    def must(self, argv: Sequence[str]) -> None:
        rc = self.runner(argv)
        if rc != 0:
            raise ServiceError(f"`{' '.join(argv)}` failed with exit status {rc}", EXIT_FAILURE)

    @property
    def launchd_domain(self) -> str:
        return f"gui/{self.uid}"

    # -- actions --

    def execute(self) -> int:
        """Run the action; errors become a message on stderr and an exit status."""
        try:
            return self._dispatch()
        except ServiceError as exc:
            self.warn(f"s2s-daemon service {self.action}: {exc}")
            return exc.exit_code

    def _dispatch(self) -> int:
        if self.manager == "launchd" and self.scope == "system":
            raise ServiceError(
                "launchd: only a LaunchAgent (--user) is provided; sound on macOS belongs to the "
                "logged-in user's session",
                EXIT_UNAVAILABLE,
            )
        if self.action == "print":
            self.out.write(render(self.context(require_config=False), self.manager, self.scope))
            return EXIT_OK
        self.check_host()
        if self.action == "install":
            return self.install()
        if self.action == "uninstall":
            return self.uninstall()
        return self.status()

    def install(self) -> int:
        ctx = self.context(require_config=True)
        text = render(ctx, self.manager, self.scope)
        target = service_file_path(self.manager, self.scope, self.env, self.home)
        if self.manager == "launchd":
            ctx.log_dir.mkdir(parents=True, exist_ok=True)
            _write(target, text)
            self.say(f"wrote {target}")
            service = f"{self.launchd_domain}/{LAUNCHD_LABEL}"
            self.runner(["launchctl", "bootout", service])  # not loaded yet: fails harmlessly
            self.must(["launchctl", "enable", service])
            self.must(["launchctl", "bootstrap", self.launchd_domain, str(target)])
            self.say(f"loaded {LAUNCHD_LABEL}; logs: {ctx.log_dir}/")
            return EXIT_OK
        if self.scope == "system":
            _write(SYSUSERS_PATH, render_sysusers())
            self.say(f"wrote {SYSUSERS_PATH}")
            self.must(["systemd-sysusers", str(SYSUSERS_PATH)])
        _write(target, text)
        self.say(f"wrote {target}")
        self.must(self.systemctl("daemon-reload"))
        self.must(self.systemctl("enable", UNIT_NAME))
        if self.start:
            # --no-block: a first start may download the model for many minutes.
            self.must(self.systemctl("restart", "--no-block", UNIT_NAME))
        journal = "journalctl" + (" --user" if self.scope == "user" else "") + f" -u {UNIT_NAME} -f"
        self.say(f"enabled {UNIT_NAME}" + (" and started it" if self.start else "") + f"; logs: {journal}")
        if self.scope == "user":
            self.linger_hint()
        return EXIT_OK

    def linger_hint(self) -> None:
        user = self.env.get("USER") or self.env.get("LOGNAME") or str(self.uid)
        rc, out = self.query(["loginctl", "show-user", user, "--property=Linger", "--value"])
        if rc == 0 and out.strip() == "no":
            self.say(
                f"note: user services stop when {user} logs out and start only at login; to run it from "
                f"boot without a login: sudo loginctl enable-linger {user}"
            )

    def uninstall(self) -> int:
        target = service_file_path(self.manager, self.scope, self.env, self.home)
        if self.manager == "launchd":
            self.runner(["launchctl", "bootout", f"{self.launchd_domain}/{LAUNCHD_LABEL}"])
        else:
            self.runner(self.systemctl("disable", "--now", UNIT_NAME))
        if target.exists():
            target.unlink()
            self.say(f"removed {target}")
        else:
            self.say(f"{target} was not installed")
        self.uninstall_ha_entities()
        if self.manager == "systemd":
            self.must(self.systemctl("daemon-reload"))
        if self.scope == "system":
            self.say(
                f"kept user {SYSTEM_USER} ({SYSUSERS_PATH}), /var/lib/s2s-daemon and the model cache "
                "/var/cache/s2s-daemon; remove them by hand if you want them gone"
            )
        return EXIT_OK

    def uninstall_ha_entities(self) -> None:
        """With ``ha.discovery`` on and an external broker, the stopped daemon's Home Assistant
        entities are removed too (an embedded broker's retained configs ended with the daemon)."""
        path = self.config_path()
        if not path.is_file():
            return
        try:
            config = load_config(path, environ={})
        except ConfigError:
            return
        if not config.ha.discovery or config.mqtt.broker != "external":
            return
        try:
            cleared = self.ha_remove(config)
        except DaemonError as exc:
            self.warn(
                f"could not remove the Home Assistant entities: {exc}\n"
                f"when the broker is reachable: s2s-daemon ha remove -c {path}"
            )
            return
        self.say(f"removed the Home Assistant entities ({cleared} discovery configs cleared)")

    def status(self) -> int:
        target = service_file_path(self.manager, self.scope, self.env, self.home)
        if not target.exists():
            self.say(f"not installed ({target} does not exist)")
        else:
            self.say(f"service file: {target}")
            try:
                expected = render(self.context(require_config=True), self.manager, self.scope)
            except ServiceError as exc:
                self.say(f"cannot compare it with a fresh rendering: {exc}")
            else:
                if target.read_text(encoding="utf-8") == expected:
                    self.say("it matches what `install` would write now")
                else:
                    self.say("it differs from what `install` would write now (run `install` again to update it)")
        if self.manager == "launchd":
            return self.runner(["launchctl", "print", f"{self.launchd_domain}/{LAUNCHD_LABEL}"])
        return self.runner(self.systemctl("status", "--no-pager", "--lines=20", UNIT_NAME))


def _write(path: Path, text: str) -> None:
    """Write atomically (a half-written unit must never be loaded), mode 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.chmod(0o644)
    os.replace(tmp, path)


# --- command line ------------------------------------------------------------------------


def handler(args: argparse.Namespace) -> int:
    manager: Manager | None = getattr(args, "platform", None) or host_manager()
    if manager is None:
        sys.stderr.write(
            f"s2s-daemon service: no service manager for platform {sys.platform!r} "
            "(systemd on Linux and launchd on macOS are supported)\n"
        )
        return EXIT_UNAVAILABLE
    command = ServiceCommand(
        action=args.service_action,
        scope="system" if args.system else "user",
        manager=manager,
        config=args.config,
        start=not getattr(args, "no_start", False),
    )
    return command.execute()


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``service {install,uninstall,status,print}`` on the main CLI."""
    common = argparse.ArgumentParser(add_help=False)
    scope = common.add_mutually_exclusive_group()
    scope.add_argument(
        "--user",
        action="store_true",
        help="per-user service: systemd --user, or a launchd LaunchAgent (the default)",
    )
    scope.add_argument("--system", action="store_true", help="systemd system service with a dedicated user (Linux)")
    common.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help="configuration file the service runs with (default: $S2S_CONFIG, else "
        "~/.config/s2s-daemon/config.yaml, or /etc/s2s-daemon/config.yaml with --system)",
    )

    parser = subparsers.add_parser(
        "service",
        help="run as a service: systemd on Linux, launchd on macOS",
        description="Install, remove, inspect or print the service definition for this interpreter.",
    )
    actions = parser.add_subparsers(dest="service_action", required=True, metavar="ACTION")
    install = actions.add_parser("install", parents=[common], help="write, enable and start the service")
    install.add_argument("--no-start", action="store_true", help="enable (or load) it but do not start it now")
    actions.add_parser("uninstall", parents=[common], help="stop, disable and remove the service")
    actions.add_parser("status", parents=[common], help="show the installed file and the service's state")
    printer = actions.add_parser("print", parents=[common], help="show the rendered file without writing anything")
    printer.add_argument(
        "--platform",
        choices=("systemd", "launchd"),
        default=None,
        help="render for this service manager instead of the host's",
    )
    parser.set_defaults(func=handler)
