"""Sound devices as PortAudio sees them: listing, choosing by name or index, ``s2s-daemon devices``."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import platform
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import structlog

from s2s_daemon.audio.sink import AudioDeviceError
from s2s_daemon.errors import EXIT_OK, EXIT_UNAVAILABLE

log = structlog.get_logger(__name__)

Direction = Literal["input", "output"]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One PortAudio device."""

    index: int
    name: str
    hostapi: str
    max_input_channels: int
    max_output_channels: int
    default_rate_hz: float
    """The device's default sample rate in hertz; the speaker resamples to it."""
    default_input: bool = False
    default_output: bool = False

    def has(self, direction: Direction) -> bool:
        return (self.max_input_channels if direction == "input" else self.max_output_channels) > 0


VARIADIC_IN_REGISTERS = frozenset({"x86_64", "amd64", "aarch64", "arm64"})
"""Linux ABIs that pass a variadic integer or pointer argument where a named one would go, so that
the handler can read ALSA's first arguments as extra named ones (System V x86-64, AAPCS64)."""
_ALSA_ARGS = 3
"""Integer or pointer arguments of ALSA's format read; a message that needs more (or a float) is
logged with its format as it is."""
_ALSA_ERROR = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, *[ctypes.c_void_p] * _ALSA_ARGS
)
"""``snd_lib_error_handler_t``: ``(file, line, function, err, fmt, ...)``, its first variadic arguments
taken as named ones where the ABI allows (``VARIADIC_IN_REGISTERS``)."""
_CONVERSION = re.compile(r"%[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|z|j|t)?([diouxXcsp%])")
_JACK_MESSAGE = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_C_HANDLERS: list[Any] = []
"""The installed C callbacks, kept alive for the life of the process."""


def _text(raw: bytes | None) -> str:
    return raw.decode(errors="replace").strip() if raw else ""


def format_c(fmt: str, args: Sequence[int | None]) -> str:
    """``fmt`` with its ``%s``/``%d``-style conversions filled from raw integer or pointer ``args``;
    the format unchanged when it needs more of them, or one this cannot read."""
    conversions = [m for m in _CONVERSION.finditer(fmt) if m.group(1) != "%"]
    if len(conversions) > len(args):
        return fmt
    values = iter(args)

    def fill(match: re.Match[str]) -> str:
        kind = match.group(1)
        if kind == "%":
            return "%"
        raw = next(values) or 0
        if kind == "s":
            return ctypes.string_at(raw).decode(errors="replace") if raw else "(null)"
        if kind == "c":
            return chr(raw & 0xFF)
        if kind == "p":
            return hex(raw)
        if kind in "di":
            bits = 64 if match.group(0)[-2:-1] in ("l", "z", "j", "t") else 32
            value = raw & ((1 << bits) - 1)
            return str(value - (1 << bits) if value >> (bits - 1) else value)
        return format(raw, {"o": "o", "x": "x", "X": "X"}.get(kind, "d"))

    return _CONVERSION.sub(fill, fmt)


def _alsa_message(
    file: bytes | None, line: int, function: bytes | None, err: int, fmt: bytes | None, *args: int | None
) -> None:
    # Runs on whichever thread ALSA is on (PortAudio's among them): only a log line, nothing shared.
    text = _text(fmt)
    if platform.machine().lower() in VARIADIC_IN_REGISTERS:
        text = format_c(text, args)
    log.warning(
        "alsa_message",
        message=text,
        function=_text(function),
        where=f"{_text(file)}:{line}",
        error=os.strerror(abs(err)) if err else None,
    )


def _jack_message(text: bytes | None) -> None:
    # PortAudio probes JACK on every start: "Cannot connect to server socket" is no news without it.
    log.debug("jack_message", message=_text(text))


