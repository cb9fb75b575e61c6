"""The ``bench`` subcommand: parse the options, run the benchmark, write the table, JSON and PNG."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from s2s_daemon.bench.machine import load_average, machine_info
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target
from s2s_daemon.bench.report import (
    ConfigSpec,
    build_document,
    load_pyplot,
    render_markdown,
    write_json,
    write_png,
    write_table,
)
from s2s_daemon.bench.runner import BenchSettings, run_benchmark
from s2s_daemon.bench.texts import load_texts
from s2s_daemon.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ConfigError, DaemonError

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
REFERENCE_ENV = "S2S_BENCH_REFERENCE_PYTHON"
"""Environment variable naming the interpreter of the official ``qwen-tts`` environment."""
REFERENCE_NAMES = ("qwen-tts", "reference")
_OPTION_KEYS = ("model", "device", "dtype", "quantization", "kernels", "isa", "revision")
_DEFAULT_QUANTIZATION = {"torch": "auto"}
"""EngineOptions' own default (``6bit``) is an MLX value; torch's default is the daemon's (``auto``)."""

EPILOG = """\
examples:
  s2s-daemon bench --engine torch:dtype=bf16 --engine mlx:quantization=4bit --runs 5
  s2s-daemon bench --engine torch --engine torch:quantization=int8 --engine qwen-tts \\
      --reference-python ~/qwen-tts-env/bin/python --json bench.json --png bench.png

--engine NAME[:key=value,...]: NAME is a registered engine (torch, mlx) or qwen-tts (the
official package, run in its own environment: --reference-python or $S2S_BENCH_REFERENCE_PYTHON).
Keys: model, device, dtype (torch: fp32, bf16, fp16), quantization (torch: auto, none, int8, int4;
mlx: 4bit, 6bit, 8bit, bf16), kernels (torch on the CPU: auto, native, torch), isa (torch on the
CPU: the native kernels' path, tts.torch.isa: auto, generic, avx2, avx512...), revision; label=NAME
names the row; env.VAR=VALUE sets an environment variable of that configuration's process only
(e.g. env.LD_PRELOAD=.../openblas-pthread/libblas.so.3 for MLX on a Linux CPU); other keys go to
the engine's extra options. Each configuration runs in its
own process, loaded once; runs are interleaved so machine drift hits all alike. The last line
names the fastest configuration of the run (lowest RTF) and the settings that select it.
"""


