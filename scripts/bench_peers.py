"""Our torch engine beside its peers on the CPU, in one run: qwentts.cpp (GGML, the PyPI wheel
realtimetts-qwen-native-cpu 0.4.2) at Q8_0 and Q4_K_M, and vox-tts 0.19.5 at q8.

    scripts/peers_prep.sh SCRATCH CKPT QWENTTS_GIT GGML_GIT     # once: the peers, their models
    .venv/bin/python scripts/bench_peers.py --scratch SCRATCH [--frames 100] [--rounds 2] [--doc]

Every run is a fresh process, in this order each round: ours int8, GGML Q8_0, ours int4, GGML
Q4_K_M, vox-tts q8, so the machine's drift hits all alike. Same checkpoint (``SCRATCH/ckpt``, which
the prep links to CKPT; a random-weight CustomVoice one never ends speech, so each call makes
exactly its cap), text, speaker, seed, sampling settings of the checkpoint and thread count.

Ours is the engine as shipped, from this checkout: ``TorchQwen3Engine`` built from a ``tts``
config section through ``engine_options`` (``tts.torch.quantization`` int8 or int4, activations
and ``codec_dtype`` auto, native kernels, ``tts.torch.threads`` fixed, the OpenMP wait the daemon
sets), its prepared-weights cache under SCRATCH (filled by one unmeasured run per format first:
a warm start). The peers' processes are ``scripts/peers_child.py`` in the peers' virtual
environment; both sides follow its protocol: load, then three stream calls (4 frames cold; 4
frames with the first chunk as small as the runtime allows; ``--frames`` frames). Per run:

- steady s/frame with audio: (T(3N/4) - T(N/4)) / frames between, T(F) the arrival of the chunk
  that completes frame F of the N-frame call (load, prefill and first chunk cancel, as
  (T75 - T25) / 50 of two buffered calls did for N = 100); real time is 0.080;
- first chunk s: from the second call to its first audio, with the frames that chunk holds;
- peak RSS: ``ru_maxrss`` of the whole process; load s: the constructor (and ``load_blocking``).

The table gives medians over the rounds and ours / peer; each run's figures are printed as it ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import peers_child  # noqa: E402  # the protocol both sides share; numpy only

from s2s_daemon.bench.machine import load_average, machine_line  # noqa: E402
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table, ratio  # noqa: E402

FRAME_SAMPLES = 1920
"""Samples of one 80 ms codec frame at 24 kHz."""
CODEC = "qwen-tokenizer-12hz"


def model_size(model: Path) -> str:
    """``1.7b`` or ``0.6b``: the checkpoint's ``tts_model_size``, as scripts/peers_prep.sh reads it."""
    return "1.7b" if json.loads((model / "config.json").read_text()).get("tts_model_size") == "1b7" else "0.6b"


def talker(model: Path) -> str:
    """The talker GGUF's name for this checkpoint's size, as scripts/peers_prep.sh names it."""
    return f"qwen-talker-{model_size(model)}-customvoice"


@dataclass(frozen=True, slots=True)
class Side:
    """One runtime at one weight format."""

    name: str
    runtime: str
    """``ours``, ``ggml`` or ``vox``."""
    fmt: str


SIDES = (
    Side("ours int8", "ours", "int8"),
    Side("GGML Q8_0", "ggml", "Q8_0"),
    Side("ours int4", "ours", "int4"),
    Side("GGML Q4_K_M", "ggml", "Q4_K_M"),
    Side("vox-tts q8", "vox", "q8"),
)
PAIRS = (("GGML Q8_0", "ours int8"), ("GGML Q4_K_M", "ours int4"), ("vox-tts q8", "ours int8"))
"""Each peer and the one of ours set beside it in the table."""


@dataclass(frozen=True, slots=True)
class RunFigures:
    """What one run measured."""

    steady_s_per_frame: float | None
    first_chunk_s: float | None
    first_chunk_frames: float | None
    cold_first_chunk_s: float | None
    frames: float
    """Frames of audio the steady call made (its cap, with random weights)."""
    peak_rss_mib: float
    load_s: float


