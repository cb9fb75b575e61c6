"""A codec decoder with random weights that make sound (tests of the torch codec decoder)."""

from __future__ import annotations

import math
from typing import Any

import torch

from s2s_daemon.tts.torch_qwen3.codec import CodecDecoder, CodecDecoderConfig


def random_decoder(cfg: CodecDecoderConfig, dtype: Any = torch.float32, seed: int = 0) -> CodecDecoder:
    """Random weights scaled per layer (a fresh decoder maps every code to silence: its codebooks
    start at zero), the last conv damped so the output stays mostly inside the [-1, 1] clamp."""
    gen = torch.Generator().manual_seed(seed)
    dec = CodecDecoder(cfg)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            if name.endswith("cluster_usage"):
                p.copy_(torch.rand(p.shape, generator=gen) * 3 + 1)
            elif name.endswith(("alpha", "beta")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith(("gamma", "scale")):
                p.copy_(0.1 + 0.05 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
        final = dec.decoder[-1].conv
        final.weight.mul_(0.05)
    return dec.to(dtype).eval().requires_grad_(False)
