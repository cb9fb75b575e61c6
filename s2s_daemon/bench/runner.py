"""Drive one worker process per configuration and interleave their runs."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from s2s_daemon.bench.report import ConfigResult, ConfigSpec, RunRecord
from s2s_daemon.bench.texts import BenchText

REFERENCE_WORKER = Path(__file__).with_name("reference_worker.py")
STDERR_TAIL_CHARS = 1500
"""How much of a dead worker's stderr an error row quotes."""


class WorkerFailure(Exception):
    """The worker died, timed out or answered something that is not the protocol."""


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What to run; durations in seconds."""

    configs: tuple[ConfigSpec, ...]
    texts: tuple[BenchText, ...]
    runs: int = 3
    warmup: int = 1
    """Untimed syntheses of the first text per configuration, after ``warmup_blocking``."""
    chunk_frames: int = 4
    seed: int = 0
    voice: str | None = None
    plugins: tuple[str, ...] = ()
    """``module:function`` called in each (non-reference) worker before ``create_engine``."""
    reference_python: str | None = None
    """Interpreter of the environment that holds the official ``qwen-tts`` package."""
    load_timeout_s: float = 1800.0
    run_timeout_s: float = 900.0


class WorkerClient:
    """One worker process: JSON-lines requests on stdin, replies read by a thread."""

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+b")  # closed in close()
        self._proc = subprocess.Popen(  # our own interpreter and worker module
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            text=True,
            encoding="utf-8",
            bufsize=1,
        )
        self._replies: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="s2s.bench.reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout = self._proc.stdout
        assert stdout is not None
        for line in stdout:
            self._replies.put(line)
        self._replies.put(None)

    def stderr_tail(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - STDERR_TAIL_CHARS))
        return self._stderr.read().decode("utf-8", "replace").strip()

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerFailure(self._death_note("the worker is gone")) from exc
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty as exc:
            self.kill()
            raise WorkerFailure(f"no answer within {timeout_s:.0f} s (worker killed)") from exc
        if line is None:
            raise WorkerFailure(self._death_note("the worker exited"))
        try:
            reply: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkerFailure(f"the worker wrote something that is not JSON: {line[:200]!r}") from exc
        return reply

    def _death_note(self, what: str) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        tail = self.stderr_tail()
        last = tail.splitlines()[-1] if tail else ""
        return f"{what} (exit code {self._proc.returncode}): {last}"

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Ask the worker to close its engine and exit; kill it if it does not."""
        reply: dict[str, Any] = {}
        if self._proc.poll() is None:
            try:
                reply = self.request({"op": "close"}, timeout_s)
            except WorkerFailure:
                reply = {}
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._reader.join(timeout=5)
        self._stderr.close()
        return reply


def worker_command(spec: ConfigSpec, settings: BenchSettings) -> list[str]:
    if spec.is_reference:
        if not settings.reference_python:
            msg = "no reference environment: pass --reference-python or set S2S_BENCH_REFERENCE_PYTHON"
            raise WorkerFailure(msg)
        if not os.access(settings.reference_python, os.X_OK):
            msg = f"reference interpreter {settings.reference_python} does not exist or is not executable"
            raise WorkerFailure(msg)
        return [settings.reference_python, str(REFERENCE_WORKER)]
    return [sys.executable, "-m", "s2s_daemon.bench.worker"]