def route_native_messages() -> None:
    """Route what ALSA and JACK print on standard error from C (``ALSA lib pcm.c:8545:(snd_pcm_recover)
    underrun occurred``, JACK's "Cannot connect to server socket" while PortAudio probes it) into the
    daemon's log. Installed once, before PortAudio loads them; a library that is not there is skipped."""
    if _C_HANDLERS or not sys.platform.startswith("linux"):
        return
    for name, setter, kind, handler in (
        ("asound", "snd_lib_error_set_handler", _ALSA_ERROR, _alsa_message),
        ("jack", "jack_set_error_function", _JACK_MESSAGE, _jack_message),
        ("jack", "jack_set_info_function", _JACK_MESSAGE, _jack_message),
    ):
        found = ctypes.util.find_library(name)
        if found is None:
            continue
        try:
            library = ctypes.CDLL(found)
            install = getattr(library, setter)
        except (OSError, AttributeError):
            continue
        callback = kind(handler)
        install(callback)
        _C_HANDLERS.append(callback)


def portaudio() -> ModuleType:
    """Import ``sounddevice``; a missing extra or PortAudio library is an ``AudioDeviceError``."""
    route_native_messages()
    try:
        import sounddevice
    except ImportError as exc:
        raise AudioDeviceError("sounddevice is not installed: install the 'audio' extra (s2s-daemon[audio])") from exc
    except OSError as exc:  # sounddevice raises OSError when the PortAudio library is missing
        raise AudioDeviceError(f"PortAudio is not available ({exc}): install libportaudio2") from exc
    module: ModuleType = sounddevice
    return module


def list_devices() -> list[DeviceInfo]:
    """Every device PortAudio knows, in index order."""
    sd = portaudio()
    try:
        raw: Any = sd.query_devices()
        hostapis: Any = sd.query_hostapis()
    except sd.PortAudioError as exc:
        raise AudioDeviceError(f"cannot list sound devices: {exc}") from exc
    default_in, default_out = _defaults(sd)
    devices = []
    for entry in raw:
        index = int(entry["index"])
        devices.append(
            DeviceInfo(
                index=index,
                name=str(entry["name"]),
                hostapi=str(hostapis[entry["hostapi"]]["name"]),
                max_input_channels=int(entry["max_input_channels"]),
                max_output_channels=int(entry["max_output_channels"]),
                default_rate_hz=float(entry["default_samplerate"]),
                default_input=index == default_in,
                default_output=index == default_out,
            )
        )
    return devices


def _defaults(sd: ModuleType) -> tuple[int, int]:
    try:
        pair = sd.default.device
        return int(pair[0]), int(pair[1])
    except (TypeError, ValueError, IndexError):
        return -1, -1


def resolve_device(spec: str | int | None, direction: Direction) -> DeviceInfo:
    """The device named by ``spec``: None is the system default, an int (or digits) an index,
    a string an exact name or else a unique case-insensitive substring."""
    devices = [d for d in list_devices() if d.has(direction)]
    if not devices:
        raise AudioDeviceError(f"no sound {direction} device found; {no_devices_hint()[0]}")
    if spec is None:
        for device in devices:
            if device.default_input if direction == "input" else device.default_output:
                return device
        return devices[0]
    if isinstance(spec, int) or spec.strip().isdigit():
        index = int(spec)
        for device in devices:
            if device.index == index:
                return device
        raise AudioDeviceError(f"no {direction} device with index {index}; available: {_names(devices)}")
    exact = [d for d in devices if d.name == spec]
    if exact:
        return exact[0]
    matches = [d for d in devices if spec.lower() in d.name.lower()]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise AudioDeviceError(f"no {direction} device named {spec!r}; available: {_names(devices)}")
    raise AudioDeviceError(f"{direction} device {spec!r} is ambiguous: {_names(matches)}")


def _names(devices: list[DeviceInfo]) -> str:
    return ", ".join(f"{d.index}: {d.name!r}" for d in devices)


