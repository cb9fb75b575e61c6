"""One benchmark configuration in its own process: ``python -m s2s_daemon.bench.worker``.

The worker speaks ``protocol.py``'s JSON lines; its requests, answered in order:

- ``{"op": "load", "engine": NAME, "options": {...}, "plugins": ["mod:func"]}``: call each
  plugin, build the engine through the registry, ``load_blocking`` then ``warmup_blocking``.
- ``{"op": "run", "text": ..., "language": ..., "voice": ..., "chunk_frames": 4, "seed": 0,
  "greedy": true}``: one ``synthesize_blocking``, pulled chunk by chunk.
- ``{"op": "close"}``: ``close_blocking`` and exit.

The engine is driven by the daemon's own ``EngineWorker`` (one ``s2s.engine`` thread, chunks
bridged to asyncio one at a time), so the first chunk is timed when the daemon would see it.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from s2s_daemon.bench.protocol import reply_stream, serve
from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
from s2s_daemon.tts.registry import create_engine
from s2s_daemon.tts.worker import EngineWorker

CODEC_FRAME_RATE_HZ = 12.5
"""Codec frames per second of audio (Qwen3-TTS 12 Hz)."""
MIB = 1024.0 * 1024.0


def peak_rss_mib() -> float:
    """High-water mark of this process's resident set, mebibytes (it never goes down)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024.0


def rss_mib() -> float:
    """Current resident set of this process, mebibytes."""
    try:
        import psutil  # optional at run time: fall back to /proc

        return float(psutil.Process().memory_info().rss) / MIB
    except ImportError:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / MIB


_LIBRARIES = {
    "torch": "torch",
    "mlx": "mlx",
    "mlx_audio": "mlx-audio",
    "transformers": "transformers",
    "numpy": "numpy",
}
"""Imported module -> distribution whose version the report names."""


def library_versions() -> dict[str, str]:
    """Versions of the numeric libraries this worker imported."""
    versions = {"python": platform.python_version()}
    for module, dist in _LIBRARIES.items():
        if module in sys.modules:
            try:
                versions[module] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def call_plugin(target: str) -> None:
    """Call ``module:function`` (for tests and plugins that register extra engines)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        msg = f"plugin {target!r} must look like module:function"
        raise ValueError(msg)
    func: Callable[[], object] = getattr(importlib.import_module(module_name), attr)
    func()


class EngineHost:
    """Owns one engine behind the daemon's own ``EngineWorker`` (one thread, chunk by chunk)."""

    def __init__(self) -> None:
        self._runner = asyncio.Runner()
        self._worker: EngineWorker | None = None
        self._sample_rate = 24_000

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        for plugin in request.get("plugins", []):
            call_plugin(str(plugin))
        raw = dict(request.get("options", {}))
        extra = {str(k): str(v) for k, v in dict(raw.pop("extra", {})).items()}
        named: dict[str, Any] = {
            k: str(v) for k, v in raw.items() if k in ("device", "dtype", "quantization", "kernels", "isa", "revision")
        }
        options = EngineOptions(model=str(raw.pop("model")), extra=extra, **named)
        rss_before = rss_mib()
        start = time.perf_counter()
        worker = EngineWorker(create_engine(str(request["engine"]), options))
        import_s = time.perf_counter() - start
        self._worker = worker
        info = self._runner.run(worker.load())
        load_s = time.perf_counter() - start
        self._sample_rate = info.sample_rate
        start = time.perf_counter()
        self._runner.run(worker.warmup())
        warmup_s = time.perf_counter() - start
        return {
            "info": asdict(info),
            "load_s": load_s,
            "import_s": import_s,
            "warmup_s": warmup_s,
            "rss_before_load_mib": rss_before,
            "streaming": True,
            "versions": library_versions(),
            **self.memory(),
        }

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        worker = self._require_worker()
        synth = SynthesisRequest(
            text=str(request["text"]),
            voice=request.get("voice"),
            language=str(request.get("language", "auto")),
            chunk_frames=int(request.get("chunk_frames", 4)),
            seed=request.get("seed"),
            greedy=bool(request.get("greedy", True)),
        )
        reply = self._runner.run(self._stream(worker, synth))
        return {**reply, **self.memory()}

    async def _stream(self, worker: EngineWorker, synth: SynthesisRequest) -> dict[str, Any]:
        start = time.perf_counter()
        first_s: float | None = None
        n_chunks = 0
        n_samples = 0
        async for chunk in worker.stream(synth, lambda: False):
            if first_s is None:
                first_s = time.perf_counter() - start
            n_chunks += 1
            n_samples += len(chunk)
        synth_s = time.perf_counter() - start
        audio_s = n_samples / self._sample_rate
        return {
            "ttfa_s": first_s if first_s is not None else synth_s,
            "synth_s": synth_s,
            "audio_s": audio_s,
            "frames": audio_s * CODEC_FRAME_RATE_HZ,
            "chunks": n_chunks,
        }

    def memory(self) -> dict[str, Any]:
        device = self._runner.run(self._worker.memory()) if self._worker is not None else None
        return {
            "rss_mib": rss_mib(),
            "peak_rss_mib": peak_rss_mib(),
            "device_kind": device.kind if device is not None else "none",
            "device_allocated_mib": device.allocated_mib if device is not None else 0.0,
            "device_peak_mib": device.peak_mib if device is not None else 0.0,
        }

    def close(self) -> dict[str, Any]:
        """Final memory figures, then ``close_blocking`` (also after a failed load)."""
        reply: dict[str, Any] = {"peak_rss_mib": peak_rss_mib()}
        try:
            if self._worker is not None:
                reply = self.memory()
                worker, self._worker = self._worker, None
                self._runner.run(worker.close())
        finally:
            self._runner.close()
        return reply

    def _require_worker(self) -> EngineWorker:
        if self._worker is None:
            msg = "run before a successful load"
            raise RuntimeError(msg)
        return self._worker


def main() -> int:
    replies = reply_stream()
    return serve(EngineHost(), sys.stdin, replies)


if __name__ == "__main__":
    raise SystemExit(main())
