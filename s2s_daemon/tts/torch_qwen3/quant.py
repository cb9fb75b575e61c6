"""Int8 weight-only linears for the CPU (``EngineOptions.quantization == 'int8'``).

Weights are quantized symmetrically per output channel to int8 and prepacked for FBGEMM;
``quantized::linear_dynamic`` quantizes each activation row on the fly and accumulates in int32.
Decoding one frame is a chain of matrix-vector products bound by memory bandwidth, so reading a
quarter of the fp32 bytes is where the speed comes from. Activations stay float32.
"""

from __future__ import annotations

import warnings

import structlog
import torch
from torch import nn

log = structlog.get_logger(__name__)


def int8_supported() -> bool:
    """True when this torch build has the FBGEMM/QNNPACK dynamic linear."""
    try:
        return bool(torch.backends.quantized.supported_engines) and hasattr(torch.ops.quantized, "linear_dynamic")
    except (AttributeError, RuntimeError):
        return False


class Int8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` with prepacked int8 weights (float32 in and out)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.10+ flags quantized tensor creation as deprecated (pytorch#184982); it still
            # works, and FBGEMM's prepacked dynamic linear is faster than fp32 (scripts/bench_torch.py).
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qweight = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight_bytes = w.numel() + 4 * w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed)  # type: ignore[no-any-return]


def quantize_linears(root: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` under ``root`` (names not starting with ``skip``); returns how many."""
    count = 0
    for name, module in list(root.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not full.startswith(skip):
                setattr(module, child_name, Int8Linear(child))
                count += 1
    log.info("int8_quantized", linears=count)
    return count