def steady_s_per_frame(rows: Sequence[Sequence[float]], frames: int) -> float | None:
    """Seconds a frame between the chunks that complete frames N/4 and 3N/4 of an N-frame call.

    ``rows``: ``[seconds since the call, samples so far]`` per chunk. None when one chunk holds
    both (too few frames, or a runtime that gives its audio at once)."""
    low, high = frames / 4, 3 * frames / 4

    def arrival(frame: float) -> tuple[float, float] | None:
        for seconds, samples in rows:
            if samples / FRAME_SAMPLES >= frame:
                return seconds, samples / FRAME_SAMPLES
        return None

    start, end = arrival(low), arrival(high)
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def figures(result: dict[str, Any], frames: int) -> RunFigures:
    """A child's ``RESULT`` as the table's figures."""
    calls = result["calls"]
    first = calls["first"][0] if calls["first"] else None
    cold = calls["cold"][0] if calls["cold"] else None
    steady = calls["steady"]
    return RunFigures(
        steady_s_per_frame=steady_s_per_frame(steady, frames),
        first_chunk_s=first[0] if first else None,
        first_chunk_frames=first[1] / FRAME_SAMPLES if first else None,
        cold_first_chunk_s=cold[0] if cold else None,
        frames=(steady[-1][1] if steady else 0) / FRAME_SAMPLES,
        peak_rss_mib=result["peak_rss_mib"],
        load_s=result["load_s"],
    )


def ours(args: argparse.Namespace) -> dict[str, Any]:
    """Our side of one run, in this process: the engine as the daemon builds it from its config."""
    from s2s_daemon.tts.threads import prepare_openmp

    prepare_openmp()  # before torch loads, as the daemon does
    import torch

    from s2s_daemon.config import TtsConfig
    from s2s_daemon.tts.engine import SynthesisRequest
    from s2s_daemon.tts.registry import engine_options
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine
    from s2s_daemon.tts.torch_qwen3.options import TorchSection

    section = TorchSection(device="cpu", quantization=args.child_format, kernels="native", threads=args.threads)
    tts = TtsConfig(model=str(args.model), torch=section, options={"prepared_cache": str(args.cache)})
    options = engine_options(tts)
    engine = TorchQwen3Engine(options)
    start = time.perf_counter()
    info = engine.load_blocking()
    load_s = time.perf_counter() - start
    voice = next(v for v in info.voices if v.lower() == args.speaker.lower())
    language = next(lang for lang in info.languages if lang.lower() == args.language.lower())

    def stream(frames: int, first_small: bool) -> Iterator[Any]:
        # first_small: the engine's first chunk is one frame as shipped (first_chunk_frames), in every call
        options.extra["max_frames"] = str(frames)
        request = SynthesisRequest(args.text, voice, language, chunk_frames=tts.chunk_frames, seed=args.seed)
        yield from engine.synthesize_blocking(request, lambda: False)

    calls = peers_child.run_calls(stream, args.frames)
    # The engine's intra-op threads as its policy sets them (the calling thread's count after the run
    # is whatever the last step left: one while a codec push ran beside it), and the codec worker's.
    policy = engine.threads
    threads = (policy.fixed or policy.default) if policy is not None else torch.get_num_threads()
    worker = engine.codec_worker
    settings = {"weights": info.dtype, "torch_threads": threads, "torch": torch.__version__,
                "codec_threads": worker.threads if worker is not None else None,
                "chunk_frames": tts.chunk_frames}  # fmt: skip
    return {"runtime": "ours", "load_s": round(load_s, 3), "calls": calls, "settings": settings}


