"""Which torch device the engine runs on (``tts.torch.device``): one place, read by the engine and
by ``formats.resolved`` (``check-config --print``) alike."""

from __future__ import annotations

import torch

from s2s_daemon.tts.engine import EngineError


def pick_device(requested: str) -> torch.device:
    """``auto`` -> cuda, then mps, then cpu; anything else is passed to torch.device."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise EngineError(f"device {requested!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {requested!r} requested but CUDA is not available")
    return device
