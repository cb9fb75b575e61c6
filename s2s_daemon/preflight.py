"""What the schema cannot see: every file and folder a configuration names, every port it listens
on and the CPU it asks for (``tts.torch.isa``), checked by ``check-config`` and by ``run`` before
the model loads (a wrong path found
after a minute of loading and warming up, or by a daemon that said "valid" a moment before, helps
nobody).

A wrong setting is exit 78 (``ConfigError``); something held by someone else now (a port another
process listens on, a journal another daemon holds, a folder it cannot write) is exit 69
(``UnavailableError``), which a service manager retries. Every finding names the key.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s2s_daemon.config import DaemonConfig
from s2s_daemon.errors import ConfigError, DaemonError, UnavailableError
from s2s_daemon.holders import describe, file_lock_holder, port_holder

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``owner/name``: what the engines fetch from the hub; anything else is a local folder."""
LOCAL_PREFIXES = ("/", ".", "~")
CHECKPOINT_FILES = {"torch": ("config.json", "speech_tokenizer/config.json"), "mlx": ("config.json",)}
"""Files a local checkpoint folder must hold, by engine (the torch engine's ``REQUIRED_FILES``)."""


@dataclass(frozen=True, slots=True)
class Finding:
    key: str
    message: str
    unavailable: bool = False
    """Held or refused now (exit 69), not a wrong setting (exit 78)."""

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def findings(config: DaemonConfig, files: bool = True) -> list[Finding]:
    """Everything wrong with ``config`` outside the schema, settings first; ``files=False``: only
    what the values say by themselves (the engine's options and extra, the language), not the
    files, folders, devices and ports they name (``check-config --schema-only``)."""
    found = [*_engine(config), *_language(config)]
    if files:
        found += [
            *_model(config),
            *_voice(config),
            *_voices_dir(config),
            *_mqtt_files(config),
            *_http_key(config),
            *_extras(config),
            *_isa(config),
            *_journal(config),
            *_wav_dir(config),
            *_microphone(config),
            *_ports(config),
        ]
    return sorted(found, key=lambda f: f.unavailable)


def require(config: DaemonConfig, files: bool = True) -> None:
    """Raise ``ConfigError`` (any wrong setting) or ``UnavailableError`` listing every finding."""
    found = findings(config, files)
    if not found:
        return
    lines = "\n".join(f"  {finding}" for finding in found)
    if any(not finding.unavailable for finding in found):
        raise ConfigError(f"invalid configuration:\n{lines}")
    raise UnavailableError(f"cannot start:\n{lines}")


def _isa(config: DaemonConfig) -> list[Finding]:
    """``tts.torch.isa``: a path of another architecture, or one this CPU cannot run."""
    if config.tts.engine != "torch":
        return []
    from s2s_daemon.tts.isa import refusal
    from s2s_daemon.tts.torch_qwen3.options import TorchSection

    why = refusal(config.tts.section("torch", TorchSection).isa)
    return [Finding("tts.torch.isa", why)] if why is not None else []


# -- files and folders ------------------------------------------------------------------------


def is_local_model(model: str) -> bool:
    """Whether ``tts.model`` names a folder on this machine rather than a hub id."""
    return model.startswith(LOCAL_PREFIXES) or Path(model).expanduser().exists() or not HUB_ID.match(model)


def _model(config: DaemonConfig) -> list[Finding]:
    model = config.tts.model
    if config.tts.engine not in CHECKPOINT_FILES or not is_local_model(model):  # an engine of its own
        return []  # a hub id: fetched, or found in the cache, when the daemon starts
    folder = Path(model).expanduser()
    hint = "a local checkpoint folder, or a hub id such as Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
    if not folder.exists():
        return [Finding("tts.model", f"{model}: no such folder ({hint})")]
    if not folder.is_dir():
        return [Finding("tts.model", f"{model}: not a folder ({hint})")]
    if not os.access(folder, os.R_OK | os.X_OK):
        return [Finding("tts.model", f"{model}: this user cannot read the folder")]
    needed = CHECKPOINT_FILES[config.tts.engine]
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        return [Finding("tts.model", f"{model}: not a checkpoint in the official layout (no {', '.join(missing)})")]
    return []