ALSA_PULSE_PLUGIN = "libasound_module_pcm_pulse.so"
"""ALSA's ``pulse`` device (Debian: libasound2-plugins): how PortAudio reaches PulseAudio and PipeWire."""
ALSA_PLUGIN_DIRS = ("/usr/lib/*/alsa-lib", "/usr/lib/alsa-lib", "/usr/lib64/alsa-lib")
NO_SPEAKER = "a box without one can still serve: audio.sink: wav (with audio.wav_dir) or discard"


def no_devices_hint(
    platform: str | None = None,
    dev_snd: Path = Path("/dev/snd"),
    environ: Mapping[str, str] | None = None,
    plugin_dirs: tuple[str, ...] = ALSA_PLUGIN_DIRS,
) -> list[str]:
    """What to install or start when PortAudio lists no device at all."""
    platform = sys.platform if platform is None else platform
    env = os.environ if environ is None else environ
    if platform == "darwin":
        return ["CoreAudio lists no device: connect one or pick one in System Settings > Sound", NO_SPEAKER]
    if not platform.startswith("linux"):
        return [NO_SPEAKER]
    runtime = env.get("XDG_RUNTIME_DIR", "")
    sockets = [Path(runtime) / "pulse" / "native", Path(runtime) / "pipewire-0"] if runtime else []
    server = bool(env.get("PULSE_SERVER")) or any(p.exists() for p in sockets)
    card = dev_snd.is_dir() and any(dev_snd.glob("pcm*"))
    plugin = any(glob.glob(os.path.join(d, ALSA_PULSE_PLUGIN)) for d in plugin_dirs)
    hints = []
    if server and not plugin:
        hints.append(
            "a sound server runs for this user, but ALSA's pulse plugin that PortAudio reaches it through is"
            " missing: sudo apt-get install libasound2-plugins (Fedora: alsa-plugins-pulseaudio)"
        )
    elif not server and not card:
        hints.append(
            "no sound card (/dev/snd) and no sound server for this user"
            + (f" (nothing at {sockets[0]})" if sockets else " (XDG_RUNTIME_DIR is not set)")
            + ": start PipeWire or PulseAudio in your session (systemctl --user start pipewire pipewire-pulse,"
            " or pulseaudio --start; sudo apt-get install pipewire-pulse or pulseaudio), or plug in a sound card"
        )
    elif card and not server:
        hints.append(
            f"{dev_snd} exists but PortAudio opened nothing: this user may not be allowed to use it"
            " (sudo usermod -aG audio $USER, then log in again), or start PipeWire or PulseAudio"
        )
    hints.append(NO_SPEAKER)
    return hints


def format_table(devices: list[DeviceInfo]) -> str:
    lines = [f"{'idx':>3}  {'in':>3} {'out':>3}  {'rate':>6}  {'default':<8} {'host api':<10} name"]
    for d in devices:
        default = ",".join(k for k, v in (("in", d.default_input), ("out", d.default_output)) if v)
        lines.append(
            f"{d.index:>3}  {d.max_input_channels:>3} {d.max_output_channels:>3}  {d.default_rate_hz:>6.0f}  "
            f"{default:<8} {d.hostapi:<10} {d.name}"
        )
    return "\n".join(lines)


def _run_devices(args: argparse.Namespace) -> int:
    try:
        devices = list_devices()
    except AudioDeviceError as exc:
        sys.stderr.write(f"s2s-daemon devices: {exc}\n")
        return EXIT_UNAVAILABLE
    if args.json:
        sys.stdout.write(json.dumps([asdict(d) for d in devices], indent=2) + "\n")
        return EXIT_OK
    if not devices:
        sys.stdout.write("no sound devices found\n")
        for line in no_devices_hint():
            sys.stdout.write(f"  {line}\n")
        return EXIT_OK
    sys.stdout.write(format_table(devices) + "\n")
    sys.stdout.write("Use the index or (part of) the name as audio.device or vad.device.\n")
    return EXIT_OK


def add_parser(subparsers: Any) -> None:
    """Register ``s2s-daemon devices`` on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "devices", help="list sound devices (for audio.device and vad.device)", description="List sound devices."
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_run_devices)
