"""The torch engine on the CPU with the native kernels, loaded and warmed, for the benchmark scripts
that time its parts in one process (``scripts/bench_prefix.py``, ``bench_ref_stream.py``,
``bench_wide.py``), and one utterance timed as ``bench_steady.py`` and ``bench_isa.py`` time it."""

from __future__ import annotations

import time

from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest, TtsEngine
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

SAMPLES_PER_FRAME = 1920
"""24 kHz samples in one 80 ms codec frame."""

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank today."
"""The ten-word sentence the benchmark scripts speak."""


def sentence_request(engine: TorchQwen3Engine) -> SynthesisRequest:
    """``SENTENCE`` in English, greedy, in ``engine``'s first voice (none where it has none)."""
    info = engine.info
    voice = info.voices[0] if info is not None and info.voices else None
    return SynthesisRequest(text=SENTENCE, voice=voice, language="english", greedy=True)


def cpu_engine(model: str, quantization: str, threads: int, isa: str = "auto", **extra: str) -> TorchQwen3Engine:
    """``model`` in float32 activations with ``quantization`` (``none``, ``int8``, ``int4``) weights,
    ``threads`` intra-op threads, the native kernels' path ``isa`` (``tts.torch.isa``) and the
    engine options ``extra``; loaded and warmed up."""
    import torch

    torch.set_num_threads(threads)
    engine = TorchQwen3Engine(
        EngineOptions(
            model=model,
            device="cpu",
            dtype="float32",
            quantization=quantization,
            kernels="native",
            isa=isa,
            extra={"threads": str(threads), **extra},
        )
    )
    engine.load_blocking()
    engine.warmup_blocking()
    return engine


def timed_utterance(engine: TtsEngine, request: SynthesisRequest) -> tuple[float, float] | None:
    """One utterance of ``request``: (milliseconds to its first chunk, steady milliseconds a frame
    after it, codec included); None when it made no frame after its first chunk."""
    started = time.perf_counter()
    first_at: float | None = None
    first_samples = samples = 0
    for piece in engine.synthesize_blocking(request, lambda: False):
        samples += len(piece)
        if first_at is None:
            first_at, first_samples = time.perf_counter(), len(piece)
    end = time.perf_counter()
    frames = (samples - first_samples) / SAMPLES_PER_FRAME
    if first_at is None or frames <= 0:
        return None
    return (first_at - started) * 1000, (end - first_at) * 1000 / frames
