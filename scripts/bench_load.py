"""Measure what loading the torch engine costs per weight format: load seconds and peak RSS.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/lean/cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_load.py /tmp/lean/cv06 [--formats fp32,bf16,int8,int4] [--rounds 1]
        [--cache /tmp/lean/prepared] [--phases]

Every run is a fresh subprocess (2 threads, native kernels) that loads the engine, synthesizes one
short sentence (8 frames, greedy) and reports:

- ``load_s``: ``load_blocking`` from the call to its return (tokenizer, weights, codec);
- ``rss_load_mib``: VmRSS right after loading (anonymous + file-backed pages);
- ``anon_load_mib`` / ``file_load_mib``: its anonymous and file-backed parts (mapped prepared
  weights are file-backed: shared with the page cache, dropped under pressure without swap);
- ``peak_rss_mib``: ``ru_maxrss`` of the whole process at the end, the figure GGML's is quoted as.

Per format, a *cold* run starts with an empty prepared-weights cache (``--cache``, removed first:
the engine converts from the checkpoint and writes the cache) and a *warm* run then finds it.
``--no-cache`` measures loading with the cache off (``prepared_cache: "0"``). The checkpoint files
are in the page cache for every run (as they were for GGML's figures): these are not cold-disk times.

``--phases`` prints, per load step, the RSS after it and the highest RSS during it (sampled every
5 ms), to see where a peak comes from.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s2s_daemon.bench.machine import load_average, machine_line
from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table

TEXT = "Hello there, this is a short test."
FORMATS = {
    "fp32": {"dtype": "float32", "quantization": "none"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
}
GGML: dict[str, tuple[str, tuple[int, ...], tuple[float, ...]]] = {
    "fp32": ("F32", (9085,), (20.3, 20.5)),
    "bf16": ("BF16", (5350,), (12.4, 10.6)),
    "int8": ("Q8_0", (3253, 3625), (3.6, 2.5)),
    "int4": ("Q4_K_M", (2514, 2886), (2.4, 2.0)),
}
"""qwentts.cpp (GGML) figures quoted from ../shared/PEERS.md ("qwentts.cpp (GGML) vs our torch engine,
CPU, 2026-12-01"): this project's machine kind (2-core AMD EPYC, AVX2), the PyPI wheel
realtimetts-qwen-native-cpu 0.4.2, 2 threads, a random 0.6B CustomVoice checkpoint stored as float32,
one fresh process per run; peak RSS MiB = ru_maxrss (the range of its runs), load s for two runs."""


def ggml_cells(fmt: str, peak_rss_mib: float) -> list[str]:
    """GGML's format, peak RSS and load seconds as printed, and our peak RSS over GGML's."""
    name, peaks, loads = GGML[fmt]
    over = "-".join(f"{peak_rss_mib / p:.2f}" for p in sorted(peaks, reverse=True)) + "x"
    return [name, "-".join(f"{p:,}" for p in peaks), ", ".join(f"{s}" for s in loads), over]


def _status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process in KiB."""
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0])
    return out


def rss_by_mapping(top: int = 8) -> list[str]:
    """The largest resident parts of this process by what is mapped (a file, or anonymous memory)."""
    sizes: dict[str, int] = {}
    name = "?"
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else "[anonymous]"
                if name.startswith("/") and ".so" in name:
                    name = "[shared libraries]"
            elif head[0] == "Rss:":
                sizes[name] = sizes.get(name, 0) + int(head[1])
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return [f"{kib / 1024:7.0f} MiB  {what}" for what, kib in ranked]