def worker_env(spec: ConfigSpec) -> dict[str, str]:
    """The parent's environment; our workers also get this process's import path (plugins resolve alike).

    The reference worker runs another environment's interpreter: it must not see our packages.
    """
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in dict(spec.options.get("env", {})).items()})
    if spec.is_reference:
        return env
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    paths.insert(0, os.getcwd())
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _pick(wanted: str | None, offered: Sequence[str], fallback: str | None) -> str | None:
    """The engine's own spelling of ``wanted`` (case-insensitive), else ``fallback``."""
    if wanted is not None:
        for name in offered:
            if name.lower() == wanted.lower():
                return name
    return fallback


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per 10 % otherwise."""

    def __init__(self, total: int, stream: IO[str] | None, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream
        self.width = width
        self.tty = bool(stream is not None and stream.isatty())
        self._last_decile = -1
        self._start = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if self.stream is None:
            return
        fraction = self.done / self.total
        elapsed = time.monotonic() - self._start
        if self.tty:
            filled = round(self.width * fraction)
            bar = "#" * filled + "." * (self.width - filled)
            text = f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f} s  {what[:40]:<40}"
            self.stream.write(text)
            self.stream.flush()
        elif int(fraction * 10) != self._last_decile:
            self._last_decile = int(fraction * 10)
            self.stream.write(f"bench: {self.done}/{self.total} runs ({fraction:.0%}, {elapsed:.0f} s) {what}\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.stream is not None and self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass(slots=True)
class _Live:
    result: ConfigResult
    client: WorkerClient | None = None
    voice: str | None = None
    languages: tuple[str, ...] = ("auto",)


def _load(live: _Live, settings: BenchSettings) -> None:
    spec = live.result.spec
    try:
        client = WorkerClient(worker_command(spec, settings), env=worker_env(spec))
    except (WorkerFailure, OSError) as exc:
        live.result.fail(str(exc))
        return
    live.client = client
    message = {
        "op": "load",
        "engine": spec.engine,
        "options": spec.options,
        "plugins": [] if spec.is_reference else list(settings.plugins),
    }
    try:
        reply = client.request(message, settings.load_timeout_s)
    except WorkerFailure as exc:
        live.result.fail(str(exc))
        return
    if not reply.get("ok"):
        live.result.fail(f"{reply.get('error_type', 'Error')}: {reply.get('error')}")
        return
    result = live.result
    result.info = dict(reply["info"])
    result.load_s = float(reply["load_s"])
    result.import_s = float(reply.get("import_s", 0.0))
    result.warmup_s = float(reply["warmup_s"])
    result.rss_before_load_mib = float(reply.get("rss_before_load_mib", 0.0))
    result.streaming = bool(reply.get("streaming", True))
    result.versions = dict(reply.get("versions", {}))
    result.absorb_memory(reply)
    live.languages = tuple(result.info.get("languages") or ("auto",))


def _run_message(live: _Live, text: BenchText, settings: BenchSettings) -> dict[str, Any]:
    auto = _pick("auto", live.languages, live.languages[0] if live.languages else "auto")
    return {
        "op": "run",
        "text": text.text,
        "language": _pick(text.language, live.languages, auto),
        "voice": live.voice,
        "chunk_frames": settings.chunk_frames,
        "seed": settings.seed,
        "greedy": True,
    }


def _run_once(live: _Live, text: BenchText, settings: BenchSettings) -> dict[str, Any]:
    assert live.client is not None
    try:
        return live.client.request(_run_message(live, text, settings), settings.run_timeout_s)
    except WorkerFailure as exc:
        live.result.fail(str(exc))
        live.client.kill()
        return {"ok": False, "error": str(exc), "fatal": True}


@dataclass(frozen=True, slots=True)
class BenchOutcome:
    """What a benchmark produced; ``interrupted`` when Ctrl-C or SIGTERM cut it short."""

    results: list[ConfigResult]
    interrupted: bool = False


def run_benchmark(settings: BenchSettings, progress_stream: IO[str] | None = None) -> BenchOutcome:
    """Load every configuration (one at a time), then run them interleaved, run by run.

    The schedule is: for each run, for each text, one synthesis per configuration in the
    order given. A configuration that fails to load or whose worker dies keeps its error
    and drops out; a single failed synthesis is recorded and the configuration carries on.
    A KeyboardInterrupt stops the schedule, kills the workers and returns what was measured.
    """
    lives = [_Live(ConfigResult(spec)) for spec in settings.configs]
    total = len(lives) * (1 + settings.warmup + settings.runs * len(settings.texts))
    progress = Progress(total, progress_stream)
    interrupted = False
    try:
        _schedule(lives, settings, progress)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.finish()
        for live in lives:
            if live.client is None:
                continue
            if interrupted:
                live.client.kill()
            final = live.client.close()
            if final.get("ok"):
                live.result.absorb_memory(final)
    return BenchOutcome([live.result for live in lives], interrupted)


def _schedule(lives: list[_Live], settings: BenchSettings, progress: Progress) -> None:
    for live in lives:
        _load(live, settings)
        progress.step(f"loaded {live.result.spec.label}")
    wanted_voice = settings.voice
    for live in lives:
        voices = tuple(live.result.info.get("voices") or ())
        if wanted_voice is None and voices:
            wanted_voice = voices[0]
        live.voice = _pick(wanted_voice, voices, voices[0] if voices else None)
    for live in lives:
        for _ in range(settings.warmup):
            if live.client is not None and live.result.info and live.result.ok:
                reply = _run_once(live, settings.texts[0], settings)
                if not reply.get("ok") and not reply.get("fatal"):
                    live.result.fail(f"warmup: {reply.get('error_type', 'Error')}: {reply.get('error')}")
                elif reply.get("ok"):
                    live.result.absorb_memory(reply)
            progress.step(f"warmup {live.result.spec.label}")
    seq = 0
    for run in range(settings.runs):
        for index, text in enumerate(settings.texts):
            for live in lives:
                if live.client is not None and live.result.ok:
                    reply = _run_once(live, text, settings)
                    live.result.records.append(_record(seq, live, run, index, text, reply))
                    if reply.get("ok"):
                        live.result.absorb_memory(reply)
                    seq += 1
                progress.step(f"run {run + 1}/{settings.runs} {live.result.spec.label}")


def _record(seq: int, live: _Live, run: int, index: int, text: BenchText, reply: dict[str, Any]) -> RunRecord:
    label = live.result.spec.label
    if not reply.get("ok"):
        error = f"{reply.get('error_type', 'Error')}: {reply.get('error')}"
        return RunRecord(seq, label, run, index, text.size, ok=False, error=error)
    return RunRecord(
        seq,
        label,
        run,
        index,
        text.size,
        ok=True,
        ttfa_s=float(reply["ttfa_s"]),
        synth_s=float(reply["synth_s"]),
        audio_s=float(reply["audio_s"]),
        frames=float(reply["frames"]),
        chunks=int(reply["chunks"]),
        peak_rss_mib=float(reply.get("peak_rss_mib", 0.0)),
        device_peak_mib=float(reply.get("device_peak_mib", 0.0)),
    )