def parse_engine_spec(text: str, model: str, device: str | None, max_frames: int | None) -> ConfigSpec:
    """``torch:dtype=bf16,quantization=int8`` -> a configuration with its engine options."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        msg = f"--engine {text!r}: no engine name"
        raise ValueError(msg)
    engine = "qwen-tts" if name in REFERENCE_NAMES else name
    options: dict[str, Any] = {"model": model}
    if device is not None:
        options["device"] = device
    if engine in _DEFAULT_QUANTIZATION:
        options["quantization"] = _DEFAULT_QUANTIZATION[engine]
    extra: dict[str, str] = {}
    env: dict[str, str] = {}
    label = text
    if max_frames is not None:
        extra["max_frames"] = str(max_frames)
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            msg = f"--engine {text!r}: {item!r} is not key=value"
            raise ValueError(msg)
        if key in _OPTION_KEYS:
            options[key] = value
        elif key == "label":
            label = value
        elif key.startswith("env."):
            env[key.removeprefix("env.")] = value
        else:
            extra[key] = value
    options["extra"] = extra
    if env:
        options["env"] = env
    return ConfigSpec(label=label, engine=engine, options=options)


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` on the main command line's subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="compare engines, quantizations and dtypes on this machine",
        description="Measure time to first audio, real-time factor, load time and peak memory per configuration.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)
    parser.set_defaults(func=handler)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        action="append",
        dest="engines",
        metavar="NAME[:k=v,...]",
        help="a configuration to measure; repeat for several (default: the torch engine's formats for this"
        " machine's device, auto first, and the fastest is recommended)",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="hub id or local checkpoint folder (default: %(default)s)"
    )
    parser.add_argument("--device", default=None, help="device for every configuration that takes one (default: auto)")
    parser.add_argument(
        "--texts",
        default="builtin",
        help="builtin (6 sentences: short, medium, long; en/zh/de/fr), a size list such as short,medium, "
        "or a file with one text per line, optionally 'language<TAB>text' (default: %(default)s)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed passes over the texts (default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed syntheses per configuration after loading (default: %(default)s)"
    )
    parser.add_argument("--chunk-frames", type=int, default=4, help="codec frames per chunk (default: %(default)s)")
    parser.add_argument(
        "--max-frames",
        type=int,
        default=None,
        help="cap on codec frames per utterance, passed as the engine option max_frames (default: engine budget)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every synthesis (decoding is greedy)")
    parser.add_argument("--voice", default=None, help="speaker (default: the first configuration's first voice)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure and run as JSON")
    parser.add_argument(
        "--png", type=Path, default=None, metavar="FILE", help="write a latency and memory chart (needs matplotlib)"
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="add the official qwen-tts package as a configuration when its environment exists",
    )
    parser.add_argument(
        "--reference-python",
        default=os.environ.get(REFERENCE_ENV),
        metavar="PATH",
        help=f"python of the environment holding qwen-tts (default: ${REFERENCE_ENV})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_doc_arguments(parser, "bench")
    parser.add_argument("--load-timeout-s", type=float, default=1800.0, help=argparse.SUPPRESS)
    parser.add_argument("--run-timeout-s", type=float, default=900.0, help=argparse.SUPPRESS)
    # For tests and plugins: MODULE:FUNCTION called in every worker before create_engine
    # (e.g. tests.support.tone_engine:register makes the `tone` engine available).
    parser.add_argument("--plugin", action="append", default=[], help=argparse.SUPPRESS)


def handler(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every run succeeded, 1 when any failed or it was interrupted, 78 on bad options
    (an output file that cannot be written included), 69 when ``--png`` finds no matplotlib.

    Ctrl-C or SIGTERM stops it early; the table, JSON and PNG then cover the runs finished so far.
    """
    try:
        settings = settings_from_args(args)
        check_outputs(args)
        doc = doc_target(args)
    except ValueError as exc:  # PageError too: the page's markers or folder
        sys.stderr.write(f"s2s-daemon bench: {exc}\n")
        return EXIT_CONFIG
    except DaemonError as exc:
        sys.stderr.write(f"s2s-daemon bench: {exc}\n")
        return exc.exit_code
    machine = machine_info()
    if any(config.engine == "torch" for config in settings.configs):
        machine["native_kernels"] = native_kernels_here()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        outcome = run_benchmark(settings, progress_stream=None if args.no_progress else sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
    results = outcome.results
    machine["load_average_end"] = load_average()
    record = settings_record(args, settings)
    record["interrupted"] = outcome.interrupted
    document = build_document(results, settings.texts, record, machine)
    write_table(document, sys.stdout)
    if outcome.interrupted:
        sys.stdout.write("INTERRUPTED: the figures cover only the runs finished before the stop.\n")
    written = True
    for flag, path, write in (("--json", args.json, write_json), ("--png", args.png, write_png)):
        if path is None:
            continue
        try:
            write(document, path)
        except (OSError, DaemonError) as exc:  # checked before the first run; a full disk can still fail here
            sys.stderr.write(f"s2s-daemon bench: {flag} {path}: {exc}\n")
            written = False
    if doc is not None and not outcome.interrupted:
        table, notes = render_markdown(document)
        try:
            doc.publish("Engines side by side (s2s-daemon bench)", table, notes)
        except (OSError, ValueError) as exc:  # checked before the first run; the page can still change meanwhile
            sys.stderr.write(f"s2s-daemon bench: --doc {doc.path}: {exc}\n")
            written = False
    failed = any(not r.ok or any(not run.ok for run in r.records) for r in results)
    return EXIT_FAILURE if failed or outcome.interrupted or not written else EXIT_OK


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before the first run, not after the last: ``--png`` needs matplotlib, output files must be writable.

    Raises UnavailableError (exit 69) for a missing matplotlib, ConfigError (exit 78) for a file
    that cannot be written.
    """
    if args.png is not None:
        load_pyplot()
    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path is not None:
            _check_writable(flag, path)


def _check_writable(flag: str, path: Path) -> None:
    """Open the file as the end will, leaving it as it was: a new file is removed, an old one untouched."""
    try:
        try:
            with path.open("x"):
                pass
        except FileExistsError:
            with path.open("a"):  # appending nothing changes neither its content nor its time
                pass
        else:
            path.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from exc


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM ends the benchmark like Ctrl-C: stop, kill the workers, report what was measured."""
    raise KeyboardInterrupt


def default_engines(device: str | None) -> list[str]:
    """Without ``--engine``: the torch engine's formats for this machine's device, ``auto`` (the
    daemon's default) first, so that the run recommends one (``report.recommend``)."""
    try:
        import torch
    except ImportError:
        return ["torch"]
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda"):
        return ["torch", "torch:dtype=fp16", "torch:dtype=fp32"]
    if kind == "mps":
        return ["torch", "torch:dtype=fp16"]
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:  # no native kernels: float32 is what there is
        return ["torch"]
    return ["torch", "torch:quantization=int4", "torch:quantization=none"]


def native_kernels_here() -> str | None:
    """The torch engine's native CPU kernels on this machine for the machine line: the path ``auto``
    runs and why (``avx512 (auto: cpu has avx512_vnni)``), why there are none, or None without torch."""
    try:
        from s2s_daemon.tts.torch_qwen3 import native
    except ImportError:
        return None
    kernels = native.load() if native.why_not_here() is None else None
    return f"{kernels.isa} ({kernels.isa_reason})" if kernels is not None else f"none ({native.why_not_here()})"


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    for name in ("runs", "chunk_frames"):
        if getattr(args, name) < 1:
            msg = f"--{name.replace('_', '-')} must be at least 1"
            raise ValueError(msg)
    if args.warmup < 0:
        msg = "--warmup must be 0 or more"
        raise ValueError(msg)
    if args.max_frames is not None and args.max_frames < 1:
        msg = "--max-frames must be at least 1"
        raise ValueError(msg)
    engines = args.engines or default_engines(args.device)
    specs = [parse_engine_spec(s, args.model, args.device, args.max_frames) for s in engines]
    if args.reference and not any(s.is_reference for s in specs):
        if args.reference_python and os.access(args.reference_python, os.X_OK):
            specs.append(parse_engine_spec("qwen-tts", args.model, args.device, args.max_frames))
        else:
            sys.stderr.write(
                f"s2s-daemon bench: no qwen-tts environment (--reference-python or ${REFERENCE_ENV}); "
                "running without the official package\n"
            )
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        msg = f"--engine given twice with the same value: {labels}"
        raise ValueError(msg)
    return BenchSettings(
        configs=tuple(specs),
        texts=load_texts(args.texts),
        runs=args.runs,
        warmup=args.warmup,
        chunk_frames=args.chunk_frames,
        seed=args.seed,
        voice=args.voice,
        plugins=tuple(args.plugin),
        reference_python=args.reference_python,
        load_timeout_s=args.load_timeout_s,
        run_timeout_s=args.run_timeout_s,
    )


def settings_record(args: argparse.Namespace, settings: BenchSettings) -> dict[str, Any]:
    """The settings as the JSON document records them."""
    return {
        "command": sys.argv,
        "model": args.model,
        "device": args.device,
        "texts": args.texts,
        "runs": settings.runs,
        "warmup": settings.warmup,
        "chunk_frames": settings.chunk_frames,
        "max_frames": args.max_frames,
        "seed": settings.seed,
        "greedy": True,
        "voice": settings.voice,
        "schedule": "interleaved: for each run, for each text, one synthesis per configuration in order",
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m s2s_daemon.bench``: the subcommand on its own."""
    parser = argparse.ArgumentParser(
        prog="s2s-daemon bench", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure_parser(parser)
    return handler(parser.parse_args(argv))
