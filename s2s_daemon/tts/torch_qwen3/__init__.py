"""The torch engine: the project's own streaming Qwen3-TTS 12 Hz implementation (plain torch).

Importing this package imports torch; the registry does so only when ``engine: torch`` is chosen.
"""

from __future__ import annotations

from s2s_daemon.tts.threads import prepare_openmp

prepare_openmp()  # before torch is first imported: OpenMP reads its wait policy then

from s2s_daemon.tts.torch_qwen3.engine import TorchQwen3Engine  # noqa: E402 -- after prepare_openmp

__all__ = ["TorchQwen3Engine"]
