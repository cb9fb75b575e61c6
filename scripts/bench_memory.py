"""Peak RSS of ``s2s-daemon say`` per weight format and codec precision, and where it sits.

    .venv/bin/python -m s2s_daemon.tools.make_checkpoint /tmp/lean/cv06 --size 0.6b --kind custom_voice
    .venv/bin/python scripts/bench_memory.py /tmp/lean/cv06 [--formats int8,int4] [--codecs auto,float32]
        [--frames 12] [--rounds 2] [--cache /tmp/lean/prepared]

Each run is a fresh ``s2s-daemon say TEXT --out FILE --greedy`` process (the daemon's own command,
with its imports, pipeline and worker thread), the frames capped by ``tts.options.max_frames``,
``tts.options.codec_dtype`` set per column. The figure is the process's ``ru_maxrss`` (what GGML's
and vox-tts's peaks are quoted as). The prepared-weights cache (``--cache``) is filled by a first
unmeasured run, so every measured run maps it (a warm start; a cold start converts the checkpoint
and peaks no higher). The child also samples its RSS by mapping every 20 ms and reports the
largest parts at its highest sample: anonymous memory (Python, torch, the codec decoder, the
tokenizer, KV caches, the allocator's free lists), the prepared talker (``tensors.bin``), the
checkpoint's mapped tables, shared libraries.

Peak RSS does not depend on the machine's load: this runs on a busy machine as well as a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TEXT = "Hello there, this is a short test of the speech synthesis system."
LEANEST_PEER_MIB = (1150, 1182)
"""vox-tts 0.19.5 q8 on the 2-core Intel Xeon, one run beside ours (issue 32's figures)."""

CHILD = r"""
import json, resource, sys, threading, time
sys.path.insert(0, {scripts!r})
from bench_load import _status, rss_by_mapping
best = {{"rss": 0, "maps": []}}
def sample():
    while True:
        rss = _status()["VmRSS"]
        if rss > best["rss"]:
            best["rss"], best["maps"] = rss, rss_by_mapping(6)
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
from s2s_daemon.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
out = {{"rc": code, "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "sampled_mib": round(best["rss"] / 1024), "at_peak": best["maps"]}}
print("BENCH_MEMORY " + json.dumps(out), file=sys.stderr)
"""


def model_size(model: str) -> str | None:
    """The checkpoint's ``tts_model_size`` (``0b6``, ``1b7``) as the engine reads it, None when its
    config does not say or cannot be read."""
    from s2s_daemon.tts.engine import CheckpointError
    from s2s_daemon.tts.torch_qwen3.config import load_model_config

    try:
        return load_model_config(Path(model)).model_size or None
    except CheckpointError:
        return None


def run_say(model: str, fmt: str, codec: str, frames: int, cache: str, out: Path) -> dict[str, Any]:
    env = {**os.environ, "S2S_PREPARED_CACHE": cache, "S2S_TTS__OPTIONS__MAX_FRAMES": str(frames),
           "S2S_TTS__OPTIONS__CODEC_DTYPE": codec}  # fmt: skip
    code = CHILD.format(scripts=str(Path(__file__).resolve().parent))
    cmd = [sys.executable, "-c", code, "say", TEXT, "--model", model, "--quantization", fmt, "--out", str(out),
           "--greedy"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=1800)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("BENCH_MEMORY ")]
    if not lines:
        return {"rc": proc.returncode, "error": proc.stderr[-2000:]}
    row: dict[str, Any] = json.loads(lines[-1].removeprefix("BENCH_MEMORY "))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint folder (a 0.6b random checkpoint from make_checkpoint)")
    parser.add_argument("--formats", default="int8,int4", help="tts.torch.quantization values")
    parser.add_argument("--codecs", default="auto,float32,bfloat16", help="tts.options.codec_dtype values")
    parser.add_argument("--frames", type=int, default=12, help="frames per utterance (max_frames)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", default="/tmp/s2s-bench-memory-prepared", help="prepared-weights cache folder")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from s2s_daemon.bench.machine import machine_line
    from s2s_daemon.bench.performance_page import add_doc_arguments, doc_target, markdown_table

    add_doc_arguments(parser, "memory")
    args = parser.parse_args()
    doc = doc_target(args)

    print(machine_line(f"model {args.model}", f"{args.frames} frames", f"cache {args.cache}"), flush=True)
    out = Path(args.cache) / "say.wav"
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    table = []
    for fmt in args.formats.split(","):
        run_say(args.model, fmt, "float32", 2, args.cache, out)  # fills the prepared cache, not measured
        for codec in args.codecs.split(","):
            peaks = []
            for _ in range(args.rounds):
                row = run_say(args.model, fmt, codec, args.frames, args.cache, out)
                if row.get("rc") not in (0, None) or "peak_mib" not in row:
                    print(f"{fmt} {codec}: failed: {row.get('error', row)}", flush=True)
                    continue
                peaks.append(row["peak_mib"])
                parts = "; ".join(s.strip() for s in row["at_peak"])
                print(f"{fmt} codec {codec}: peak RSS {row['peak_mib']} MiB; at the highest sample "
                      f"({row['sampled_mib']} MiB): {parts}", flush=True)  # fmt: skip
            if peaks:
                table.append((fmt, codec, min(peaks), max(peaks)))
    # The peer's figure is a 0.6B's: beside another model size it would compare unlike things.
    size = model_size(args.model)
    peer = f"{LEANEST_PEER_MIB[0]:,}-{LEANEST_PEER_MIB[1]:,}" if size == "0b6" else "-"
    print()
    print("format | codec_dtype | peak RSS of say, MiB (least-most) | leanest peer (vox-tts q8), MiB")
    for fmt, codec, lo, hi in table:
        print(f"{fmt} | {codec} | {lo}-{hi} | {peer}")
    if doc is not None:
        rows = [[fmt, codec, f"{lo:,}-{hi:,}", peer] for fmt, codec, lo, hi in table]
        header = ["format", "codec_dtype", "peak RSS of say, MiB (least-most)", "leanest peer (vox-tts q8), MiB"]
        notes = f"Model `{args.model}` (tts_model_size {size or 'unknown'}): `s2s-daemon say` as a subprocess,"
        notes += f" {args.frames} frames, {args.rounds} rounds; the peer's figure, a 0.6B's (shown beside a 0.6B"
        notes += " alone), is from ../shared/PEERS.md: vox-tts 0.19.5 q8 measured beside ours on a 2-core Intel Xeon"
        notes += " (2026-12-02), not in this run nor on this machine unless it is that one."
        doc.publish("Peak memory of one utterance", markdown_table(header, rows, "llrr"), notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
