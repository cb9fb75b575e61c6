"""First audio with a cloned voice: what the clone-prompt cache saves (Base checkpoints).

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/qwen3_06b_base --size 0.6b --kind base
    .venv/bin/python scripts/bench_voices.py /tmp/qwen3_06b_base [--engine torch] [--quantization int8] \\
        [--runs 5] [--processes 1] [--ref-audio WAV --ref-text T] [--json out.json]

The same sentence is spoken with the same recording two ways: as a library voice (``<voices>/<name>/
ref.wav`` + ``ref.txt``, looked up by name as the TTS stage does) and as a plain ``--ref-audio`` path.
Each is measured in three states, each in a fresh process (the engine loaded and warmed up, as the
daemon does before it announces readiness):

- ``cold``: the first request with an empty clone-prompt cache folder: the encoders run;
- ``memory``: later requests of one process (one unmeasured request first, then ``--runs``);
- ``disk``: the first request of a fresh process whose cache folder the ``cold`` run filled.

Per state: ``ttfa_ms``, from the synthesize call (the library look-up included) to the first chunk;
``prepare_ms``, the engine's whole prompt preparation within it; ``clone_ms``, the clone prompt's
share of that (encoders, or a memory or disk hit); ``lookup_ms``, reading the voice's folder (the
library only). The goal reported against: a cached prompt adds under 5 ms (``clone_ms``) where the
encoder run it replaces costs ``cold``'s ``clone_ms``. Random weights never say end-of-speech, so
only the first chunk is made. The machine (CPU model, cores), the load and the date are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from s2s_daemon.bench.machine import machine_record  # noqa: E402  (path set above)
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog near the river."
REF_WAV = REPO / "tests" / "fixtures" / "qwen3_tiny" / "golden" / "ref_espeak_24k.wav"
REF_TEXT = "Good morning. This is a reference recording for voice cloning."
VOICE = "bench"
STATES = ("cold", "memory", "disk")
SOURCES = ("library", "ref-audio")
GOAL_MS = 5.0
"""A cached prompt should add less than this to prompt preparation."""
FIELDS = ("ttfa_ms", "prepare_ms", "clone_ms", "lookup_ms")


# --- the child: one fresh process, one state ---


def _engine(args: argparse.Namespace) -> Any:
    from s2s_daemon.tts.engine import EngineOptions

    extra = {"voice_cache": args.cache}
    if args.threads:
        extra["threads"] = str(args.threads)
    if args.engine == "torch":
        from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

        options = EngineOptions(
            model=args.model,
            device="cpu",
            dtype="float32",
            quantization=args.quantization,
            kernels=args.kernels,
            extra=extra,
        )
        return TorchQwen3Engine(options)
    from s2s_daemon.tts.mlx_qwen3 import MlxQwen3Engine

    return MlxQwen3Engine(EngineOptions(model=args.model, device="cpu", quantization=args.quantization, extra=extra))


class _Timed:
    """Wraps an engine method on the instance and adds up the seconds spent in it."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds = 0.0
        real = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds += time.perf_counter() - started

        setattr(owner, name, timed)


def _clone_counts(engine: Any, name: str) -> tuple[int, int]:
    cache = engine.clone_prompts if name == "torch" else engine._require().clones
    return cache.computed, cache.loaded