def command(side: Side, args: argparse.Namespace, frames: int) -> list[str]:
    """The process that measures ``side``."""
    common = ["--frames", str(frames), "--threads", str(args.threads), "--text", args.text, "--speaker",
              args.speaker, "--language", args.language, "--seed", str(args.seed)]  # fmt: skip
    if side.runtime == "ours":
        return [sys.executable, str(Path(__file__).resolve()), "--scratch", str(args.scratch), "--model",
                str(args.model), "--cache", str(args.cache), "--child-format", side.fmt, *common]  # fmt: skip
    child = [str(args.scratch / "venv" / "bin" / "python"), str(REPO / "scripts" / "peers_child.py")]
    if side.runtime == "ggml":
        models = args.scratch / "models"
        return [*child, "ggml", "--talker", str(models / f"{talker(args.model)}-{side.fmt}.gguf"), "--codec",
                str(models / f"{CODEC}-{side.fmt}.gguf"), *common]  # fmt: skip
    return [*child, "vox", "--tmod", str(args.scratch / "vox" / "model.tmod"), *common]


def run(side: Side, args: argparse.Namespace, frames: int) -> dict[str, Any] | None:
    """One fresh process; its ``RESULT``, or None (its error printed)."""
    proc = subprocess.run(command(side, args, frames), capture_output=True, text=True, check=False,
                          timeout=args.timeout, cwd=str(REPO))  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"{side.name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return None
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def describe_run(got: RunFigures) -> str:
    """One run's figures on one line."""
    steady = "-" if got.steady_s_per_frame is None else f"{got.steady_s_per_frame:.4f}"
    first = "-" if got.first_chunk_s is None else f"{got.first_chunk_s:.3f} s ({got.first_chunk_frames:g} frames)"
    cold = "-" if got.cold_first_chunk_s is None else f"{got.cold_first_chunk_s:.3f} s"
    return (f"steady {steady} s/frame, first chunk {first}, cold {cold}, peak RSS {got.peak_rss_mib:,.0f} MiB,"
            f" load {got.load_s:.2f} s, {got.frames:g} frames")  # fmt: skip


def inputs(args: argparse.Namespace, sides: Sequence[Side]) -> list[Path]:
    """The files the sides read: the checkpoint's weights (ours), the GGUF files, vox-tts's model."""
    paths = [args.model / "model.safetensors", args.model / "speech_tokenizer" / "model.safetensors"]
    for side in sides:
        if side.runtime == "ggml":
            paths += [args.scratch / "models" / f"{m}-{side.fmt}.gguf" for m in (talker(args.model), CODEC)]
        elif side.runtime == "vox":
            paths.append(args.scratch / "vox" / "model.tmod")
    return paths


def missing(args: argparse.Namespace) -> list[str]:
    """What the prep should have made and did not."""
    wanted = [args.scratch / "venv" / "bin" / "python", args.scratch / "vox" / "model.tmod", args.model / "config.json"]
    for side in SIDES:
        if side.runtime == "ggml" and (args.model / "config.json").exists():  # its size names the talker
            wanted += [args.scratch / "models" / f"{m}-{side.fmt}.gguf" for m in (talker(args.model), CODEC)]
    return [str(p) for p in wanted if not p.exists()]


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _shown(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:,.{digits}f}"


def table(results: dict[str, list[RunFigures]]) -> tuple[list[str], list[list[Any]]]:
    """Metrics down, each peer beside ours across, with ours / peer; medians over the rounds."""
    metrics = (
        ("s/frame with audio, steady", "steady_s_per_frame", 4),
        ("first chunk s, warm", "first_chunk_s", 3),
        ("first chunk, frames of audio", "first_chunk_frames", 1),
        ("first chunk s, cold (first call)", "cold_first_chunk_s", 3),
        ("peak RSS MiB", "peak_rss_mib", 0),
        ("load s", "load_s", 2),
        ("frames made (steady call)", "frames", 0),
    )
    header = ["metric"]
    for peer, mine in PAIRS:
        header += [peer, mine, "ours / peer"]
    rows = []
    for label, key, digits in metrics:
        row: list[Any] = [label]
        for peer, mine in PAIRS:
            theirs = _median([getattr(f, key) for f in results.get(peer, [])])
            ours_ = _median([getattr(f, key) for f in results.get(mine, [])])
            row += [_shown(theirs, digits), _shown(ours_, digits), ratio(ours_, theirs)]
        rows.append(row)
    return header, rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=Path, required=True, help="the folder scripts/peers_prep.sh filled")
    parser.add_argument("--model", type=Path, default=None, help="the checkpoint (default: SCRATCH/ckpt)")
    parser.add_argument("--frames", type=int, default=100, help="frames of the steady call (N)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default=",".join(s.name for s in SIDES), help="a subset, comma separated")
    parser.add_argument("--cache", type=Path, default=None, help="our prepared-weights cache (SCRATCH/prepared)")
    parser.add_argument("--text", default="The quick brown fox jumps over the lazy dog near the river.")
    parser.add_argument("--speaker", default="ryan")
    parser.add_argument("--language", default="english")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=1800.0, help="longest run of one process, s")
    parser.add_argument("--child-format", help=argparse.SUPPRESS)
    add_doc_arguments(parser, "peers")
    args = parser.parse_args(argv)
    args.scratch = args.scratch.absolute()
    args.model = (args.model or args.scratch / "ckpt").absolute()
    args.cache = (args.cache or args.scratch / "prepared").absolute()
    return args


