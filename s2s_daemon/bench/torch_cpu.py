"""The torch engine on the CPU with the native kernels, loaded and warmed, for the benchmark scripts
that time its parts in one process (``scripts/bench_prefix.py``, ``bench_ref_stream.py``,
``bench_wide.py``)."""

from __future__ import annotations

from s2s_daemon.tts.engine import EngineOptions
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine


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
