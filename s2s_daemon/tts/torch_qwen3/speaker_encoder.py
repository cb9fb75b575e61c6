"""Speaker encoder of Qwen3-TTS Base checkpoints (ECAPA-TDNN x-vector), with its mel front end.

Weights: ``speaker_encoder.*`` in the main ``model.safetensors``; shapes: the
``speaker_encoder_config`` section of the main ``config.json`` (released: 128 mels, channels
512/512/512/512/1536, kernels 5/3/3/3/1, dilations 1/2/3/4/1, Res2Net scale 8, SE 128,
attention 128; the embedding width ``enc_dim`` equals the talker's hidden size).

Front end (as the official ``extract_speaker_embedding``): 24 kHz mono float in [-1, 1];
reflect-pad (n_fft - hop) / 2 = 384 samples on both sides; STFT with n_fft 1024, hop 256,
periodic Hann window of 1024, no centring; magnitude ``sqrt(re^2 + im^2 + 1e-9)``;
128 mel filters (librosa's Slaney mel scale and Slaney area normalisation, 0 Hz to 12 kHz);
natural log after clamping at 1e-5. The filter bank is computed here, without librosa.

Network: TDNN (conv + ReLU, "same" reflect padding) -> three SE-Res2Net blocks -> the three
block outputs concatenated -> TDNN (multi-layer feature aggregation) -> attentive statistics
pooling (mean and std, attention conditioned on global mean/std) -> 1x1 conv to ``enc_dim``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

log = structlog.get_logger(__name__)

SAMPLE_RATE = 24000
"""Hertz the speaker encoder's front end expects."""
N_FFT = 1024
HOP = 256
"""Samples between mel frames."""
WIN = 1024
N_MELS = 128
F_MIN = 0.0
"""Lowest mel filter edge, Hertz."""
F_MAX = 12000.0
"""Highest mel filter edge, Hertz."""


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, mels)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    f_sp = 200.0 / 3
    freqs = f_sp * m
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), freqs)


def mel_filter_bank(
    sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS, f_min: float = F_MIN, f_max: float = F_MAX
) -> np.ndarray:
    """Triangular mel filters [n_mels, n_fft // 2 + 1], Slaney scale and area normalisation
    (what ``librosa.filters.mel`` returns with its defaults), float32."""
    fft_freqs = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(f_min)), _hz_to_mel(np.array(f_max)), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[:, None]
    return weights.astype(np.float32)


