"""Command line: run, say, text, check-config (and devices, service, bench, voices)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from s2s_daemon import __version__
from s2s_daemon.config import DaemonConfig, load_config
from s2s_daemon.errors import EXIT_INTERRUPTED, EXIT_OK, DaemonError
from s2s_daemon.logs import configure_logging
from s2s_daemon.tts.threads import prepare_openmp

log = structlog.get_logger(__name__)

EXTENSIONS = ("s2s_daemon.audio.devices", "s2s_daemon.service", "s2s_daemon.bench.cli", "s2s_daemon.tools.voices")
"""Modules that add a subcommand through ``add_parser(subparsers)``."""


def _config_path(value: str | None) -> Path | None:
    raw = value or os.environ.get("S2S_CONFIG")
    return Path(raw) if raw else None


def _load(args: argparse.Namespace, overrides: dict[str, str] | None = None) -> DaemonConfig:
    environ = dict(os.environ)
    environ.update(overrides or {})
    return load_config(_config_path(args.config), environ)


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    configure_logging(config.log.format, config.log.level)
    from s2s_daemon.app import Daemon

    return asyncio.run(Daemon(config).run())


def cmd_check_config(args: argparse.Namespace) -> int:
    """The schema, then every file, folder and port the configuration names (what ``run`` checks
    before the model loads). ``--print``: the effective configuration as YAML on standard output
    (the verdict goes to standard error), ready to be saved and used with ``-c``."""
    from s2s_daemon import preflight

    config = _load(args)
    preflight.require(config, files=not args.schema_only)
    source = _config_path(args.config) or "defaults"
    verdict = f"{source}: valid (engine {config.tts.engine}, model {config.tts.model}, sink {config.audio.sink})"
    if args.schema_only:
        verdict += "; files, folders and ports not checked (--schema-only)"
    if args.print:
        print(verdict, file=sys.stderr)
        print(dump_config(config), end="")
    else:
        print(verdict)
    return EXIT_OK


RESOLVED_MARKER = "# Resolved on this machine"


def dump_config(config: DaemonConfig) -> str:
    """``config`` as YAML that ``load_config`` reads back to the same configuration; what the torch
    engine's ``auto`` settings resolve to on this machine follows as a commented YAML block."""
    import yaml

    header = f"# s2s-daemon {__version__}: the effective configuration (s2s-daemon check-config --print)\n"
    body = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    if config.tts.engine != "torch":
        return header + body
    resolved = yaml.safe_dump({"tts.torch": _resolved_torch(config)}, sort_keys=False, allow_unicode=True)
    comment = "".join(f"#   {line}\n" for line in resolved.splitlines())
    return f"{header}{body}{RESOLVED_MARKER} (what auto means here; a comment, not read back):\n{comment}"


def _resolved_torch(config: DaemonConfig) -> dict[str, object]:
    """The torch engine's ``auto`` settings as this machine resolves them (nothing is loaded or built)."""
    from s2s_daemon.tts.torch_qwen3.options import TorchSection

    section = config.tts.section("torch", TorchSection)
    try:
        from s2s_daemon.tts.torch_qwen3.formats import resolved
    except ImportError as exc:  # a trimmed install without the torch extra
        return {"error": f"the torch extra is not installed: {exc}"}
    from s2s_daemon.pipeline.vocabulary import EngineError

    try:
        return resolved(
            section.device, section.dtype, section.quantization, section.kernels, section.threads, section.isa
        )
    except EngineError as exc:  # a device that is not there (cuda on a CPU box)
        return {"error": str(exc)}


