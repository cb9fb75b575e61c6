#!/usr/bin/env python3
"""Driver of ``scripts/gpu_check.sh``: the torch engine on a CUDA device, correctness and speed.

    S2S_GPU_DEVICE=cuda python3 scripts/gpu_check.py --results DIR --budget 520 [--quick]

Run it through ``scripts/gpu_check.sh``, which picks an interpreter with CUDA torch, prints the
machine (``nvidia-smi``, python/torch/CUDA versions) and bounds the whole run with ``timeout``.

1. Correctness, on the tiny fixture checkpoints (tests/fixtures/qwen3_tiny) and every golden case
   of tests/fixtures/qwen3_tiny/golden: greedy codec codes and the streamed waveform (4-frame
   chunks) from a CPU float32 reference run and from device runs (float32 and bfloat16, CUDA
   graphs off and on). Per case: exact-match fraction of the codes, the first differing
   (frame, codebook), the official goldens' codes, and the waveform's max abs difference (whole,
   and before the first chunk whose codes differ). Float32 runs use no TF32 (matmul and cuDNN)
   so they compare like for like; bfloat16 differs from float32 after a few frames by design.
2. A random 0.6B CustomVoice checkpoint in the official layout (``make_checkpoint``), written in
   the background while step 1 runs.
3. Speed on it, per dtype (bf16, fp16, fp32) with and without CUDA graphs: load time, time to the
   first audio chunk with a one-frame first chunk, real-time factor (audio seconds / synthesis
   seconds) and ms per frame over an 18-word sentence at a fixed frame count (random weights
   never say end-of-speech), talker-only ms per frame, peak device memory. One warm-up run first.

Every config runs in its own subprocess (own process group, killed with the driver) under its own
timeout inside one overall budget; a config that fails or runs out of time is reported as such and
the rest go on. Results: stdout, and ``DIR/summary.json`` (rewritten after every step) plus
``DIR/steps.log`` (the children's output). ``S2S_GPU_DEVICE=cpu`` is the dry run: the same steps on
the CPU, with the tiny fixture for step 3 too (``S2S_GPU_CHECK_BIG=1``: the 0.6B checkpoint).

The parent never imports torch (so it holds no CUDA context); the children do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "qwen3_tiny"
GOLDEN = FIXTURES / "golden"
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAME_RATE = 12.5
TEXT = "The quick brown fox jumps over the lazy dog, then rests in the shade by the quiet river bank."
"""18 words, about six seconds of speech: the real-time-factor sentence."""
REFERENCE: dict[str, Any] = {
    "project": "faster-qwen3-tts",
    "gpu": "NVIDIA RTX 4090",
    "first_audio_ms": 156,
    "rtf_x": 4.8,
    "note": "published figure on a different GPU (RTX 4090, not this one) with the real 0.6B weights; "
    "quoted for comparison, not measured here",
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
KINDS = ("custom_voice", "voice_design", "base")


# ----------------------------------------------------------------------------------------------
# helpers shared by parent and children
# ----------------------------------------------------------------------------------------------
def ensure_structlog() -> None:
    """The package logs through structlog; a machine without it (the GPU image) gets a minimal stand-in.

    ``S2S_GPU_CHECK_FAKE_STRUCTLOG=1`` uses the stand-in anyway (the dry-run test covers it so).
    """
    try:
        if os.environ.get("S2S_GPU_CHECK_FAKE_STRUCTLOG") == "1":
            sys.modules["structlog"] = None  # type: ignore[assignment]  # makes the import below fail
        import structlog  # noqa: F401
    except ImportError:
        import types

        class _Logger:
            def __init__(self, name: str | None) -> None:
                self.name = name or "s2s"

            def _emit(self, level: str, event: str, **kw: Any) -> None:
                fields = " ".join(f"{k}={v}" for k, v in kw.items())
                print(f"[{level}] {self.name}: {event} {fields}", file=sys.stderr, flush=True)

            def info(self, event: str, **kw: Any) -> None:
                self._emit("info", event, **kw)

            def warning(self, event: str, **kw: Any) -> None:
                self._emit("warning", event, **kw)

            def error(self, event: str, **kw: Any) -> None:
                self._emit("error", event, **kw)

            def exception(self, event: str, **kw: Any) -> None:
                self._emit("exception", event, **kw)

            def debug(self, event: str, **kw: Any) -> None:
                pass

            def bind(self, **kw: Any) -> _Logger:
                return self

        mod = types.ModuleType("structlog")
        mod.get_logger = lambda name=None, **kw: _Logger(name)  # type: ignore[attr-defined]
        mod.getLogger = mod.get_logger  # type: ignore[attr-defined]
        sys.modules["structlog"] = mod
        print("gpu_check: structlog is not installed; using a minimal stand-in", file=sys.stderr)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def golden_cases(kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """Golden calls as (case, kind, request kwargs, frames, text streaming), for the given kinds."""
    cases = []
    for meta_path in sorted(GOLDEN.glob("*.json")):
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not ("kind" in meta and "kwargs" in meta and "generation" in meta):
            continue
        if meta["kind"] not in kinds or not (GOLDEN / f"{meta_path.stem}.npz").is_file():
            continue
        kw, gen = meta["kwargs"], meta["generation"]
        non_streaming = gen.get("non_streaming_mode", kw.get("non_streaming_mode", meta["kind"] != "base"))
        ref_audio = kw.get("ref_audio")
        if isinstance(ref_audio, str) and not Path(ref_audio).is_absolute():
            ref_audio = str(ROOT / ref_audio if (ROOT / ref_audio).is_file() else GOLDEN / Path(ref_audio).name)
        cases.append(
            {
                "case": meta_path.stem,
                "kind": meta["kind"],
                "frames": int(gen["frames"]),
                "text_streaming": not non_streaming,
                "request": {
                    "text": kw["text"],
                    "voice": kw.get("speaker"),
                    "language": str(kw.get("language") or "auto").lower(),
                    "instruct": kw.get("instruct"),
                    "greedy": True,
                    "chunk_frames": 4,
                    "ref_audio": ref_audio,
                    "ref_text": kw.get("ref_text"),
                },
            }
        )
    return cases


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------
def _torch_setup(spec: dict[str, Any]) -> Any:
    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    if spec["device"].startswith("cuda") and spec.get("strict_fp32"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch


def _engine(spec: dict[str, Any], model: str, extra: dict[str, str]) -> Any:
    from s2s_daemon.tts.engine import EngineOptions
    from s2s_daemon.tts.torch_qwen3.engine import TorchQwen3Engine

    extra = dict(extra)
    extra["threads"] = str(spec.get("threads", 1))
    extra["cuda_graphs"] = "true" if spec.get("graphs") else "false"
    return TorchQwen3Engine(
        EngineOptions(
            model=model,
            device=spec["device"],
            dtype=spec["dtype"],
            quantization="none",
            kernels="torch",  # CPU only (no native build needed); ignored on CUDA
            extra=extra,
        )
    )


def _graphs_state(engine: Any) -> str:
    rt = engine.runtime
    graphs = getattr(rt, "graphs", None) if rt is not None else None
    if graphs is None:
        return "off"
    if getattr(graphs, "disabled", False):
        return "FAILED (fell back to eager)"
    if getattr(graphs, "_talker", None) is not None and getattr(graphs, "_pred", None):
        return "replayed"
    return "not captured"


def child_correctness(spec: dict[str, Any], result: Path) -> dict[str, Any]:
    import numpy as np

    torch = _torch_setup(spec)
    from s2s_daemon.tts.engine import SynthesisRequest

    arrays: dict[str, Any] = {}
    out: dict[str, Any] = {"cases": {}, "errors": {}}
    engines: dict[str, Any] = {}
    for case in golden_cases(tuple(spec["kinds"])):
        name, kind = case["case"], case["kind"]
        started = time.perf_counter()
        try:
            if kind not in engines:
                engine = _engine(spec, str(FIXTURES / kind), {})
                engine.load_blocking()
                engines[kind] = engine
            engine = engines[kind]
            request = SynthesisRequest(**case["request"])
            if request.ref_audio is not None and engine.speaker_encoder is None:
                out["errors"][name] = "skipped: no speaker encoder in this build"
                continue
            codes = engine.codes_blocking(request, max_frames=case["frames"], text_streaming=case["text_streaming"])
            engine.options.extra["max_frames"] = str(case["frames"])
            engine.options.extra["text_streaming"] = "true" if case["text_streaming"] else "false"
            try:
                chunks = list(engine.synthesize_blocking(request, lambda: False))
            finally:
                engine.options.extra.pop("max_frames", None)
                engine.options.extra.pop("text_streaming", None)
            wav = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            arrays[f"{name}__codes"] = codes.numpy()
            arrays[f"{name}__wav"] = wav.astype(np.float32)
            out["cases"][name] = {
                "frames": int(codes.shape[0]),
                "samples": int(wav.shape[0]),
                "finite": bool(np.all(np.isfinite(wav))),
                "seconds": round(time.perf_counter() - started, 2),
                "graphs": _graphs_state(engine),
            }
        except Exception as exc:  # one case failing does not stop the others
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    np.savez(result.with_suffix(".npz"), **arrays)
    if spec["device"].startswith("cuda"):
        out["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    for engine in engines.values():
        engine.close_blocking()
    return out


def child_make_checkpoint(spec: dict[str, Any], result: Path) -> dict[str, Any]:
    import torch

    from s2s_daemon.tools.make_checkpoint import write_checkpoint

    torch.set_num_threads(int(spec.get("threads", 4)))
    started = time.perf_counter()
    write_checkpoint(Path(spec["out"]), spec["size"], spec["kind"], 0)
    size = sum(p.stat().st_size for p in Path(spec["out"]).rglob("*") if p.is_file())
    return {"seconds": round(time.perf_counter() - started, 1), "bytes": size, "path": spec["out"]}


def child_perf(spec: dict[str, Any], result: Path) -> dict[str, Any]:
    import resource

    torch = _torch_setup(spec)
    from s2s_daemon.tts.engine import SynthesisRequest

    cuda = spec["device"].startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    frames, runs = int(spec["frames"]), int(spec["runs"])
    engine = _engine(spec, spec["model"], {"max_frames": str(frames), "first_chunk_frames": "1"})
    t0 = time.perf_counter()
    info = engine.load_blocking()
    sync()
    load_s = time.perf_counter() - t0
    loaded_mib = torch.cuda.memory_allocated() / 2**20 if cuda else None
    load_peak_mib = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    request = SynthesisRequest(
        text=TEXT,
        voice=info.voices[0] if info.voices else None,
        language="english",
        instruct="A calm, clear voice." if info.mode == "voice_design" else None,
        chunk_frames=4,
        greedy=True,
    )
    t0 = time.perf_counter()
    engine.warmup_blocking()
    for _ in engine.synthesize_blocking(request, lambda: False):  # one full warm-up run
        pass
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ttfa, totals, audio = [], [], []
    for _ in range(runs):
        samples = 0
        first: float | None = None
        t0 = time.perf_counter()
        for chunk in engine.synthesize_blocking(request, lambda: False):
            if first is None:
                first = time.perf_counter() - t0  # the chunk is already on the host: synchronized
            samples += len(chunk)
        sync()
        totals.append(time.perf_counter() - t0)
        ttfa.append(first or 0.0)
        audio.append(samples / SAMPLE_RATE)
    sync()
    t0 = time.perf_counter()
    codes = engine.codes_blocking(request, max_frames=frames)
    sync()
    talker_s = time.perf_counter() - t0
    total, audio_s = statistics.median(totals), statistics.median(audio)
    got_frames = round(audio_s * FRAME_RATE)
    out = {
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "dtype": info.dtype,
        "graphs": _graphs_state(engine),
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "frames": got_frames,
        "audio_s": round(audio_s, 2),
        "ttfa_ms": round(1000 * statistics.median(ttfa), 1),
        "ttfa_min_ms": round(1000 * min(ttfa), 1),
        "rtf_x": round(audio_s / total, 2) if total > 0 else None,
        "ms_per_frame": round(1000 * total / got_frames, 2) if got_frames else None,
        "talker_ms_per_frame": round(1000 * talker_s / codes.shape[0], 2) if codes.shape[0] else None,
        "runs": runs,
        "synth_s": [round(t, 3) for t in totals],
    }
    if cuda:
        out["loaded_mib"] = round(loaded_mib or 0.0, 1)
        out["load_peak_mib"] = round(load_peak_mib or 0.0, 1)
        out["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        out["reserved_peak_mib"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    else:
        out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    engine.close_blocking()
    return out


CHILDREN = {"correctness": child_correctness, "make_checkpoint": child_make_checkpoint, "perf": child_perf}


def run_child(spec_json: str, result: str) -> int:
    spec = json.loads(spec_json)
    ensure_structlog()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = Path(result)
    try:
        data = CHILDREN[spec["task"]](spec, path)
    except BaseException as exc:
        traceback.print_exc()
        write_json(path, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    write_json(path, {"ok": True, **data})
    return 0


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------
def _child_preexec() -> None:
    """Own process group (so a timeout kills the child's whole tree), and die with the parent."""
    os.setpgid(0, 0)
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Child:
    """One child process: started now, waited for with a deadline, killed (its group) past it."""

    live: ClassVar[set[Child]] = set()

    def __init__(self, driver: Driver, label: str, spec: dict[str, Any], timeout: float) -> None:
        self.driver, self.label, self.spec, self.timeout = driver, label, spec, timeout
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        self.result = driver.work / f"{safe}.json"
        self.logfile = driver.work / f"{safe}.log"
        self.started = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec), str(self.result)]
        self._log = open(self.logfile, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env, preexec_fn=_child_preexec
        )
        Child.live.add(self)

    def kill(self) -> None:
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the child left in its group
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self) -> dict[str, Any]:
        """The child's result, or {'ok': False, 'error': ...} on failure or timeout."""
        remaining = self.timeout - (time.monotonic() - self.started)
        timed_out = False
        data: dict[str, Any]
        try:
            rc = self.proc.wait(timeout=max(0.1, remaining))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
            rc = self.proc.returncode
        self.kill()
        Child.live.discard(self)
        self._log.close()
        seconds = round(time.monotonic() - self.started, 1)
        text = self.logfile.read_text(encoding="utf-8", errors="replace")
        self.driver.append_log(self.label, self.spec, rc, seconds, text)
        if timed_out:
            data = {"ok": False, "error": f"timed out after {self.timeout:.0f} s"}
        elif self.result.is_file():
            data = json.loads(self.result.read_text(encoding="utf-8"))
        else:
            tail = text.strip().splitlines()[-1:] or ["no output"]
            data = {"ok": False, "error": f"exit {rc}: {tail[0][:300]}"}
        if not data.get("ok") and "timed out" not in data.get("error", "") and rc not in (0, 1, None):
            data["error"] = f"{data.get('error')} (exit {rc})"
        data["wall_s"] = seconds
        return data


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = os.environ.get("S2S_GPU_DEVICE", "cuda").strip() or "cuda"
        self.cuda = self.device.startswith("cuda")
        self.big = self.cuda or os.environ.get("S2S_GPU_CHECK_BIG", "") == "1"
        self.quick = args.quick
        self.t0 = time.monotonic()
        self.deadline: float = self.t0 + args.budget
        self.results = Path(args.results)
        self.results.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check.", dir=args.workdir or None))
        self.steps_log = self.results / "steps.log"
        self.steps_log.write_text("", encoding="utf-8")
        self.failures = 0
        self.summary: dict[str, Any] = {
            "status": "running",
            "device": self.device,
            "quick": self.quick,
            "budget_s": args.budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": sys.version.split()[0],
            "host": platform.node(),
            "correctness": {},
            "checkpoint": None,
            "perf": [],
            "reference": REFERENCE,
        }
        self.save()

    # -- bookkeeping ------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        write_json(self.results / "summary.json", self.summary)

    def append_log(self, label: str, spec: dict[str, Any], rc: int | None, seconds: float, text: str) -> None:
        with open(self.steps_log, "a", encoding="utf-8") as fh:
            fh.write(f"===== {label}: rc {rc}, {seconds} s, spec {json.dumps(spec)}\n{text}\n")

    def say(self, text: str = "") -> None:
        print(text, flush=True)

    def start(self, label: str, spec: dict[str, Any], budget: float) -> Child | None:
        """A child with ``min(budget, time left - 10 s)``; None (and reported) when too little is left."""
        timeout = min(budget, self.remaining() - 10)
        if timeout < 15:
            return None
        return Child(self, label, spec, timeout)

    # -- steps ------------------------------------------------------------------------------
    def run(self) -> int:
        self.say(f"gpu_check: device {self.device}, budget {self.args.budget:.0f} s, quick {self.quick}, "
                 f"work dir {self.work}, results {self.results}")  # fmt: skip
        ckpt_child = None
        perf_model = str(FIXTURES / "custom_voice")
        if self.big:
            # Written on the CPU while step 1 runs on the device.
            perf_model = str(self.work / "qwen3_0.6b_custom_voice")
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            spec = {"task": "make_checkpoint", "out": perf_model, "size": "0.6b", "kind": "custom_voice",
                    "threads": threads}  # fmt: skip
            ckpt_child = self.start("make_checkpoint_0.6b", spec, self.args.ckpt_timeout)
        try:
            self.correctness()
            self.checkpoint(ckpt_child, perf_model)
            if self.summary["checkpoint"] and self.summary["checkpoint"].get("ok"):
                self.perf(perf_model)
            else:
                self.failures += 1
                self.say("step 3 skipped: no checkpoint")
        finally:
            for child in list(Child.live):
                child.kill()
        self.summary["status"] = "complete" if self.failures == 0 else f"complete with {self.failures} failure(s)"
        self.save()
        self.say()
        self.say(f"gpu_check: {self.summary['status']} in {self.summary['elapsed_s']} s; "
                 f"results in {self.results}")  # fmt: skip
        return 0 if self.failures == 0 else 1

    def correctness(self) -> None:
        kinds = ("custom_voice",) if self.quick else KINDS
        cases = golden_cases(kinds)
        self.say(f"\n== 1. correctness: tiny fixtures {', '.join(kinds)}, {len(cases)} golden cases, greedy, "
                 "codes and 4-frame streamed waveform")  # fmt: skip
        threads = max(1, min(4, (os.cpu_count() or 2) // 4)) if self.cuda else 1
        ref_spec = {"task": "correctness", "device": "cpu", "dtype": "float32", "graphs": False,
                    "kinds": list(kinds), "threads": threads}  # fmt: skip
        ref_child = self.start("correctness_cpu_fp32_reference", ref_spec, self.args.correctness_timeout)
        configs = [("fp32", False), ("fp32", True)]
        if not self.quick:
            configs += [("bf16", False), ("bf16", True)]
        dev_runs: dict[str, dict[str, Any]] = {}
        pending: list[tuple[str, Child]] = []
        for dtype, graphs in configs:
            label = f"{self.device}_{dtype}_{'graphs' if graphs else 'eager'}"
            spec = {"task": "correctness", "device": self.device, "dtype": DTYPES[dtype], "graphs": graphs,
                    "kinds": list(kinds), "threads": 1, "strict_fp32": dtype == "fp32"}  # fmt: skip
            child = self.start(f"correctness_{label}", spec, self.args.correctness_timeout)
            if child is None:
                dev_runs[label] = {"ok": False, "error": "skipped: no time left"}
                continue
            pending.append((label, child))
            if not self.cuda:  # two shared cores: one at a time; on the GPU box they run side by side
                dev_runs[label] = child.wait()
        for label, child in pending:
            if label not in dev_runs:
                dev_runs[label] = child.wait()
            dev_runs[label]["_npz"] = str(child.result.with_suffix(".npz"))
        ref = ref_child.wait() if ref_child is not None else {"ok": False, "error": "skipped: no time left"}
        ref_npz = ref_child.result.with_suffix(".npz") if ref_child is not None else self.work / "none.npz"
        ref_arrays = load_npz(ref_npz) if ref.get("ok") and ref_npz.is_file() else {}
        report: dict[str, Any] = {"reference": {k: v for k, v in ref.items() if k != "_npz"}, "configs": {}}
        if not ref.get("ok"):
            self.failures += 1
            self.say(f"CPU reference FAILED: {ref.get('error')}")
        rows = []
        for label, run in dev_runs.items():
            entry: dict[str, Any] = {k: v for k, v in run.items() if k not in ("_npz", "cases")}
            entry["cases"] = {}
            if not run.get("ok"):
                self.failures += 1
                rows.append((label, "-", "FAILED", run.get("error", "")[:120], "", "", "", ""))
                report["configs"][label] = entry
                continue
            npz = Path(run["_npz"])
            arrays = load_npz(npz) if npz.is_file() else {}
            for case in cases:
                name = case["case"]
                if f"{name}__codes" not in arrays:
                    err = run.get("errors", {}).get(name, "no result")
                    entry["cases"][name] = {"error": err}
                    if not err.startswith("skipped"):
                        self.failures += 1
                    rows.append((label, name, "ERROR", err[:120], "", "", "", ""))
                    continue
                cmp = compare(arrays, ref_arrays, name)
                cmp.update(run.get("cases", {}).get(name, {}))
                entry["cases"][name] = cmp
                rows.append(
                    (
                        label,
                        name,
                        cmp.get("code_match", "n/a"),
                        cmp.get("first_diff", "n/a"),
                        cmp.get("golden_match", "n/a"),
                        _fmt(cmp.get("wav_maxabs")),
                        _fmt(cmp.get("wav_maxabs_before_diff")),
                        cmp.get("graphs", ""),
                    )
                )
            report["configs"][label] = entry
        # CUDA graphs against eager at the same dtype: the replay must not change a single code.
        for dtype in ("fp32", "bf16"):
            eager, graphed = f"{self.device}_{dtype}_eager", f"{self.device}_{dtype}_graphs"
            if dev_runs.get(eager, {}).get("ok") and dev_runs.get(graphed, {}).get("ok"):
                a = load_npz(Path(dev_runs[eager]["_npz"]))
                b = load_npz(Path(dev_runs[graphed]["_npz"]))
                same = {c["case"]: compare(b, a, c["case"]) for c in cases if f"{c['case']}__codes" in b}
                report[f"graphs_vs_eager_{dtype}"] = same
                exact = sum(1 for v in same.values() if v.get("code_match") == "1.000")
                self.say(f"CUDA graphs vs eager, {dtype}: codes identical in {exact}/{len(same)} cases"
                         + ("" if self.cuda else " (CPU: cuda_graphs is a no-op there)"))  # fmt: skip
        self.summary["correctness"] = report
        self.save()
        header = ("config", "case", "codes=cpu", "first diff (frame,cb: dev/ref)", "vs golden", "wav maxabs",
                  "before diff", "graphs")  # fmt: skip
        self.say("reference: CPU float32, plain torch kernels; device float32 runs have TF32 off; "
                 "bf16 is expected to diverge from float32 after a few frames")  # fmt: skip
        self.say(table(header, rows))
        self.save()

    def checkpoint(self, child: Child | None, model: str) -> None:
        if not self.big:
            self.summary["checkpoint"] = {"ok": True, "path": model, "note": "tiny fixture (dry run)"}
            self.say(f"\n== 2. checkpoint: tiny fixture {model} (set S2S_GPU_CHECK_BIG=1 for the 0.6B)")
            self.save()
            return
        self.say("\n== 2. checkpoint: random 0.6B custom_voice (make_checkpoint, written during step 1)")
        data: dict[str, Any] = child.wait() if child is not None else {"ok": False, "error": "skipped: no time left"}
        self.summary["checkpoint"] = data
        if data.get("ok"):
            self.say(f"written in {data['seconds']} s ({data['bytes'] / 2**30:.2f} GiB), waited until "
                     f"{time.monotonic() - self.t0:.0f} s into the run")  # fmt: skip
        else:
            self.say(f"make_checkpoint FAILED: {data.get('error')}")
        self.save()

    def perf(self, model: str) -> None:
        frames = self.args.frames or (16 if (self.quick or not self.big) else 75)
        runs = self.args.runs or (1 if self.quick else 3)
        self.say(f"\n== 3. speed: {Path(model).name}, {frames} frames ({frames / FRAME_RATE:.1f} s of audio) of "
                 f"an 18-word sentence, one-frame first chunk then 4-frame chunks, greedy, "
                 f"median of {runs} run(s) after a warm-up; each config in a fresh process")  # fmt: skip
        rows: list[tuple[Any, ...]] = []
        wanted = [c.strip() for c in self.args.configs.split(",") if c.strip()]
        for dtype in ("bf16", "fp16", "fp32"):
            for graphs in (True, False):
                label = f"{dtype}_{'graphs' if graphs else 'eager'}"
                if wanted and label not in wanted:
                    continue
                spec = {"task": "perf", "device": self.device, "dtype": DTYPES[dtype], "graphs": graphs,
                        "model": model, "frames": frames, "runs": runs,
                        "threads": 1}  # fmt: skip
                child = self.start(f"perf_{label}", spec, self.args.perf_timeout)
                data: dict[str, Any] = (
                    child.wait() if child is not None else {"ok": False, "error": "skipped: no time left"}
                )
                data["config"] = label
                self.summary["perf"].append(data)
                self.save()
                if not data.get("ok"):
                    self.failures += 1
                    self.say(f"{label}: FAILED: {data.get('error')}")
                    rows.append((label, "FAILED", "", "", "", "", "", "", "", data.get("error", "")[:60]))
                    continue
                mem = data.get("peak_mib", data.get("peak_rss_mib"))
                self.say(f"{label}: {json.dumps({k: v for k, v in data.items() if k != 'synth_s'})}")
                rows.append(
                    (
                        label,
                        "ok",
                        _fmt(data["load_s"]),
                        _fmt(data["ttfa_ms"]),
                        _fmt(data["rtf_x"]),
                        _fmt(data["ms_per_frame"]),
                        _fmt(data["talker_ms_per_frame"]),
                        _fmt(mem),
                        data["graphs"],
                        f"{data['frames']} frames, warm-up {data['warmup_s']} s",
                    )
                )
        mem_head = "peak MiB (cuda alloc)" if self.cuda else "peak RSS MiB"
        header = ("config", "status", "load s", "first audio ms", "x real time", "ms/frame", "talker ms/frame",
                  mem_head, "cuda graphs", "notes")  # fmt: skip
        rows.append(
            (
                "reference*",
                "quoted",
                "",
                str(REFERENCE["first_audio_ms"]),
                str(REFERENCE["rtf_x"]),
                _fmt(1000 / (REFERENCE["rtf_x"] * FRAME_RATE)),
                "",
                "",
                "",
                "faster-qwen3-tts, RTX 4090",
            )
        )
        self.say()
        self.say(table(header, rows))
        self.say("* reference: faster-qwen3-tts's published 156 ms to first audio and 4.8x real time, measured "
                 "on an RTX 4090 - a different GPU from this one - with the real weights; ms/frame is derived "
                 "(1000 / (4.8 x 12.5)). Ours: random weights of the same 0.6B shapes, fixed frame count.")  # fmt: skip
        if not self.cuda:
            self.say("(dry run on the CPU: cuda_graphs does nothing there, and the figures say nothing about a GPU)")


def load_npz(path: Path) -> dict[str, Any]:
    import numpy as np

    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


def compare(arrays: dict[str, Any], ref: dict[str, Any], name: str) -> dict[str, Any]:
    """Codes and waveform of one case against a reference run and the official golden codes."""
    import numpy as np

    out: dict[str, Any] = {}
    codes = arrays[f"{name}__codes"]
    wav = arrays.get(f"{name}__wav")
    with np.load(GOLDEN / f"{name}.npz") as gold:
        if "codes" in gold.files:
            g = gold["codes"]
            n = min(len(g), len(codes))
            out["golden_match"] = f"{float(np.mean(codes[:n] == g[:n])) if n else 0.0:.3f}"
            if len(codes) != len(g):
                out["golden_match"] += f" ({len(codes)}/{len(g)} frames)"
    rc = ref.get(f"{name}__codes")
    if rc is None:
        return out
    n = min(len(rc), len(codes))
    equal = codes[:n] == rc[:n]
    total = max(len(rc), len(codes)) * codes.shape[1]
    out["code_match"] = f"{float(equal.sum()) / total if total else 1.0:.3f}"
    out["frames"] = [len(codes), len(rc)]
    bad = np.argwhere(~equal)
    if bad.size:
        f, g = (int(x) for x in bad[0])
        frame_rows = np.unique(bad[:, 0])
        out["first_diff"] = f"({f},{g}) {int(codes[f, g])}/{int(rc[f, g])}"
        out["frames_differing"] = len(frame_rows)
        out["first_diff_frame"] = f
    elif len(codes) != len(rc):
        out["first_diff"] = f"length {len(codes)} vs {len(rc)}"
        out["first_diff_frame"] = n
    else:
        out["first_diff"] = "none"
    rw = ref.get(f"{name}__wav")
    if wav is not None and rw is not None:
        m = min(len(wav), len(rw))
        if m:
            d = np.abs(wav[:m].astype(np.float64) - rw[:m].astype(np.float64))
            out["wav_maxabs"] = float(d.max())
            out["wav_rms_err"] = float(np.sqrt(np.mean(d**2)))
            # Samples of the 4-frame chunks before the first differing frame depend only on equal codes.
            cut = m if "first_diff_frame" not in out else min(m, (out["first_diff_frame"] // 4) * 4 * SAMPLES_PER_FRAME)
            out["wav_maxabs_before_diff"] = float(d[:cut].max()) if cut else None
        out["wav_samples"] = [len(wav), len(rw)]
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--results", default=os.environ.get("S2S_GPU_CHECK_RESULTS", "out/gpu_check"))
    parser.add_argument("--workdir", default=os.environ.get("S2S_GPU_CHECK_WORKDIR", ""))
    parser.add_argument("--budget", type=float, default=float(os.environ.get("S2S_GPU_CHECK_BUDGET", "520")))
    parser.add_argument("--quick", action="store_true", default=os.environ.get("S2S_GPU_CHECK_QUICK", "") == "1")
    parser.add_argument("--frames", type=int, default=int(os.environ.get("S2S_GPU_CHECK_FRAMES", "0")))
    parser.add_argument("--runs", type=int, default=int(os.environ.get("S2S_GPU_CHECK_RUNS", "0")))
    parser.add_argument(
        "--configs",
        default=os.environ.get("S2S_GPU_CHECK_CONFIGS", ""),
        help="speed configs to run, e.g. bf16_graphs,fp32_eager (default: all six)",
    )
    parser.add_argument("--correctness-timeout", type=float, default=120)
    parser.add_argument("--ckpt-timeout", type=float, default=200)
    parser.add_argument("--perf-timeout", type=float, default=90)
    args = parser.parse_args()
    if args.child:
        return run_child(*args.child)
    driver = Driver(args)

    def on_signal(signum: int, _frame: Any) -> None:
        for child in list(Child.live):
            child.kill()
        driver.summary["status"] = f"interrupted by signal {signum}"
        driver.save()
        print(f"gpu_check: interrupted by signal {signum}; partial results in {driver.results}", flush=True)
        shutil.rmtree(driver.work, ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return driver.run()
    finally:
        shutil.rmtree(driver.work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
