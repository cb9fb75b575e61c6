"""The YAML configuration: every key validated, unknown keys rejected, frozen."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails

from s2s_daemon.engines import EngineSection, check_engine_name
from s2s_daemon.engines import sections as engine_sections
from s2s_daemon.errors import ConfigError

ENV_PREFIX = "S2S_"
AUTO_VOICE = "auto"
"""``tts.voice: auto``: the model's own default voice."""
NOT_CONFIG_ENV = frozenset(
    {
        "S2S_CONFIG",
        "S2S_BENCH_REFERENCE_PYTHON",
        "S2S_BENCH_DOC",
        "S2S_PREPARED_CACHE",
        "S2S_VOICE_CACHE",
        "S2S_BUILD_LOCK_WAIT_S",
    }
)
"""``S2S_`` variables that are not configuration keys: the file's path, the benchmark's qwen-tts
python, the performance page the benchmarks write (which a daemon they start inherits), the torch
engine's prepared-weights and clone-prompt folders, the bound of a wait for another process's
build (``build_lock.py``)."""
NOT_CONFIG_ENV_PREFIXES = ("S2S_GPU_", "S2S_CONTAINER_")
"""Families of them: ``scripts/gpu_check.sh``'s settings, the container checks' (``scripts/container_base.sh``)."""


def _plain_topic_prefix(value: str) -> str:
    """A topic prefix (ours, Home Assistant's): no wildcards, no leading or trailing slash."""
    if any(c in value for c in "+#") or value.startswith("/") or value.endswith("/"):
        raise ValueError("must not contain + or # or start/end with /")
    return value


TopicPrefix = Annotated[str, Field(min_length=1), AfterValidator(_plain_topic_prefix)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


S = TypeVar("S", bound=EngineSection)


def _moved(err: ErrorDetails, *under: str) -> InitErrorDetails:
    """A validation error of a block, raised again ``under`` its key (with its own words)."""
    moved = InitErrorDetails(type=err["type"], loc=(*under, *err["loc"]), input=err["input"])
    if "ctx" in err:
        moved["ctx"] = err["ctx"]
    return moved


class TlsConfig(Section):
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    insecure: bool = False
    """Skip the server certificate's host name check (testing only)."""


class MqttConfig(Section):
    broker: Literal["external", "embedded"] = "embedded"
    """``embedded``: an in-process loopback broker for a first run; ``external``: mosquitto & co."""
    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    username: str | None = None
    password_file: Path | None = None
    tls: TlsConfig | None = None
    topic_prefix: TopicPrefix = "s2s"
    shared_group: str | None = None
    hermes: bool = False
    qos: Literal[0, 1, 2] = 1
    client_id: str | None = None
    """Defaults to ``s2s-<site_id>``; a stable id keeps the persistent session."""
    session_expiry_s: int = Field(3600, ge=0)
    """How long the broker keeps our session (and queued requests) while we are away."""
    keepalive_s: int = Field(30, ge=5)
    reconnect_max_s: float = Field(30.0, gt=0)

    @field_validator("shared_group")
    @classmethod
    def _group_is_plain(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c in value for c in "/+#")):
            raise ValueError("must be a non-empty name without / + #")
        return value

    @model_validator(mode="after")
    def _tls_and_password(self) -> MqttConfig:
        if self.password_file is not None and self.username is None:
            raise ValueError("password_file needs username")
        return self