class _Phases:
    """RSS after each wrapped load step and the highest sampled during it."""

    def __init__(self) -> None:
        self.peak = 0
        self.stop = threading.Event()
        self.rows: list[tuple[str, float, int, int]] = []
        self.t0 = time.perf_counter()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, _status()["VmRSS"])

    def wrap(self, owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.peak = _status()["VmRSS"]
            try:
                return fn(*args, **kwargs)
            finally:
                now = _status()["VmRSS"]
                self.rows.append((name, time.perf_counter() - self.t0, now, max(self.peak, now)))

        setattr(owner, name, wrapped)

    def report(self) -> list[str]:
        return [
            f"{n:<22} t={t:6.2f}s  rss {r / 1024:7.0f} MiB  peak in step {p / 1024:7.0f} MiB"
            for n, t, r, p in self.rows
        ]


def run_one(model: str, fmt: str, threads: int, cache: str, phases: bool) -> dict[str, Any]:
    import torch

    from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

    torch.set_num_threads(threads)
    tracer = None
    if phases:
        from s2s_daemon.tts.torch_qwen3 import engine, native, prepared

        tracer = _Phases()
        steps = ((engine.TorchQwen3Engine, "_load_tokenizer"), (engine.TorchQwen3Engine, "_weight_format"),
                 (prepared, "_write_entry"), (prepared, "_open_entry"), (prepared, "_prepare"),
                 (native, "fuse_stacks"), (prepared, "load_talker"), (engine, "load_weights"),
                 (engine.TorchQwen3Engine, "_load_codec"))  # fmt: skip
        for owner, name in steps:
            tracer.wrap(owner, name)
    opts = FORMATS[fmt]
    before = _status()["VmRSS"]
    engine_ = TorchQwen3Engine(
        EngineOptions(
            model=model,
            device="cpu",
            dtype=opts["dtype"],
            quantization=opts["quantization"],
            kernels="native",
            extra={"max_frames": "8", "threads": str(threads), "prepared_cache": cache},
        )
    )
    t0 = time.perf_counter()
    info = engine_.load_blocking()
    load_s = time.perf_counter() - t0
    after = _status()
    peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    request = SynthesisRequest(text=TEXT, voice=info.voices[0] if info.voices else None, language="english",
                               chunk_frames=4, greedy=True)  # fmt: skip
    t0 = time.perf_counter()
    samples = sum(len(c) for c in engine_.synthesize_blocking(request, lambda: False))
    synth_s = time.perf_counter() - t0
    end = _status()
    row = {
        "format": fmt,
        "load_s": round(load_s, 2),
        "rss_import_mib": round(before / 1024),
        "rss_load_mib": round(after["VmRSS"] / 1024),
        "anon_load_mib": round(after["RssAnon"] / 1024),
        "file_load_mib": round(after["RssFile"] / 1024),
        "peak_load_mib": round(peak_load / 1024),
        "rss_end_mib": round(end["VmRSS"] / 1024),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "frames": samples // 1920,
        "synth_s": round(synth_s, 2),
    }
    if tracer is not None:
        tracer.stop.set()
        row["phases"] = [*tracer.report(), "resident at the end, by mapping:", *rss_by_mapping()]
    return row


def child(model: str, fmt: str, threads: int, cache: str, phases: bool) -> dict[str, Any] | None:
    cmd = [sys.executable, str(Path(__file__).resolve()), model, "--child", fmt, "--threads", str(threads),
           "--cache", cache] + (["--phases"] if phases else [])  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"{fmt}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return None
    row: dict[str, Any] = json.loads(lines[-1])
    load = load_average()
    row["load_avg"] = round(load[0], 2) if load else None
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (e.g. a 0.6b random checkpoint from make_checkpoint)")
    parser.add_argument("--formats", default="fp32,bf16,int8,int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="cold + warm pairs per format")
    parser.add_argument("--cache", default="/tmp/s2s-bench-prepared", help="prepared-weights cache folder")
    parser.add_argument("--no-cache", action="store_true", help="load with the prepared cache off")
    parser.add_argument("--phases", action="store_true", help="RSS per load step")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_doc_arguments(parser, "load")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.model, args.child, args.threads, args.cache, args.phases)))
        return 0
    doc = doc_target(args)
    cache = "0" if args.no_cache else args.cache
    print(f"machine: {machine_line(f'threads {args.threads}', f'model {args.model}', f'cache {cache}')}", flush=True)
    rows = []
    for _ in range(args.rounds):
        for fmt in args.formats.split(","):
            runs = ("off",) if args.no_cache else ("cold", "warm")
            for run in runs:
                if run == "cold":
                    shutil.rmtree(args.cache, ignore_errors=True)
                row = child(args.model, fmt, args.threads, cache, args.phases)
                if row is None:
                    continue
                row["run"] = run
                for line in row.pop("phases", []):
                    print(f"  {fmt} {run}: {line}")
                print(json.dumps(row), flush=True)
                rows.append(row)
    print()
    print(
        "format | run | load s | RSS after load MiB (anon + file) | peak RSS MiB | load avg"
        " | GGML format | GGML peak RSS MiB | GGML load s"
    )
    cells = []
    for row in rows:
        g = ggml_cells(row["format"], row["peak_rss_mib"])
        rss = f"{row['rss_load_mib']} ({row['anon_load_mib']} + {row['file_load_mib']})"
        print(f"{row['format']} | {row['run']} | {row['load_s']} | {rss} | {row['peak_rss_mib']} | {row['load_avg']}"
              f" | {g[0]} | {g[1]} | {g[2]}")  # fmt: skip
        cells.append([row["format"], row["run"], row["load_s"], rss, row["peak_rss_mib"], row["load_avg"], *g])
    print("GGML: ../shared/PEERS.md, 2026-12-01, this machine kind (2-core AMD EPYC, AVX2), float32 checkpoint.")
    if doc is not None:
        header = ["format", "run", "load s", "RSS after load MiB (anon + file)", "peak RSS MiB", "load avg",
                  "GGML format", "GGML peak RSS MiB", "GGML load s", "peak RSS / GGML's"]  # fmt: skip
        doc.publish(
            "Loading the torch engine per weight format: load time and memory",
            markdown_table(header, cells, "llrrrrlrrr"),
            f"A fresh process per run ({args.threads} threads, native kernels) loads the engine and says one short"
            " sentence (8 frames); cold: the prepared-weights cache emptied first, warm: it found. The checkpoint"
            " is in the page cache for every run. GGML: qwentts.cpp's figures quoted from the project's peers"
            " notes (2026-12-01, a 2-core AMD EPYC with AVX2, a float32 random 0.6B checkpoint), not run here.",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