def main() -> int:
    args = parse_args()
    if args.child_format:
        result = ours(args)
        result["peak_rss_mib"] = peers_child.peak_rss_mib()
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    doc = doc_target(args)
    chosen = [s for s in SIDES if s.name in args.sides.split(",")]
    print(machine_line(f"threads {args.threads}", f"{args.frames} frames", f"{args.rounds} round(s)",
                       f"model {args.model}"), flush=True)  # fmt: skip
    if gone := missing(args):
        print("not prepared (run scripts/peers_prep.sh SCRATCH CKPT first): " + ", ".join(gone), file=sys.stderr)
        return 2
    started = time.perf_counter()
    for path in inputs(args, chosen):
        with path.open("rb") as fh:
            while fh.read(64 << 20):  # in the page cache for every run, as each side's files would be in use
                pass
    print(f"read every side's files into the page cache: {time.perf_counter() - started:.1f} s", flush=True)
    for fmt in sorted({s.fmt for s in chosen if s.runtime == "ours"}):
        run(Side(f"ours {fmt}", "ours", fmt), args, 2)  # fills the prepared cache (and builds the kernels): unmeasured
    results: dict[str, list[RunFigures]] = {}
    for round_ in range(1, args.rounds + 1):
        for side in chosen:
            load = load_average()
            measured = run(side, args, args.frames)
            if measured is None:
                continue
            got = figures(measured, args.frames)
            results.setdefault(side.name, []).append(got)
            print(f"round {round_} {side.name}: {describe_run(got)}; {json.dumps(measured.get('settings', {}))},"
                  f" version {measured.get('version', 'this checkout')}, load before {load[0] if load else '-'}",
                  flush=True)  # fmt: skip
    header, rows = table(results)
    print()
    print(machine_line(f"median of {args.rounds} round(s)"))
    print(markdown_table(header, rows))
    complete = len(chosen) == len(SIDES) and all(len(results.get(s.name, [])) == args.rounds for s in SIDES)
    if doc is not None and complete:
        rounds = f"{args.rounds} round{'s' if args.rounds != 1 else ''}"
        size = model_size(args.model).upper()
        notes = (
            "One fresh process per run, interleaved (ours int8, GGML Q8_0, ours int4, GGML Q4_K_M, vox-tts q8),"
            f" {rounds}, medians; {args.threads} threads each, the same random {size} CustomVoice checkpoint, text,"
            f" speaker and seed. Steady: (T(3N/4) - T(N/4)) / frames between of an N = {args.frames}-frame stream"
            " call (real time is 0.080 s a frame); first chunk: the second stream call, one frame where the runtime"
            " lets us choose (GGML streams in cpu_stream_frames 2); peak RSS: ru_maxrss. GGML:"
            " realtimetts-qwen-native-cpu 0.4.2, GGUF files from qwentts.cpp's convert.py and tools/quantize;"
            " vox-tts 0.19.5, python -m vox build --dtype bf16 --quant q8. Prepared by scripts/peers_prep.sh."
        )
        doc.publish("Ours beside GGML (qwentts.cpp) and vox-tts", markdown_table(header, rows), notes)
    elif doc is not None:
        print("performance page: not written (not every side ran every round)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