class TtsConfig(Section):
    """The engine and what every engine shares; each engine's own block (``tts.torch``, ``tts.mlx``,
    a third party's ``tts.<name>``) is declared by the engine (``engines.py``), validated here with
    the rest and read with ``section``."""

    model_config = ConfigDict(extra="allow", frozen=True)  # the engines' blocks; ``_engine_blocks`` refuses others

    engine: str = "torch"
    """An engine registered through the ``s2s_daemon.engines`` entry points (``engines.py``)."""
    model: str = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
    """Hub id or local folder in the official layout."""
    revision: str | None = None
    voice: str | None = "auto"
    """A preset speaker or a voice of the library (``voices_dir``); ``auto`` (or none): the model's
    own default (``named_voice``)."""
    voices_dir: Path | None = None
    """The voice library: None is ``$XDG_DATA_HOME/s2s-daemon/voices`` (``~/.local/share/s2s-daemon/voices``)."""
    language: str = "auto"
    chunk_frames: int = Field(4, ge=1, le=50)
    """Codec frames (80 ms each) per streamed chunk."""
    max_text_chars: int = Field(2000, ge=1, le=100_000)
    """The longest text a request may have (a streamed one: all its pieces together)."""
    max_instruct_chars: int = Field(1000, ge=1, le=100_000)
    """The longest ``instruct`` a request may have (the engine reads it with every sentence)."""
    stream_idle_s: float = Field(20.0, gt=0, le=3600)
    """A streamed text (``tts/stream``) with no piece for this long and no end is ended: what
    came is spoken, and it finishes ``error`` with ``stream_idle``."""
    warmup: bool = True
    stall_timeout_s: float = Field(30.0, gt=0, le=3600)
    """No chunk from the engine for this long (the first one included: prefill, cold caches) fails
    the request ``engine_error``; an engine thread that then does not return within as long again
    is wedged: the daemon exits 70 for its service manager to restart it."""
    max_utterance_s: float = Field(300.0, gt=0, le=86_400)
    """Engine time one request may take, all its sentences together (time it waits for playback or
    for a streamed text's next piece does not count); past it the request fails ``engine_error``."""
    runaway_margin: float = Field(2.0, ge=0, le=20)
    """A piece of text may take this many times its typical speaking time (plus 1.5 s) before it
    is cut as a runaway, as are a loop and a long silence (``tts/runaway.py``); 0: never cut."""
    max_streams: int = Field(4, ge=1, le=8)
    """Requests synthesized at once: the speaker's one at a time, in order, and callers' (HTTP,
    Wyoming) beside it; 1: one request after another, in queue order."""
    options: dict[str, str] = Field(default_factory=dict)
    """Backend-specific extras passed to the engine as strings."""

    @field_validator("options", mode="before")
    @classmethod
    def _options_as_strings(cls, value: object) -> object:
        # YAML and S2S_ overrides turn `max_frames: 2` into an int: engines get strings.
        if isinstance(value, dict):
            return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items() if v is not None}
        return value

    @property
    def named_voice(self) -> str | None:
        """The voice ``voice`` names; None for ``auto``: the model's own then (``wiring.model_voice``:
        Ryan or its first preset speaker, else the first library voice it can speak, else none)."""
        voice = self.voice
        return None if voice is None or not voice.strip() or voice.strip().lower() == AUTO_VOICE else voice

    @model_validator(mode="wrap")
    @classmethod
    def _engine_blocks(cls, data: Any, handler: ModelWrapValidatorHandler[TtsConfig]) -> TtsConfig:
        """``engine`` is a registered engine (its default too); each registered engine's block is
        validated by the model it declares (its defaults when the file has none); any other key
        that is not a field is unknown. The errors come out together, each at its own key."""
        if not isinstance(data, Mapping):
            return handler(data)
        models = engine_sections()
        blocks: dict[str, Any] = {}
        errors: list[InitErrorDetails] = []
        engine = data.get("engine", cls.model_fields["engine"].default)
        if isinstance(engine, str):  # else the field's own check says what it must be
            try:
                check_engine_name(engine)
            except ValueError as exc:
                errors.append(InitErrorDetails(type="value_error", loc=("engine",), input=engine, ctx={"error": exc}))
        for key, value in data.items():
            name = str(key)
            if name in cls.model_fields:
                continue
            model = models.get(name)
            if model is None:
                errors.append(InitErrorDetails(type="extra_forbidden", loc=(name,), input=value))
                continue
            try:
                blocks[name] = model.model_validate(value)
            except ValidationError as exc:
                errors += [_moved(err, name) for err in exc.errors()]
        blocks |= {name: model() for name, model in models.items() if name not in blocks}
        try:
            validated = handler({**{k: v for k, v in data.items() if str(k) in cls.model_fields}, **blocks})
        except ValidationError as exc:
            if not errors:
                raise
            errors = [_moved(err) for err in exc.errors()] + errors
            raise ValidationError.from_exception_data(cls.__name__, errors) from None
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return validated

    def section(self, name: str, model: type[S]) -> S:
        """Engine ``name``'s block (``tts.<name>``) as ``model``, the ``EngineSection`` it declares;
        the model's defaults when this configuration has none (the engine is not registered here)."""
        found = (self.model_extra or {}).get(name)
        if found is None:
            return model()
        if not isinstance(found, model):
            raise TypeError(f"tts.{name} is a {type(found).__name__}, not a {model.__name__}")
        return found


