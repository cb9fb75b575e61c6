"""Codec encoder of the Qwen3-TTS 12 Hz speech tokenizer (for voice cloning), in plain torch.

Audio at 24 kHz -> 16 codebook ids per frame at 12.5 frames per second, ``ceil(samples / 1920)``
frames as the official ``encode`` trims it. The encoder is a Mimi encoder (Kyutai) with the
decoder half dropped (SEANet, a causal transformer, a stride-2 conv, a split residual VQ of which
the first 16 codebooks are kept); its weights sit under ``encoder.`` in
``speech_tokenizer/model.safetensors``, in the hub's layout or the one newer transformers
releases write (mapped to the former), and its shapes in ``encoder_config`` of
``speech_tokenizer/config.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from s2s_daemon.tts.torch_qwen3.codec import LayerScale
from s2s_daemon.tts.torch_qwen3.layers import apply_rope

log = structlog.get_logger(__name__)

_LAYOUT_RENAMES = (
    ("encoder.encoder_seanet.", "encoder."),
    ("encoder.encoder_transformer.", "encoder_transformer."),
    ("encoder.downsample.", "downsample."),
)
"""Newer-transformers key prefixes (after stripping ``encoder.``) -> hub-layout prefixes."""


@dataclass(frozen=True, slots=True)
class CodecEncoderConfig:
    """Shapes of the Mimi encoder (``encoder_config`` of ``speech_tokenizer/config.json``)."""

    sampling_rate: int
    """Hertz of the input audio."""
    frame_rate: float
    """Codec frames per second of the output."""
    audio_channels: int
    num_filters: int
    """Channels after the first SEANet conv (doubled by each downsampling)."""
    num_residual_layers: int
    ratios: tuple[int, ...]
    """SEANet downsampling strides in the order applied (the config's ``upsampling_ratios`` reversed)."""
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    causal: bool
    pad_mode: str
    """Padding of the SEANet convs (``constant`` = zeros); the downsample conv replicates."""
    compress: int
    use_conv_shortcut: bool
    hidden_size: int
    """Transformer width, channels."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    norm_eps: float
    rope_theta: float
    sliding_window: int
    """Keys visible to a query (25 Hz steps), its own included."""
    attention_bias: bool
    num_quantizers: int
    """Codebooks in the checkpoint (semantic + acoustic)."""
    num_semantic_quantizers: int
    codebook_size: int
    codebook_dim: int
    """Width of a codebook entry (``vector_quantization_hidden_dimension``)."""

    @property
    def downsample_stride(self) -> int:
        """SEANet steps per codec frame."""
        seanet_rate = self.sampling_rate / math.prod(self.ratios)
        return round(seanet_rate / self.frame_rate)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CodecEncoderConfig:
        """Read the ``encoder_config`` section; defaults follow ``MimiConfig``."""
        hidden = int(raw.get("hidden_size", 512))
        heads = int(raw.get("num_attention_heads", 8))
        rope = raw.get("rope_theta")
        if rope is None:
            rope = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            sampling_rate=int(raw.get("sampling_rate", 24000)),
            frame_rate=float(raw.get("frame_rate") or raw.get("_frame_rate") or 12.5),
            audio_channels=int(raw.get("audio_channels", 1)),
            num_filters=int(raw.get("num_filters", 64)),
            num_residual_layers=int(raw.get("num_residual_layers", 1)),
            ratios=tuple(int(r) for r in reversed(raw.get("upsampling_ratios") or (8, 6, 5, 4))),
            kernel_size=int(raw.get("kernel_size", 7)),
            last_kernel_size=int(raw.get("last_kernel_size", 3)),
            residual_kernel_size=int(raw.get("residual_kernel_size", 3)),
            dilation_growth_rate=int(raw.get("dilation_growth_rate", 2)),
            causal=bool(raw.get("use_causal_conv", True)),
            pad_mode=str(raw.get("pad_mode", "constant")),
            compress=int(raw.get("compress", 2)),
            use_conv_shortcut=bool(raw.get("use_conv_shortcut", False)),
            hidden_size=hidden,
            num_hidden_layers=int(raw.get("num_hidden_layers", 8)),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw.get("intermediate_size", 2048)),
            hidden_act=str(raw.get("hidden_act", "gelu")),
            norm_eps=float(raw.get("norm_eps", 1e-5)),
            rope_theta=float(rope),
            sliding_window=int(raw.get("sliding_window") or 250),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_quantizers=int(raw.get("num_quantizers", 32)),
            num_semantic_quantizers=int(raw.get("num_semantic_quantizers", 1)),
            codebook_size=int(raw.get("codebook_size", 2048)),
            codebook_dim=int(raw.get("vector_quantization_hidden_dimension", 256)),
        )


class _MimiConv(nn.Module):
    """Conv1d with Mimi's padding: causal = all of ``k_eff - stride`` on the left, plus the
    right padding that makes the last window complete."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        kernel: int,
        *,
        stride: int = 1,
        dilation: int = 1,
        causal: bool = True,
        pad_mode: str = "constant",
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.k_eff = (kernel - 1) * dilation + 1
        self.pad_total = self.k_eff - stride
        self.causal = causal
        self.pad_mode = pad_mode

    def forward(self, x: Tensor) -> Tensor:
        length = x.shape[-1]
        n_frames = math.ceil((length - self.k_eff + self.pad_total) / self.stride + 1) - 1
        extra = n_frames * self.stride + self.k_eff - self.pad_total - length
        if self.causal:
            left, right = self.pad_total, extra
        else:
            right0 = self.pad_total // 2
            left, right = self.pad_total - right0, right0 + extra
        if self.pad_mode == "constant":
            x = F.pad(x, (left, right))
        elif self.pad_mode == "reflect" and length <= max(left, right):
            grow = max(left, right) - length + 1
            x = F.pad(F.pad(x, (0, grow)), (left, right), mode="reflect")[..., : length + left + right]
        else:
            x = F.pad(x, (left, right), mode=self.pad_mode)
        result: Tensor = self.conv(x)
        return result


class _Elu(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.elu(x)


class _ResnetBlock(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        conv = {"causal": cfg.causal, "pad_mode": cfg.pad_mode}
        self.block = nn.ModuleList(
            [
                _Elu(),
                _MimiConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation, **conv),  # type: ignore[arg-type]
                _Elu(),
                _MimiConv(hidden, dim, 1, **conv),  # type: ignore[arg-type]
            ]
        )
        self.shortcut: nn.Module = _MimiConv(dim, dim, 1, **conv) if cfg.use_conv_shortcut else nn.Identity()  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        result: Tensor = self.shortcut(x) + h
        return result


class _Seanet(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        conv = {"causal": cfg.causal, "pad_mode": cfg.pad_mode}
        layers: list[nn.Module] = [_MimiConv(cfg.audio_channels, cfg.num_filters, cfg.kernel_size, **conv)]  # type: ignore[arg-type]
        scale = 1
        for ratio in cfg.ratios:
            dim = scale * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(_ResnetBlock(cfg, dim, cfg.dilation_growth_rate**j))
            layers.append(_Elu())
            layers.append(_MimiConv(dim, dim * 2, ratio * 2, stride=ratio, **conv))  # type: ignore[arg-type]
            scale *= 2
        layers.append(_Elu())
        layers.append(_MimiConv(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size, **conv))  # type: ignore[arg-type]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Attention(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        result: Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return result


class _Mlp(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"codec encoder hidden_act {cfg.hidden_act!r} is not supported")
        self.approximate = "none" if cfg.hidden_act == "gelu" else "tanh"
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))
        return result


class _Layer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, 0.01)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, 0.01)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        out: Tensor = x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))
        return out


