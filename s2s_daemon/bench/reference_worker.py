"""Benchmark worker for the official ``qwen-tts`` package, run with ITS interpreter.

``/path/to/refenv/bin/python reference_worker.py`` speaks the same JSON-lines protocol
as ``s2s_daemon.bench.worker`` (``protocol.py``, loaded by its path) but imports nothing from
s2s_daemon: only the standard library, ``qwen_tts``, ``torch`` and ``numpy``, which is
all the reference environment holds. The official package does not stream: its first
audio is its last, so ``ttfa_s`` equals ``synth_s`` (the reply says ``streaming: false``).

Options: ``dtype`` (``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``, ``auto`` = fp32),
``device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``, ``auto``), ``extra.max_frames`` (cap on
codec frames, passed as ``max_new_tokens`` + 1). Decoding is greedy (talker and sub-talker).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import resource
import sys
import time
from typing import TYPE_CHECKING, Any

# Run as a script from inside the package folder: keep that folder off the import path so
# none of its modules can shadow a name the reference package imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

if TYPE_CHECKING:
    from s2s_daemon.bench.protocol import reply_stream, serve
else:  # the protocol's module by its path: standard library only, s2s_daemon is not installed here
    _spec = importlib.util.spec_from_file_location("s2s_bench_protocol", os.path.join(_HERE, "protocol.py"))
    assert _spec is not None and _spec.loader is not None
    _protocol = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_protocol)
    reply_stream, serve = _protocol.reply_stream, _protocol.serve

CODEC_FRAME_RATE_HZ = 12.5
"""Codec frames per second of audio (Qwen3-TTS 12 Hz)."""
MIB = 1024.0 * 1024.0
_DTYPES = {
    "auto": "float32",
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def peak_rss_mib() -> float:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / MIB if sys.platform == "darwin" else maxrss / 1024.0


def rss_mib() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / MIB
    except OSError:
        return peak_rss_mib()


class ReferenceHost:
    def __init__(self) -> None:
        self.model: Any = None
        self.device = "cpu"
        self.max_frames: int | None = None

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        rss_before = rss_mib()
        start = time.perf_counter()
        import torch
        from qwen_tts import Qwen3TTSModel  # type: ignore[import-not-found]  # lives only in the reference venv

        import_s = time.perf_counter() - start

        options = dict(request.get("options", {}))
        extra = dict(options.get("extra", {}))
        if "max_frames" in extra:
            self.max_frames = int(extra["max_frames"])
        dtype_name = _DTYPES.get(str(options.get("dtype", "auto")).lower())
        if dtype_name is None:
            msg = f"dtype {options.get('dtype')!r}: choose fp32, bf16 or fp16"
            raise ValueError(msg)
        device = str(options.get("device", "auto"))
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.model = Qwen3TTSModel.from_pretrained(
            str(options["model"]), dtype=getattr(torch, dtype_name), device_map=device
        )
        load_s = time.perf_counter() - start
        speakers = list(self.model.get_supported_speakers() or [])
        languages = list(self.model.get_supported_languages() or ["auto"])
        start = time.perf_counter()
        self._generate("Hello.", speakers[0] if speakers else None, "auto", 0, max_frames=4)
        warmup_s = time.perf_counter() - start
        versions = {"python": platform.python_version(), "torch": torch.__version__}
        for name in ("qwen_tts", "transformers", "numpy"):
            version = getattr(sys.modules.get(name), "__version__", None)
            if version:
                versions[name] = str(version)
        if "qwen_tts" not in versions:
            try:
                from importlib.metadata import version as dist_version

                versions["qwen_tts"] = dist_version("qwen-tts")
            except Exception:  # a version is a nicety, never a failure
                pass
        info = {
            "engine": "qwen-tts",
            "model": str(options["model"]),
            "device": device,
            "sample_rate": 24_000,
            "voices": speakers,
            "languages": languages,
            "dtype": dtype_name,
            "mode": str(getattr(self.model.model, "tts_model_type", "custom_voice")),
        }
        return {
            "info": info,
            "load_s": load_s,
            "import_s": import_s,
            "warmup_s": warmup_s,
            "rss_before_load_mib": rss_before,
            "streaming": False,
            "versions": versions,
            **self.memory(),
        }

    def _generate(self, text: str, voice: str | None, language: str, seed: int, max_frames: int | None) -> Any:
        import torch

        torch.manual_seed(seed)
        kwargs: dict[str, Any] = {"do_sample": False, "subtalker_dosample": False}
        if max_frames is not None:
            # With a capped generation the official package returns one frame fewer than
            # max_new_tokens (measured on 0.1.1); +1 makes it produce the frames ours do.
            kwargs["max_new_tokens"] = max_frames + 1
        wavs, sample_rate = self.model.generate_custom_voice(text=text, speaker=voice, language=language, **kwargs)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return wavs[0], int(sample_rate)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.model is None:
            msg = "run before a successful load"
            raise RuntimeError(msg)
        start = time.perf_counter()
        wav, sample_rate = self._generate(
            str(request["text"]),
            request.get("voice"),
            str(request.get("language", "auto")),
            int(request.get("seed") or 0),
            self.max_frames,
        )
        synth_s = time.perf_counter() - start
        audio_s = len(wav) / sample_rate
        return {
            "ttfa_s": synth_s,
            "synth_s": synth_s,
            "audio_s": audio_s,
            "frames": audio_s * CODEC_FRAME_RATE_HZ,
            "chunks": 1,
            **self.memory(),
        }

    def memory(self) -> dict[str, Any]:
        kind, allocated, peak = "none", 0.0, 0.0
        if self.model is not None and self.device.startswith("cuda"):
            import torch

            kind = "cuda"
            allocated = torch.cuda.memory_allocated() / MIB
            peak = torch.cuda.max_memory_allocated() / MIB
        elif self.model is not None and self.device.startswith("mps"):
            import torch

            kind = "mps"
            allocated = torch.mps.current_allocated_memory() / MIB
            peak = torch.mps.driver_allocated_memory() / MIB
        return {
            "rss_mib": rss_mib(),
            "peak_rss_mib": peak_rss_mib(),
            "device_kind": kind,
            "device_allocated_mib": allocated,
            "device_peak_mib": peak,
        }

    def close(self) -> dict[str, Any]:
        reply = self.memory()
        self.model = None
        return reply


def main() -> int:
    replies = reply_stream()
    return serve(ReferenceHost(), sys.stdin, replies)


if __name__ == "__main__":
    raise SystemExit(main())