def cmd_say(args: argparse.Namespace) -> int:
    overrides: dict[str, str] = {}
    for flag, key in (
        ("engine", "S2S_TTS__ENGINE"),
        ("model", "S2S_TTS__MODEL"),
        ("dtype", "S2S_TTS__TORCH__DTYPE"),
        ("kernels", "S2S_TTS__TORCH__KERNELS"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    if args.quantization is not None:
        engine = args.engine or os.environ.get("S2S_TTS__ENGINE")
        section = "MLX" if engine == "mlx" or args.quantization.endswith(("bit", "bf16")) else "TORCH"
        overrides[f"S2S_TTS__{section}__QUANTIZATION"] = args.quantization
    config = _load(args, overrides)
    if args.device is not None:  # the device key of the engine that runs
        section = "MLX" if config.tts.engine == "mlx" else "TORCH"
        overrides[f"S2S_TTS__{section}__DEVICE"] = args.device
        config = _load(args, overrides)
    configure_logging(config.log.format, config.log.level)
    from s2s_daemon.say import say_once

    return asyncio.run(say_once(config, args))


def cmd_text(args: argparse.Namespace) -> int:
    """What the text stage makes of a text (docs/text.md): the configuration's ``text:`` section and
    ``--language`` (else ``tts.language``); ``-`` reads standard input as it comes, as a stream."""
    from s2s_daemon.text import TextStage

    config = _load(args)
    stage = TextStage(config.text)
    language = args.language or config.tts.language
    if args.text != "-":
        print(stage.prepare(args.text, language).text)
        return EXIT_OK
    stream = stage.stream(language)
    for line in sys.stdin:
        print(stream.feed(line), end="", flush=True)
    print(stream.close())
    return EXIT_OK


EMBEDDED_GONE = (
    "nothing to clear on {where}: the embedded broker (mqtt.broker: embedded) runs inside the daemon and"
    " keeps its retained messages in memory, so the discovery configs ended with the daemon. Home Assistant"
    " keeps the entities it knew until it is told otherwise: start the daemon with ha.discovery: false"
    " (it clears them on connect), or delete the device in Home Assistant"
)
"""``ha remove`` with the embedded broker and no daemon running: there is no broker to clear."""


def cmd_ha_remove(args: argparse.Namespace) -> int:
    config = _load(args)
    from s2s_daemon.events.discovery import remove_discovery

    if config.mqtt.broker == "embedded" and not _listening(config.mqtt.host, config.mqtt.port):
        print(EMBEDDED_GONE.format(where=f"{config.mqtt.host}:{config.mqtt.port}"))
        return EXIT_OK

    cleared = asyncio.run(remove_discovery(config))
    print(f"cleared {len(cleared)} Home Assistant discovery configs on {config.mqtt.host}:{config.mqtt.port}:")
    for topic in cleared:
        print(f"  {topic}")
    if config.ha.discovery:
        print("note: ha.discovery is true here: a daemon running with it announces them again on its next connect")
    return EXIT_OK


def _listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port`` now."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="s2s-daemon", description="Real-time voice output daemon (MQTT -> Qwen3-TTS -> speaker)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def config_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("-c", "--config", help="YAML configuration file (default: $S2S_CONFIG, else built-in defaults)")

    run = sub.add_parser("run", help="run the daemon")
    config_flag(run)
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check-config", help="validate a configuration file and exit (78 when invalid)")
    check.add_argument("file", nargs="?", help="the file to check (same as -c)")
    config_flag(check)
    check.add_argument(
        "--print", action="store_true", help="print the effective configuration as YAML (to save and use with -c)"
    )
    check.add_argument(
        "--schema-only",
        action="store_true",
        help="check keys and values only, not the files, folders and ports they name"
        " (a configuration for another machine, or for the daemon running now)",
    )
    check.set_defaults(func=cmd_check_config)

    say = sub.add_parser("say", help="synthesize one text through the engine and sink, no broker")
    say.add_argument("text", help="the text, or - to speak standard input as it comes (sentence by sentence)")
    config_flag(say)
    say.add_argument("--engine", help="torch or mlx")
    say.add_argument("--model", help="hub id or local checkpoint folder")
    say.add_argument("--voice")
    say.add_argument("--language")
    say.add_argument("--instruct", help="style instruction (CustomVoice) or voice description (VoiceDesign)")
    say.add_argument("--out", type=Path, help="write a 24 kHz WAV file instead of playing")
    say.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    say.add_argument("--seed", type=int)
    say.add_argument("--dtype", help="torch: float32, bfloat16, float16 or auto")
    say.add_argument("--device", help="torch: auto, cpu, cuda, cuda:N, mps; mlx: auto, metal, cpu")
    say.add_argument("--quantization", help="mlx: 4bit|6bit|8bit|bf16; torch: none|int8|int4")
    say.add_argument("--kernels", choices=["auto", "native", "torch"], help="torch on the CPU: linear kernels")
    say.add_argument("--ref-audio", type=Path, help="reference recording for voice cloning (Base models)")
    say.add_argument("--ref-text", help="transcript of --ref-audio")
    say.set_defaults(func=cmd_say)

    text = sub.add_parser("text", help="print what would be spoken for a text (Markdown, emoji, links, numbers)")
    text.add_argument("text", help="the text, or - to read standard input as a stream")
    config_flag(text)
    text.add_argument("--language", help="en, de, zh, English... (default: tts.language)")
    text.set_defaults(func=cmd_text)

    ha = sub.add_parser("ha", help="Home Assistant MQTT discovery")
    ha_actions = ha.add_subparsers(dest="ha_action", required=True, metavar="ACTION")
    ha_remove = ha_actions.add_parser(
        "remove", help="clear this site's retained discovery configs: Home Assistant removes its entities"
    )
    config_flag(ha_remove)
    ha_remove.set_defaults(func=cmd_ha_remove)

    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a trimmed install without that part
            if exc.name is None or not name.startswith(exc.name):
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prepare_openmp()  # before anything imports torch (tts/threads.py)
    configure_logging("auto", "warning")  # stderr; commands that need more reconfigure
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "file", None) and not getattr(args, "config", None):
        args.config = args.file
    try:
        code: int = args.func(args)
    except DaemonError as exc:
        print(f"s2s-daemon: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before a command's own handler took over (loading)
        print("s2s-daemon: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code