class _Transformer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.window = cfg.sliding_window
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float32) / self.head_dim)
        )
        freqs = pos.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        rel = pos[:, None] - pos[None, :]
        mask = (rel >= 0) & (rel < self.window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


class _Codebook(nn.Module):
    initialized: Tensor
    cluster_usage: Tensor
    embed_sum: Tensor

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def table(self) -> Tensor:
        return self.embed_sum.float() / self.cluster_usage.float().clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = _Codebook(size, dim)


class _RVQ(nn.Module):
    def __init__(self, n: int, size: int, dim: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_VQ(size, dim) for _ in range(n)])
        self.input_proj = nn.Conv1d(width, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, width, 1, bias=False)
        """Unused when encoding; present in the checkpoint."""

    def encode(self, x: Tensor, n: int) -> Tensor:
        """``x`` [1, width, frames] -> ids [n, frames] by greedy residual nearest-centroid search."""
        residual = self.input_proj(x)[0].T.float()
        ids = []
        for layer in list(self.layers)[:n]:
            assert isinstance(layer, _VQ)
            table = layer.codebook.table()
            idx = torch.cdist(residual[None], table[None], p=2)[0].argmin(dim=-1)
            residual = residual - F.embedding(idx, table)
            ids.append(idx)
        return torch.stack(ids)