def child(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    from s2s_daemon.pipeline.voices import VoiceLibrary
    from s2s_daemon.tts.engine import SynthesisRequest

    engine = _engine(args)
    info = engine.load_blocking()
    if info.mode != "base":
        raise SystemExit(f"{args.model} is a {info.mode} checkpoint; cloning needs a Base one")
    engine.warmup_blocking()
    if args.engine == "torch":
        prepare, clone = _Timed(engine, "prepare"), _Timed(engine.clone_prompts, "get")
    else:
        prepare = None  # mlx-audio builds its prompt inside its generator: not separable
        clone = _Timed(engine, "_clone_prompt")
    library = VoiceLibrary(Path(args.voices), info.mode)
    plain = SynthesisRequest(
        text=args.text, voice=None, language="english", chunk_frames=args.chunk_frames, greedy=True, seed=0
    )

    def once() -> dict[str, float | None]:
        prepare_before = prepare.seconds if prepare is not None else 0.0
        clone_before = clone.seconds
        started = time.perf_counter()
        lookup_ms = None
        if args.source == "library":
            voice = library.lookup(VOICE)
            assert voice is not None and voice.ref_audio is not None
            request = dataclasses.replace(plain, ref_audio=str(voice.ref_audio), ref_text=voice.ref_text)
            lookup_ms = (time.perf_counter() - started) * 1000
        else:
            request = dataclasses.replace(plain, ref_audio=args.ref_audio, ref_text=args.ref_text)
        chunks = engine.synthesize_blocking(request, lambda: False)
        first = next(iter(chunks))
        ttfa_ms = (time.perf_counter() - started) * 1000
        chunks.close()
        assert len(first) > 0
        return {
            "ttfa_ms": ttfa_ms,
            "prepare_ms": (prepare.seconds - prepare_before) * 1000 if prepare is not None else None,
            "clone_ms": (clone.seconds - clone_before) * 1000,
            "lookup_ms": lookup_ms,
        }

    runs = []
    if args.state == "memory":
        once()  # fills the memory cache (and the disk's)
        before = _clone_counts(engine, args.engine)
        runs = [once() for _ in range(args.runs)]
        computed, loaded = (a - b for a, b in zip(_clone_counts(engine, args.engine), before, strict=True))
    else:
        runs = [once()]
        computed, loaded = _clone_counts(engine, args.engine)
    engine.close_blocking()
    return {
        "state": args.state,
        "source": args.source,
        "runs": runs,
        "encoder_runs": computed,
        "disk_loads": loaded,
        "dtype": info.dtype,
    }


# --- the parent: fresh processes, side by side ---


def _median(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in runs if r.get(field) is not None]
    return round(statistics.median(values), 2) if values else None


def run_child(args: argparse.Namespace, state: str, source: str, cache: Path, voices: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        args.model,
        "--child",
        "--state",
        state,
        "--source",
        source,
        "--cache",
        str(cache),
        "--voices",
        str(voices),
        "--engine",
        args.engine,
        "--quantization",
        args.quantization,
        "--kernels",
        args.kernels,
        "--runs",
        str(args.runs),
        "--chunk-frames",
        str(args.chunk_frames),
        "--text",
        args.text,
        "--ref-audio",
        args.ref_audio,
        "--ref-text",
        args.ref_text,
        "--threads",
        str(args.threads or 0),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{state}/{source} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_voices.") as tmp:
        voices = Path(tmp) / "voices"
        (voices / VOICE).mkdir(parents=True)
        shutil.copy(args.ref_audio, voices / VOICE / "ref.wav")
        (voices / VOICE / "ref.txt").write_text(args.ref_text, encoding="utf-8")
        for source in args.sources:
            per_state: dict[str, list[dict[str, Any]]] = {s: [] for s in STATES}
            for _ in range(args.processes):
                cache = Path(tmp) / f"cache-{source}"
                shutil.rmtree(cache, ignore_errors=True)
                for state in STATES:  # cold fills the folder that disk then reads
                    out = run_child(args, state, source, cache, voices)
                    per_state[state].append(out)
                    print(f"  {source:9} {state:6} ttfa {_median(out['runs'], 'ttfa_ms')} ms", file=sys.stderr)
            for state in STATES:
                outs = per_state[state]
                runs = [r for o in outs for r in o["runs"]]
                row = {"state": state, "source": source, "samples": len(runs)}
                row.update({f: _median(runs, f) for f in FIELDS})
                row["encoder_runs"] = sum(o["encoder_runs"] for o in outs)
                row["disk_loads"] = sum(o["disk_loads"] for o in outs)
                row["runs"] = runs
                results.append(row)
    by = {(r["source"], r["state"]): r for r in results}
    cold = [by[(s, "cold")]["clone_ms"] for s in args.sources]
    cached = [by[(s, st)]["clone_ms"] for s in args.sources for st in ("memory", "disk")]
    worst = max(c for c in cached if c is not None)
    return {
        "machine": machine_record(),
        "model": args.model,
        "engine": args.engine,
        "quantization": args.quantization,
        "sources": list(args.sources),
        "text": args.text,
        "ref_audio_s": _duration(args.ref_audio),
        "results": results,
        "goal": {
            "cached_clone_ms_max": worst,
            "encoder_clone_ms": min(c for c in cold if c is not None),
            "limit_ms": GOAL_MS,
            "met": worst < GOAL_MS,
        },
    }


def _duration(path: str) -> float | None:
    import wave

    try:
        with wave.open(path) as w:
            return round(float(w.getnframes()) / float(w.getframerate()), 2)
    except (OSError, wave.Error, EOFError):
        return None


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores, load {m['load1']}, {m['date']}",
        f"{report['engine']} {report['quantization']} {report['model']}; recording {report['ref_audio_s']} s",
        "",
        f"{'state':8}" + "".join(f"| {s + ' ttfa / prepare / clone ms':38}" for s in report["sources"]),
    ]
    by = {(r["source"], r["state"]): r for r in report["results"]}
    for state in STATES:
        cells = []
        for source in report["sources"]:
            r = by[(source, state)]
            cell = f"{r['ttfa_ms']} / {r['prepare_ms']} / {r['clone_ms']} (n={r['samples']}, enc={r['encoder_runs']})"
            cells.append(f"| {cell:38}")
        lines.append(f"{state:8}" + "".join(cells))
    goal = report["goal"]
    lines.append("")
    if ("library", "memory") in by:
        lines.append(f"library folder look-up: {by[('library', 'memory')]['lookup_ms']} ms (memory state, median)")
    lines += [
        f"goal: a cached prompt adds < {goal['limit_ms']} ms; worst cached clone {goal['cached_clone_ms_max']} ms "
        f"vs the encoders' {goal['encoder_clone_ms']} ms: {'met' if goal['met'] else 'NOT met'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a Base checkpoint folder (make_checkpoint --kind base)")
    parser.add_argument("--engine", choices=("torch", "mlx"), default="torch")
    parser.add_argument("--quantization", default="int8", help="torch: none, int8, int4; mlx: 4bit ... bf16")
    parser.add_argument("--kernels", default="auto", help="torch on the CPU: auto, native, torch")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the engine's default)")
    parser.add_argument("--runs", type=int, default=5, help="measured requests of the memory state")
    parser.add_argument("--processes", type=int, default=1, help="fresh processes per cold and disk measurement")
    parser.add_argument("--chunk-frames", type=int, default=4)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--ref-audio", default=str(REF_WAV))
    parser.add_argument("--ref-text", default=REF_TEXT)
    parser.add_argument(
        "--sources",
        type=lambda v: tuple(x for x in v.split(",") if x),
        default=SOURCES,
        help=f"comma-separated, of {', '.join(SOURCES)} (default both)",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    add_doc_arguments(parser, "voices")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state", choices=STATES, help=argparse.SUPPRESS)
    parser.add_argument("--source", choices=SOURCES, help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--voices", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine == "mlx" and args.quantization == "int8":
        args.quantization = "8bit"
    if unknown := [s for s in args.sources if s not in SOURCES]:
        parser.error(f"--sources: unknown {', '.join(unknown)}; choose from {', '.join(SOURCES)}")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    doc = doc_target(args)
    report = measure(args)
    print(table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if doc is not None:
        by = {(r["source"], r["state"]): r for r in report["results"]}
        rows = []
        for source in report["sources"]:
            for state in STATES:
                r = by[(source, state)]
                cold = by[(source, "cold")]["ttfa_ms"]
                rows.append(
                    [source, state, r["ttfa_ms"], ratio(r["ttfa_ms"], cold), r["prepare_ms"], r["clone_ms"],
                     r["lookup_ms"], r["samples"], r["encoder_runs"], r["disk_loads"]]
                )  # fmt: skip
        goal = report["goal"]
        header = ["voice from", "state", "ttfa ms", "/ cold", "prepare ms", "clone ms", "look-up ms", "n",
                  "encoder runs", "disk loads"]  # fmt: skip
        doc.publish(
            "First audio with a cloned voice: what the clone-prompt cache saves",
            markdown_table(header, rows, "llrrrrrrrr"),
            f"{report['engine']} {report['quantization']}, model `{report['model']}`, a {report['ref_audio_s']} s"
            f" recording; medians. cold: the first request with an empty cache (the encoders run); memory: later"
            f" requests of one process; disk: the first request of a fresh process whose cache cold filled. Goal:"
            f" a cached prompt adds < {goal['limit_ms']} ms; worst cached clone {goal['cached_clone_ms_max']} ms"
            f" against the encoders' {goal['encoder_clone_ms']} ms: {'met' if goal['met'] else 'NOT met'}.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