class QueueConfig(Section):
    max_pending: int = Field(32, ge=1, le=100_000)
    dedup_window: int = Field(4096, ge=16)
    """How many recent request ids are remembered for de-duplication (across restarts with the journal)."""
    resume_max_age_s: float = Field(300.0, ge=0)
    """After a restart, a journaled request older than this is answered ``expired`` instead of spoken."""


class JournalConfig(Section):
    """The request journal: MQTT requests stored before they are acknowledged (survives a crash)."""

    enabled: bool = True
    path: Path | None = None
    """None: ``$STATE_DIRECTORY`` (systemd), else ``$XDG_STATE_HOME/s2s-daemon``, else
    ``~/.local/state/s2s-daemon``; the file ``journal-<site_id>.sqlite3`` there."""
    synchronous: Literal["full", "normal"] = "full"
    """``full``: each commit is fsynced (survives a power cut); ``normal``: survives a process crash only."""


class AudioConfig(Section):
    sink: Literal["auto", "speaker", "wav", "discard"] = "auto"
    device: str | int | None = None
    """Output device name (substring) or index; None is the system default."""
    wav_dir: Path | None = None
    latency_ms: float = Field(80.0, ge=5, le=2000)
    """Audio buffered before playback starts."""
    gapless: bool = True
    """On an engine slower than real time, hold each sentence until it will play without a gap
    (a later start, longer pauses between sentences); false: play as it comes (it stutters)."""
    prebuffer_max_s: float = Field(0.8, ge=0, le=600)
    """The longest the speaker holds an utterance's first sample for audio to buffer ahead of a slow
    engine, counted from its turn on the speaker; past it, it plays what it has, and the pauses
    the engine's speed makes unavoidable fall between clauses and sentences (``gapless``)."""

    @model_validator(mode="after")
    def _wav_needs_dir(self) -> AudioConfig:
        if self.sink == "wav" and self.wav_dir is None:
            raise ValueError("sink 'wav' needs audio.wav_dir")
        return self


class VadConfig(Section):
    enabled: bool = False
    device: str | int | None = None
    aggressiveness: int = Field(2, ge=0, le=3)
    frame_ms: Literal[10, 20, 30] = 20
    policy: Literal["ignore", "wait", "interrupt"] = "ignore"
    start_ms: int = Field(60, ge=10)
    """Voiced audio needed before speech counts as started."""
    stop_ms: int = Field(400, ge=20)
    """Silence needed before speech counts as stopped."""
    max_wait_s: float = Field(10.0, gt=0)
    """Policy ``wait``: longest hold of the next utterance."""


class TelemetryConfig(Section):
    memory_interval_s: float = Field(10.0, gt=0)