# -- the engine, the model's voices and languages ----------------------------------------------


def _engine(config: DaemonConfig) -> list[Finding]:
    """The engine's extra (what ``run`` would refuse at load, exit 69) and its ``tts.options``
    against the schema it declares (``OptionsSchema``: a wrong value or an unknown key, exit 78)."""
    from s2s_daemon.tts.registry import missing_extra, options_schema

    out: list[Finding] = []
    missing = missing_extra(config.tts.engine)
    if missing is not None:
        out.append(Finding("tts.engine", missing, unavailable=True))
    schema = options_schema(config.tts.engine)
    if schema is not None:
        out += [Finding(key, message) for key, message in schema.problems(config.tts.options)]
    return out


def checkpoint_facts(config: DaemonConfig) -> Any:
    """The checkpoint's ``ModelConfig`` (mode, preset speakers, languages) when its ``config.json``
    is on this machine (a local folder, or the hub's cache), else None; no torch is imported.
    ``CheckpointError`` when a local one is not a Qwen3-TTS checkpoint (the torch engine refuses it)."""
    if config.tts.engine not in CHECKPOINT_FILES:
        return None
    from s2s_daemon.tts.torch_qwen3.config import load_model_config

    model = config.tts.model
    if is_local_model(model):
        folder = Path(model).expanduser()
        return load_model_config(folder) if (folder / "config.json").is_file() else None
    cached = _hub_cached_folder(model, config.tts.revision)
    if cached is None:
        return None
    from s2s_daemon.tts.engine import CheckpointError

    try:
        return load_model_config(cached)
    except CheckpointError:  # the engine fetches it again
        return None