def log_mel_spectrogram(wav: Tensor, filters: Tensor) -> Tensor:
    """``wav`` [samples] at 24 kHz -> log mel [frames, 128], frames = (samples + 768 - 1024) // 256 + 1."""
    pad = (N_FFT - HOP) // 2
    y = F.pad(wav.float()[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(
        y,
        N_FFT,
        hop_length=HOP,
        win_length=WIN,
        window=torch.hann_window(WIN, device=wav.device),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = filters.float() @ mag[0]
    return torch.log(mel.clamp(min=1e-5)).T


@dataclass(frozen=True, slots=True)
class SpeakerEncoderConfig:
    """Shapes of the ECAPA-TDNN (``speaker_encoder_config`` of the main ``config.json``)."""

    mel_dim: int
    """Mel bins of the input."""
    enc_dim: int
    """Width of the speaker embedding."""
    enc_channels: tuple[int, ...]
    enc_kernel_sizes: tuple[int, ...]
    enc_dilations: tuple[int, ...]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int
    sample_rate: int
    """Hertz of the audio the front end takes."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeakerEncoderConfig:
        """Read the section; defaults are the official config class's."""
        cfg = cls(
            mel_dim=int(raw.get("mel_dim", 128)),
            enc_dim=int(raw.get("enc_dim", 1024)),
            enc_channels=tuple(int(c) for c in raw.get("enc_channels", (512, 512, 512, 512, 1536))),
            enc_kernel_sizes=tuple(int(c) for c in raw.get("enc_kernel_sizes", (5, 3, 3, 3, 1))),
            enc_dilations=tuple(int(c) for c in raw.get("enc_dilations", (1, 2, 3, 4, 1))),
            enc_attention_channels=int(raw.get("enc_attention_channels", 128)),
            enc_res2net_scale=int(raw.get("enc_res2net_scale", 8)),
            enc_se_channels=int(raw.get("enc_se_channels", 128)),
            sample_rate=int(raw.get("sample_rate", SAMPLE_RATE)),
        )
        if not len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        if cfg.mel_dim != N_MELS or cfg.sample_rate != SAMPLE_RATE:
            raise ValueError(f"speaker encoder front end is fixed at {N_MELS} mels, {SAMPLE_RATE} Hz")
        return cfg


class _SameConv(nn.Module):
    """Conv1d with "same" reflect padding (left = total // 2)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation)
        total = dilation * (kernel - 1)
        self.pad = (total // 2, total - total // 2)

    def forward(self, x: Tensor) -> Tensor:
        if self.pad != (0, 0):
            x = F.pad(x, self.pad, mode="reflect")
        result: Tensor = self.conv(x)
        return result


class _Tdnn(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int) -> None:
        super().__init__()
        inner = _SameConv(in_ch, out_ch, kernel, dilation)
        self.conv = inner.conv
        self.pad = inner.pad

    def forward(self, x: Tensor) -> Tensor:
        if self.pad != (0, 0):
            x = F.pad(x, self.pad, mode="reflect")
        return F.relu(self.conv(x))


class _Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList([_Tdnn(width, width, kernel, dilation) for _ in range(scale - 1)])

    def forward(self, x: Tensor) -> Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        prev: Tensor | None = None
        for i in range(1, self.scale):
            inp = parts[i] if prev is None else parts[i] + prev
            prev = self.blocks[i - 1](inp)
            outs.append(prev)
        return torch.cat(outs, dim=1)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1)
        self.conv2 = nn.Conv1d(se_channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class _SeRes2NetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, scale: int, se: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = _Tdnn(in_ch, out_ch, 1, 1)
        self.res2net_block = _Res2Net(out_ch, scale, kernel, dilation)
        self.tdnn2 = _Tdnn(out_ch, out_ch, 1, 1)
        self.se_block = _SqueezeExcite(out_ch, se)

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))
        return result


class _AttentiveStatsPool(nn.Module):
    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = _Tdnn(channels * 3, attention, 1, 1)
        self.conv = nn.Conv1d(attention, channels, 1)

    @staticmethod
    def _stats(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        mean = (w * x).sum(dim=2)
        std = torch.sqrt((w * (x - mean[..., None]).pow(2)).sum(dim=2).clamp(min=1e-12))
        return mean, std

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[-1]
        uniform = torch.full_like(x[:, :1], 1.0 / t)
        mean, std = self._stats(x, uniform)
        ctx = torch.cat([x, mean[..., None].expand(-1, -1, t), std[..., None].expand(-1, -1, t)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    """24 kHz waveform -> speaker embedding [enc_dim] (the x-vector a Base model conditions on)."""

    mel_filters: Tensor

    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch, ks, dl = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks: list[nn.Module] = [_Tdnn(cfg.mel_dim, ch[0], ks[0], dl[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(_SeRes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dl[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = _Tdnn(ch[-1], ch[-1], ks[-1], dl[-1])
        self.asp = _AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, cfg.enc_dim, 1)
        self.register_buffer("mel_filters", torch.from_numpy(mel_filter_bank()), persistent=False)
        self.sample_rate = cfg.sample_rate
        """Hertz ``embed`` expects."""

    @classmethod
    def from_state_dict(
        cls,
        state: dict[str, Tensor],
        config: dict[str, Any],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> SpeakerEncoder:
        """Build from tensors keyed ``speaker_encoder.*`` (or already without that prefix)."""
        prefix = "speaker_encoder."
        own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not own:
            own = dict(state)
        model = cls(SpeakerEncoderConfig.from_dict(config))
        model.load_state_dict(own, strict=True)
        model = model.to(device=device, dtype=dtype).eval()
        model.mel_filters = model.mel_filters.float()
        model.requires_grad_(False)
        return model

    @classmethod
    def from_folder(
        cls, folder: Path | str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> SpeakerEncoder:
        """Build from a checkpoint folder: ``config.json`` (``speaker_encoder_config``) and the
        ``speaker_encoder.*`` tensors of ``model.safetensors`` (only those are read)."""
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        section = raw.get("speaker_encoder_config")
        if section is None:
            raise ValueError(f"{folder}/config.json has no speaker_encoder_config (not a Base checkpoint?)")
        state: dict[str, Tensor] = {}
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            for key in f.keys():
                if key.startswith("speaker_encoder."):
                    state[key] = f.get_tensor(key)
        if not state:
            raise ValueError(f"{folder}/model.safetensors has no speaker_encoder.* tensors (not a Base checkpoint?)")
        model = cls.from_state_dict(state, section, device, dtype)
        log.info("speaker_encoder_loaded", folder=str(folder), device=str(device), dtype=str(dtype))
        return model

    def forward(self, mels: Tensor) -> Tensor:
        """``mels`` [batch, frames, mel_dim] -> [batch, enc_dim]."""
        x = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        result: Tensor = self.fc(self.asp(x))[..., 0]
        return result

    @torch.inference_mode()
    def embed(self, wav_24k: Tensor) -> Tensor:
        """``wav_24k`` float [samples] at 24 kHz -> embedding [enc_dim] (dtype of the weights)."""
        if wav_24k.dim() != 1:
            raise ValueError(f"expected mono samples [n], got {tuple(wav_24k.shape)}")
        if wav_24k.numel() <= N_FFT:
            raise ValueError(f"reference audio too short: {wav_24k.numel()} samples")
        w = self.fc.weight
        mels = log_mel_spectrogram(wav_24k.to(w.device), self.mel_filters)
        return self.forward(mels[None].to(w.dtype))[0]
