"""The torch engine: the project's own streaming Qwen3-TTS 12 Hz implementation (plain torch).

``TorchQwen3Engine`` (``engine.py``) imports torch, on first use of the name (the registry uses it
only when ``engine: torch`` is chosen); ``options.py`` (the engine's ``tts.options``) and
``config.py`` (a checkpoint's facts) do not, so that ``check-config`` reads them without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from s2s_daemon.tts.threads import prepare_openmp

prepare_openmp()  # before torch is first imported: OpenMP reads its wait policy then

if TYPE_CHECKING:
    from s2s_daemon.tts.torch_qwen3.engine import TorchQwen3Engine

__all__ = ["TorchQwen3Engine"]


def __getattr__(name: str) -> Any:
    if name == "TorchQwen3Engine":
        from s2s_daemon.tts.torch_qwen3.engine import TorchQwen3Engine

        return TorchQwen3Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