def _hub_cached_folder(model: str, revision: str | None) -> Path | None:
    """The hub cache's snapshot folder of ``model`` when its ``config.json`` is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ValueError, OSError):  # not a repository id the hub takes
        return None
    return Path(found).parent if isinstance(found, str) else None


def _facts(config: DaemonConfig) -> tuple[Any, list[Finding]]:
    from s2s_daemon.tts.engine import CheckpointError

    try:
        return checkpoint_facts(config), []
    except CheckpointError as exc:
        if config.tts.engine == "torch":
            return None, [Finding("tts.model", str(exc))]
        return None, []  # another engine's reader decides


def _language(config: DaemonConfig) -> list[Finding]:
    """``tts.language`` against the model's languages (its ``config.json`` when it is here), else
    against every language Qwen3-TTS speaks."""
    from s2s_daemon.pipeline.vocabulary import LANGUAGE_ALIASES, EngineError, normalize_language

    if config.tts.engine not in CHECKPOINT_FILES:
        return []  # a registered engine: its languages are known once it is loaded
    facts, _ = _facts(config)
    languages = facts.languages if facts is not None else ("auto", *sorted(set(LANGUAGE_ALIASES.values()) - {"auto"}))
    try:
        normalize_language(config.tts.language, languages)
    except EngineError as exc:
        return [Finding("tts.language", str(exc))]
    return []


def _voice(config: DaemonConfig) -> list[Finding]:
    """``tts.voice`` against the model's preset speakers and the library voices it can speak
    (when the model's ``config.json`` is on this machine); a broken local checkpoint config."""
    facts, found = _facts(config)
    voice = config.tts.named_voice
    if facts is None or voice is None or found:
        return found
    from s2s_daemon.pipeline.vocabulary import EngineError
    from s2s_daemon.pipeline.voice_policy import check_voice
    from s2s_daemon.pipeline.voices import VoiceLibrary, default_voices_dir

    library = VoiceLibrary(config.tts.voices_dir or default_voices_dir(), facts.mode)
    try:
        check_voice(voice, facts.voices, library)
    except EngineError as exc:
        return [Finding("tts.voice", str(exc))]
    return []


def _voices_dir(config: DaemonConfig) -> list[Finding]:
    folder = config.tts.voices_dir
    if folder is None or not folder.exists():
        return []  # none yet: an empty library (`s2s-daemon voices add` makes it)
    if not folder.is_dir():
        return [Finding("tts.voices_dir", f"{folder}: not a folder")]
    if not os.access(folder, os.R_OK | os.X_OK):
        return [Finding("tts.voices_dir", f"{folder}: this user cannot read the folder")]
    return []


def _error_finding(exc: DaemonError, unavailable: bool = False) -> Finding:
    key, _, message = str(exc).partition(": ")
    return Finding(key, message, unavailable)


def _mqtt_files(config: DaemonConfig) -> list[Finding]:
    from s2s_daemon.mqtt.connection import read_password, tls_context

    out: list[Finding] = []
    for check in (lambda: read_password(config.mqtt), lambda: tls_context(config.mqtt.tls)):
        try:
            check()
        except ConfigError as exc:
            out.append(_error_finding(exc))
    return out


def _http_key(config: DaemonConfig) -> list[Finding]:
    from s2s_daemon.intake.http.api_key import read_api_key

    path = config.http.api_key_file
    if not config.http.enabled or path is None:
        return []
    try:
        read_api_key(path)
    except ConfigError as exc:
        return [_error_finding(exc)]
    return []


def _extras(config: DaemonConfig) -> list[Finding]:
    from s2s_daemon.intake.http import require_http_extra, require_monitor_extra

    out: list[Finding] = []
    try:
        require_http_extra(config.http)
    except UnavailableError as exc:
        out.append(Finding("http.enabled", "needs " + str(exc).partition(" needs ")[2], unavailable=True))
    try:
        require_monitor_extra(config.monitor)
    except UnavailableError as exc:
        out.append(Finding("monitor.enabled", "needs " + str(exc).partition(" needs ")[2], unavailable=True))
    if config.wyoming.enabled and importlib.util.find_spec("wyoming") is None:
        out.append(Finding("wyoming.enabled", "needs the wyoming package: pip install 's2s-daemon[wyoming]'", True))
    if config.mqtt.broker == "embedded" and importlib.util.find_spec("amqtt") is None:
        out.append(Finding("mqtt.broker", "'embedded' needs the amqtt package: pip install amqtt", True))
    return out


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def _writable_folder(key: str, folder: Path, target: Path | None = None, hint: str = "") -> list[Finding]:
    """A folder the daemon writes into (made when missing; ``target``: the file it writes there):
    it must be one, or be makeable."""
    what = f"{target}: " if target is not None else f"{folder}: "
    if folder.exists():
        why = "" if folder.is_dir() else f"{folder} is not a folder"
        if not why and (failed := _cannot_write(folder)):
            why = f"this user cannot write into {folder} ({failed})"
    else:
        base = _nearest_existing(folder)
        why = ""
        if not base.is_dir():
            why = f"{folder} cannot be made: {base} is not a folder"
        elif failed := _cannot_make_in(base):
            why = f"{folder} cannot be made: this user cannot make a folder in {base} ({failed})"
    return [Finding(key, what + why + hint, unavailable=True)] if why else []


def _cannot_write(folder: Path) -> str | None:
    """Why a file cannot be made in ``folder`` (tried: permissions alone do not tell, for root, a
    read-only mount or ``/proc``), None when it can."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _cannot_make_in(base: Path) -> str | None:
    """Why a folder cannot be made in ``base`` (tried, then removed), None when it can."""
    try:
        made = tempfile.mkdtemp(dir=base, prefix=".s2s-check-")
    except OSError as exc:
        return exc.strerror or str(exc)
    os.rmdir(made)
    return None


def _journal(config: DaemonConfig) -> list[Finding]:
    if not config.journal.enabled:
        return []
    from s2s_daemon.pipeline.journal import default_journal_path, held_message

    path = config.journal.path or default_journal_path(config.site_id)
    hint = "; set journal.path, or run without durability: journal.enabled: false"
    found = _writable_folder("journal.path", path.parent, path, hint)
    if found:
        return found
    if path.exists():
        if not path.is_file():
            return [Finding("journal.path", f"{path}: not a file{hint}", unavailable=True)]
        if not os.access(path, os.R_OK | os.W_OK):
            return [Finding("journal.path", f"{path}: this user cannot read and write it{hint}", unavailable=True)]
        holder = file_lock_holder(path)
        if holder is not None:
            return [Finding("journal.path", held_message(path, describe(holder)), unavailable=True)]
    return []


def _wav_dir(config: DaemonConfig) -> list[Finding]:
    audio = config.audio
    if audio.sink != "wav" or audio.wav_dir is None:
        return []
    return _writable_folder("audio.wav_dir", audio.wav_dir)


def _microphone(config: DaemonConfig) -> list[Finding]:
    """``vad.enabled``: an input device (``vad.device``) and webrtcvad, as ``run`` opens them."""
    if not config.vad.enabled:
        return []
    if importlib.util.find_spec("webrtcvad") is None:
        return [Finding("vad.enabled", "needs the webrtcvad package: pip install 's2s-daemon[audio]'", True)]
    from s2s_daemon.audio.devices import resolve_device
    from s2s_daemon.audio.sink import AudioDeviceError

    try:
        resolve_device(config.vad.device, "input")
    except AudioDeviceError as exc:
        key = "vad.device" if config.vad.device is not None else "vad.enabled"
        return [Finding(key, f"no microphone: {exc}", unavailable=True)]
    return []


# -- ports ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listener:
    key: str
    """The port's key (``http.port``); its host is the section's ``host``."""
    host: str
    port: int


WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def listeners(config: DaemonConfig) -> list[Listener]:
    """What the daemon listens on with ``config``."""
    out = []
    if config.mqtt.broker == "embedded":
        out.append(Listener("mqtt.port", "127.0.0.1", config.mqtt.port))
    if config.http.enabled:
        out.append(Listener("http.port", config.http.host, config.http.port))
    if config.wyoming.enabled:
        out.append(Listener("wyoming.port", config.wyoming.host, config.wyoming.port))
    if config.monitor.enabled:
        out.append(Listener("monitor.port", config.monitor.host, config.monitor.port))
    return out


def _overlap(a: Listener, b: Listener) -> bool:
    return a.port == b.port and (a.host == b.host or a.host in WILDCARDS or b.host in WILDCARDS)


def _ports(config: DaemonConfig) -> list[Finding]:
    ours = listeners(config)
    out: list[Finding] = []
    clashing: set[str] = set()
    for i, a in enumerate(ours):
        for b in ours[i + 1 :]:
            if _overlap(a, b):
                out.append(Finding(b.key, f"{b.port} is {a.key} too: each listener needs its own port"))
                clashing.add(b.key)
    for listener in ours:
        if listener.key not in clashing and (finding := bind_finding(listener)) is not None:
            out.append(finding)
    return out


def bind_finding(listener: Listener) -> Finding | None:
    """Bind the listener's address as its server will (then let go): why it cannot, or None."""
    host, port = listener.host, listener.port
    host_key = listener.key.replace(".port", ".host")
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return Finding(host_key, f"{host!r} is not an address or a known name ({exc.strerror})")
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
        except OSError as exc:
            where = f"{address[0]}:{port}" if family != socket.AF_INET6 else f"[{address[0]}]:{port}"
            if exc.errno == errno.EADDRINUSE:
                holder = port_holder(port)
                by = f" by {describe(holder)}" if holder is not None else " by another program"
                return Finding(
                    listener.key,
                    f"cannot listen on {where}: the port is in use{by}; stop it, or set {listener.key}",
                    unavailable=True,
                )
            if exc.errno == errno.EADDRNOTAVAIL:
                return Finding(host_key, f"cannot listen on {where}: {host!r} is not an address of this machine")
            if exc.errno == errno.EACCES:
                return Finding(
                    listener.key,
                    f"cannot listen on {where}: ports below 1024 need root or CAP_NET_BIND_SERVICE",
                )
            return Finding(listener.key, f"cannot listen on {where}: {exc.strerror or exc}", unavailable=True)
    return None