class LogConfig(Section):
    format: Literal["auto", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


class ShutdownConfig(Section):
    drain_timeout_s: float = Field(10.0, ge=0)


class HaConfig(Section):
    """Home Assistant MQTT discovery."""

    discovery: bool = False
    """Announce this site to Home Assistant (retained configs); ``false`` clears them on connect."""
    prefix: TopicPrefix = "homeassistant"
    """Home Assistant's discovery prefix (its birth message is ``<prefix>/status``)."""
    name: str | None = Field(None, min_length=1)
    """The device's name in Home Assistant; defaults to ``s2s <site_id>``."""


class HttpConfig(Section):
    """The OpenAI-compatible speech API (``POST /v1/audio/speech``); needs the ``http`` extra."""

    enabled: bool = False
    host: str = Field("127.0.0.1", min_length=1)
    """Loopback by default; ``0.0.0.0`` (or ``::``) serves the network: set ``api_key_file`` then."""
    port: int = Field(5050, ge=1, le=65535)
    """Not 8000/8080/8880: the ports of the LLM and TTS servers that often run beside it."""
    api_key_file: Path | None = None
    """File holding the bearer token clients must send (``Authorization: Bearer ...``); none: open."""
    max_body_bytes: int = Field(1_048_576, ge=1024, le=64 * 1_048_576)
    """Larger request bodies are refused (413)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names answered besides loopback names, IP addresses, ``host`` and this machine's name (a
    reverse proxy's public name); any other ``Host`` is 403 (DNS rebinding). ``"*"``: any."""
    write_timeout_s: float = Field(10.0, gt=0, le=600)
    """A caller that takes no bytes of its answer for this long is cut (its request ends ``interrupted``)."""

    max_connections: int = Field(100, ge=1, le=10_000)
    """Connections open at once; one more is answered 503 ``too_many_connections`` and closed at accept."""
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    """A connection's first request head must be complete within this, else it is closed."""
    body_timeout_s: float = Field(30.0, gt=0, le=3600)
    """A request's body must be complete within this of its head, else 408 and the connection closed."""
    idle_timeout_s: float = Field(60.0, gt=0, le=86_400)
    """A kept-alive connection waiting this long for its next request is closed."""

    @field_validator("allowed_hosts")
    @classmethod
    def _plain_host_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(name.strip().lower().rstrip(".") for name in value)
        for name in names:
            if name != "*" and not re.fullmatch(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?", name):
                raise ValueError(f"{name!r} is not a host name (no scheme, port or path: 'tts.example.org')")
        return names


class MonitorConfig(Section):
    """``GET /health``, ``/ready`` and ``/metrics`` on a listener of their own, for a service manager,
    a container runtime, a load balancer or Prometheus; needs the ``http`` extra. The speech API's
    port (``http.enabled``) serves the same paths: this one is for a daemon without it, or apart."""

    enabled: bool = False
    host: str = Field("127.0.0.1", min_length=1)
    """Loopback by default; ``0.0.0.0`` for a probe or a scraper on another host (a kubelet, Prometheus)."""
    port: int = Field(5051, ge=1, le=65535)
    """Beside the speech API's 5050."""
    max_connections: int = Field(16, ge=1, le=10_000)
    """Connections open at once; one more is answered 503 ``too_many_connections`` and closed at accept."""
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    """A connection's first request head must be complete within this, else it is closed."""
    idle_timeout_s: float = Field(60.0, gt=0, le=86_400)
    """A kept-alive connection waiting this long for its next request is closed."""


class WyomingConfig(Section):
    """The Wyoming TTS server Home Assistant's Assist pipelines use; needs the ``wyoming`` extra."""

    enabled: bool = False
    host: str = Field("0.0.0.0", min_length=1)
    """Every interface: Home Assistant usually runs on another machine. ``127.0.0.1`` when it runs on this one."""
    port: int = Field(10200, ge=1, le=65535)
    """Wyoming's conventional TTS port."""
    zeroconf: bool = True
    """Advertise ``_wyoming._tcp.local.`` (as ``s2s-<site_id>``) so Home Assistant discovers it; not on loopback."""
    max_connections: int = Field(32, ge=1, le=10_000)
    """Connections open at once; one more is answered an ``error`` event and closed at accept."""
    idle_timeout_s: float = Field(60.0, gt=0, le=86_400)
    """A connection with nothing in flight (no request of its own being synthesized or sent) and no
    event for this long is closed."""
    event_timeout_s: float = Field(10.0, gt=0, le=3600)
    """An event must be read whole (header line, data, payload) within this of its first byte."""
    max_event_bytes: int = Field(262_144, ge=4096, le=16 * 1_048_576)
    """The longest event (header line, data and payload together); a longer one is refused with an
    ``error`` event before its body is read, and the connection closed."""


EmojiMode = Literal["drop", "name", "keep"]
NumbersMode = Literal["auto", "all", "off"]
CodeBlocksMode = Literal["skip", "read", "drop"]


class TextConfig(Section):
    """The text stage: what an assistant wrote (Markdown, emoji, links, numbers) made into what
    is spoken (``s2s_daemon/text/``, docs/text.md); a request may override each key (``TextOverrides``)."""

    markdown: bool = True
    """Read Markdown as its words (emphasis, headings, lists, tables, links); false: as written."""
    emoji: EmojiMode = "drop"
    """``drop``: left out; ``name``: said by their name in the request's language; ``keep``: as written."""
    urls: bool = True
    """Web addresses read as their host name, e-mail addresses as a person says them."""
    numbers: NumbersMode = "auto"
    """``auto``: rewrite what the model is known to misread (grouped numbers, times with seconds,
    Chinese numbers) and symbols and units as words; ``all``: every number in words; ``off``: as written."""
    code_blocks: CodeBlocksMode = "skip"
    """``skip``: a short spoken note in their place; ``read``: line by line; ``drop``: nothing."""


class DaemonConfig(Section):
    site_id: str = Field("default", min_length=1)
    mqtt: MqttConfig = MqttConfig()
    tts: TtsConfig = Field(default_factory=dict, validate_default=True)  # validated as given: the engines are read then
    queue: QueueConfig = QueueConfig()
    journal: JournalConfig = JournalConfig()
    audio: AudioConfig = AudioConfig()
    vad: VadConfig = VadConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    log: LogConfig = LogConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    ha: HaConfig = HaConfig()
    http: HttpConfig = HttpConfig()
    wyoming: WyomingConfig = WyomingConfig()
    monitor: MonitorConfig = MonitorConfig()
    text: TextConfig = TextConfig()

    @field_validator("site_id")
    @classmethod
    def _site_is_plain(cls, value: str) -> str:
        if any(c in value for c in "/+#") or value == "pool":
            raise ValueError("must not contain / + # and must not be 'pool'")
        return value

    @model_validator(mode="after")
    def _monitor_port_is_its_own(self) -> DaemonConfig:
        if self.monitor.enabled:
            for name, other in (("http", self.http), ("wyoming", self.wyoming)):
                if other.enabled and other.port == self.monitor.port:
                    raise ValueError(f"monitor.port {self.monitor.port} is {name}.port too: give each its own")
        return self


@dataclass(frozen=True, slots=True)
class EnvOverrides:
    """The ``S2S_`` variables as a tree to merge over the file, and which variable set which key."""

    tree: dict[str, Any]
    origins: dict[tuple[str, ...], str]
    """Key path of every leaf an environment variable set -> ``NAME=value`` as written."""


def _env_overrides(environ: Mapping[str, str]) -> EnvOverrides:
    """``S2S_TTS__ENGINE=mlx`` -> ``{"tts": {"engine": "mlx"}}``; values parse as YAML scalars."""
    tree: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NOT_CONFIG_ENV or name.startswith(NOT_CONFIG_ENV_PREFIXES):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__") if part]
        if not path:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment {name}: {part} is not a section")
            node = child
        node[path[-1]] = value
        for leaf in _leaves(tuple(path), value):
            origins[leaf] = f"{name}={raw}"
    return EnvOverrides(tree, origins)


def _leaves(path: tuple[str, ...], value: Any) -> list[tuple[str, ...]]:
    """The key paths a value sets: itself, or every leaf of a mapping (``S2S_TTS__OPTIONS='{a: 1}'``)."""
    if isinstance(value, Mapping) and value:
        return [leaf for key, child in value.items() for leaf in _leaves((*path, str(key)), child)]
    return [path]


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _has_path(data: Any, loc: tuple[str, ...]) -> bool:
    """Whether the file's mapping holds the key path (YAML keys may be numbers: compared as text)."""
    for part in loc:
        children = [value for key, value in data.items() if str(key) == part] if isinstance(data, dict) else []
        if not children:
            return False
        data = children[0]
    return True


def _blame(loc: tuple[str, ...], file_data: dict[str, Any], file_label: str, env: EnvOverrides) -> str:
    """Who set the key at ``loc``: the variable that set it (or a section above it), else the file.

    An error on a whole section (a model validator) names every variable that set a key beneath
    it, and the file too when the file has that section.
    """
    for end in range(len(loc), 0, -1):
        if (origin := env.origins.get(loc[:end])) is not None:
            return f"{origin} (environment)"
    beneath = [origin for path, origin in env.origins.items() if path[: len(loc)] == loc]
    if not beneath:
        return file_label
    sources = [file_label] if _has_path(file_data, loc) else []
    return " + ".join([*sources, f"{', '.join(beneath)} (environment)"])


def _section_model(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The model of the section at ``loc`` (``("mqtt", "tls")`` -> TlsConfig, ``("tts", "torch")`` ->
    the block the torch engine declares), None when it is not one."""
    model: type[BaseModel] = DaemonConfig
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            block = engine_sections().get(part) if model is TtsConfig else None
            if block is None:
                return None
            model = block
            continue
        candidates = [field.annotation, *get_args(field.annotation)]
        found = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if found is None:
            return None
        model = found
    return model


def _suggest(loc: tuple[str, ...]) -> str:
    """``; did you mean mqtt.port?`` for the unknown key ``mqtt.prot``; empty when nothing is close."""
    model = _section_model(loc[:-1]) if loc else None
    if model is None:
        return ""
    keys = [*model.model_fields, *(engine_sections() if model is TtsConfig else ())]
    close = difflib.get_close_matches(loc[-1], keys, n=1)
    return f"; did you mean {'.'.join((*loc[:-1], close[0]))}?" if close else ""


def _format_error(file_data: dict[str, Any], file_label: str, env: EnvOverrides, exc: ValidationError) -> str:
    """One line per error: its source (the file, or ``NAME=value (environment)``), the key, the reason."""
    lines = ["invalid configuration:"]
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc) or "(top level)"
        message = err["msg"]
        if err["type"] == "value_error":  # our validators' words, without pydantic's "Value error, "
            message = str(err.get("ctx", {}).get("error", message.removeprefix("Value error, ")))
        if err["type"] == "extra_forbidden":
            message = "unknown key" + _suggest(loc)
        lines.append(f"  {_blame(loc, file_data, file_label, env)}: {key}: {message}")
    return "\n".join(lines)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names a key twice: YAML keeps the last one silently, which hides a mistake."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, naming it and its lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if first != line:
                where = ".".join([*self._path(node), str(key)])
                raise DuplicateKeyError(f"{where}: the key is given twice (lines {first} and {line}); keep one")
        return super().construct_mapping(node, deep=deep)

    def _path(self, node: yaml.Node) -> list[str]:
        """The keys leading to ``node`` from the document's root (for the message)."""
        return _paths(self.get_single_node_root(), node) or []

    def get_single_node_root(self) -> yaml.Node | None:
        return getattr(self, "_root", None)

    def compose_document(self) -> yaml.Node | None:
        self._root: yaml.Node | None = super().compose_document()
        return self._root


def _paths(root: yaml.Node | None, target: yaml.Node, path: list[str] | None = None) -> list[str] | None:
    path = path or []
    if root is target:
        return path
    if isinstance(root, yaml.MappingNode):
        for key_node, value_node in root.value:
            found = _paths(value_node, target, [*path, str(key_node.value)])
            if found is not None:
                return found
    return None


def load_config(path: Path | None = None, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """Read YAML (or defaults when ``path`` is None), apply ``S2S_`` overrides, validate."""
    environ = os.environ if environ is None else environ
    data: Any = {}
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read configuration {path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"configuration {path} is not UTF-8: {exc}") from exc
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
        except DuplicateKeyError as exc:
            raise ConfigError(f"configuration {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"configuration {path} is not valid YAML: {exc}") from exc
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"configuration {path}: the top level must be a mapping, not {type(data).__name__}")
    env = _env_overrides(environ)
    try:
        return DaemonConfig.model_validate(_merge(data, env.tree))
    except ValidationError as exc:
        raise ConfigError(_format_error(data, "defaults" if path is None else str(path), env, exc)) from exc