class _SplitRVQ(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        sem = cfg.num_semantic_quantizers
        self.num_semantic = sem
        self.semantic_residual_vector_quantizer = _RVQ(sem, cfg.codebook_size, cfg.codebook_dim, cfg.hidden_size)
        self.acoustic_residual_vector_quantizer = _RVQ(
            cfg.num_quantizers - sem, cfg.codebook_size, cfg.codebook_dim, cfg.hidden_size
        )

    def encode(self, x: Tensor, n: int) -> Tensor:
        first = self.semantic_residual_vector_quantizer.encode(x, self.num_semantic)
        if n <= self.num_semantic:
            return first[:n]
        rest = self.acoustic_residual_vector_quantizer.encode(x, n - self.num_semantic)
        return torch.cat([first, rest])


class _MimiEncoder(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        self.encoder = _Seanet(cfg)
        self.encoder_transformer = _Transformer(cfg)
        stride = cfg.downsample_stride
        self.downsample = _MimiConv(
            cfg.hidden_size,
            cfg.hidden_size,
            2 * stride,
            stride=stride,
            causal=cfg.causal,
            pad_mode="replicate",
            bias=False,
        )
        self.quantizer = _SplitRVQ(cfg)


class SpeechEncoder:
    """Waveform at 24 kHz -> codec ids [frames, 16] (what the talker's voice clone prompt needs)."""

    def __init__(
        self, model: _MimiEncoder, cfg: CodecEncoderConfig, num_codebooks: int, samples_per_frame: int
    ) -> None:
        self._model = model
        self.cfg = cfg
        self.num_codebooks = num_codebooks
        """Codebooks returned per frame (``encoder_valid_num_quantizers``)."""
        self.samples_per_frame = samples_per_frame
        """Input samples per codec frame (1920)."""
        self.sample_rate = cfg.sampling_rate
        """Hertz the input must have."""

    @classmethod
    def from_folder(
        cls, folder: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> SpeechEncoder:
        """Load from a ``speech_tokenizer`` folder (``config.json`` + ``model.safetensors``)."""
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if not raw.get("encoder_config"):
            raise ValueError(f"{folder}/config.json has no encoder_config")
        cfg = CodecEncoderConfig.from_dict(raw["encoder_config"])
        model = _MimiEncoder(cfg)
        state: dict[str, Tensor] = {}
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            for key in f.keys():
                if not key.startswith("encoder.") or key.endswith("rotary_emb.inv_freq"):
                    continue
                name = key[len("encoder.") :]
                for old, new in _LAYOUT_RENAMES:
                    if name.startswith(old):
                        name = new + name[len(old) :]
                        break
                state[name] = f.get_tensor(key)
        model.load_state_dict(state, strict=True)
        # Codebooks stay float32: nearest-centroid search is sensitive to rounding.
        model.to(device=device)
        for name, module in model.named_children():
            if name != "quantizer":
                module.to(dtype=dtype)
        model.eval().requires_grad_(False)
        valid = int(raw.get("encoder_valid_num_quantizers", 16))
        spf = int(raw.get("encode_downsample_rate", 1920))
        log.info("codec_encoder_loaded", folder=str(folder), device=str(device), dtype=str(dtype))
        return cls(model, cfg, valid, spf)

    @torch.inference_mode()
    def encode(self, wav_24k: Tensor) -> Tensor:
        """``wav_24k`` float [samples] in [-1, 1] -> LongTensor [ceil(samples / 1920), 16]."""
        if wav_24k.dim() != 1:
            raise ValueError(f"expected mono samples [n], got {tuple(wav_24k.shape)}")
        if wav_24k.numel() == 0:
            raise ValueError("empty audio")
        m = self._model
        p = m.downsample.conv.weight
        x = wav_24k.to(device=p.device, dtype=p.dtype)[None, None]
        h = m.encoder(x)
        h = m.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        h = m.downsample(h)
        proj = m.quantizer.semantic_residual_vector_quantizer.input_proj.weight
        codes = m.quantizer.encode(h.to(proj.dtype), self.num_codebooks)
        frames = -(-wav_24k.numel() // self.samples_per_frame)
        return codes[:, :frames].T.contiguous().cpu()
