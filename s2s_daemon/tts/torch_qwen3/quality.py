"""How far a codec decoder path's audio is from the float32 decoder's: the quality guard.

Two measures of audio against the float32 reference (same codes, same length): ``snr_db``, the
waveform error, the fine one; ``log_mel_distance_db``, the mean absolute difference of their
log-mel spectrograms (80 bands, floored 80 dB below the reference's loudest), the coarse one,
weighed as a listener's ear weighs errors. A path passes when ``snr_db >= MIN_SNR_DB`` and
``log_mel_distance_db <= MAX_LOG_MEL_DB`` on every guarded input: random 0.6B-shaped decoders and
the tiny golden fixture (``tests/test_codec_precision.py``), and a real checkpoint through
``scripts/bench_codec.py``'s quality column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

MIN_SNR_DB = 32.0
"""Least signal-to-noise ratio of a path's audio against float32's, dB. bfloat16 keeps 8
significant bits, about 48 dB for one rounding; a decoder rounds at each of its few dozen
products, and others run a bfloat16 or float16 decoder at about 37 dB against float32 and call it
transparent. 5 dB (a factor 3 in error power) below that, it takes a path that rounds weights and
products but keeps the residual sums, norms and SnakeBeta in float32, and rejects the decoder run
in bfloat16 throughout (the test shows both on the same weights)."""
MAX_LOG_MEL_DB = 1.0
"""Largest mean absolute log-mel difference from float32's, dB: about the just-noticeable
difference in level. A rounding path stays far below it; one that gives silence, noise or a
damaged band (a float16 ``exp`` overflow in SnakeBeta silences a decoder), which SNR can misread,
is off by tens of dB."""
SAMPLE_RATE = 24000
N_FFT = 1024
HOP = 256
MELS = 80
FLOOR_DB = 80.0
"""Log-mel values are floored this far below the reference's loudest band."""


@dataclass(frozen=True, slots=True)
class Quality:
    """A path's audio against the float32 reference."""

    snr_db: float
    """Waveform signal-to-noise ratio, dB (higher is closer)."""
    log_mel_db: float
    """Mean absolute log-mel difference, dB (lower is closer)."""

    @property
    def passes(self) -> bool:
        return self.snr_db >= MIN_SNR_DB and self.log_mel_db <= MAX_LOG_MEL_DB

    def __str__(self) -> str:
        verdict = "pass" if self.passes else "FAIL"
        return f"SNR {self.snr_db:.1f} dB, log-mel {self.log_mel_db:.2f} dB: {verdict}"


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (x - ref)^2)`` in float64 (inf when equal)."""
    r, e = ref.double(), x.double() - ref.double()
    noise = float(e.pow(2).sum())
    signal = float(r.pow(2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-300) / noise)


@lru_cache(maxsize=4)
def _mel_filters(rate: int, n_fft: int, mels: int) -> torch.Tensor:
    """Triangular mel filters ``[mels, n_fft // 2 + 1]`` (HTK mel scale, 0 Hz to Nyquist)."""

    def mel(f: float) -> float:
        return 2595.0 * math.log10(1.0 + f / 700.0)

    def hz(m: torch.Tensor) -> torch.Tensor:
        return 700.0 * (torch.pow(10.0, m / 2595.0) - 1.0)

    edges = hz(torch.linspace(0.0, mel(rate / 2), mels + 2, dtype=torch.float64))
    freqs = torch.linspace(0.0, rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None, :] - lo) / (mid - lo)
    down = (hi - freqs[None, :]) / (hi - mid)
    return torch.clamp(torch.minimum(up, down), min=0.0)


def log_mel_db(audio: torch.Tensor, rate: int = SAMPLE_RATE) -> torch.Tensor:
    """The log-mel power spectrogram of mono ``audio``, dB, ``[MELS, frames]`` (float64)."""
    a = audio.detach().double().cpu().reshape(-1)
    if a.numel() < N_FFT:
        a = torch.nn.functional.pad(a, (0, N_FFT - a.numel()))
    window = torch.hann_window(N_FFT, dtype=torch.float64)
    spec = torch.stft(a, N_FFT, HOP, window=window, center=True, return_complex=True).abs().pow(2)
    return 10.0 * torch.log10(_mel_filters(rate, N_FFT, MELS) @ spec + 1e-20)


def log_mel_distance_db(ref: torch.Tensor, x: torch.Tensor, rate: int = SAMPLE_RATE) -> float:
    """Mean absolute difference of the log-mel spectrograms, dB, both floored ``FLOOR_DB`` below the
    reference's loudest band."""
    a, b = log_mel_db(ref, rate), log_mel_db(x, rate)
    floor = float(a.max()) - FLOOR_DB
    return float((a.clamp(min=floor) - b.clamp(min=floor)).abs().mean())


def compare(ref: torch.Tensor, x: torch.Tensor, rate: int = SAMPLE_RATE) -> Quality:
    """``x``'s quality against the float32 reference ``ref`` (same length)."""
    if ref.shape != x.shape:
        raise ValueError(f"audio of {tuple(x.shape)} against a reference of {tuple(ref.shape)}")
    return Quality(snr_db(ref, x), log_mel_distance_db(ref, x, rate))
