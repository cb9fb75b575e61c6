"""Codec decoder of the Qwen3-TTS 12 Hz speech tokenizer, in plain torch, with true streaming.

It turns codec frames (16 codebook ids each, 12.5 frames per second) into 24 kHz mono audio,
1920 samples a frame, from ``speech_tokenizer/model.safetensors`` (keys under ``decoder.``) as
released. Every stage is causal, so a frame's audio depends only on it and earlier frames: each
stateful layer keeps exactly the past it needs (conv inputs, the transformer's keys and values of
its 72-frame window) and ``push(n)`` runs only the new frames, returning exactly ``n * 1920``
samples with nothing held back; streamed audio equals the one-shot decode up to float rounding.
On the CPU the matrix weights may be bfloat16 (``pick_codec_weights``), within the quality guard
(``quality.py``). ``scripts/bench_codec.py`` measures a push; docs/engines.md explains the scheme.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from s2s_daemon.tts.torch_qwen3.checkpoint import FileRows, TensorFiles
from s2s_daemon.tts.torch_qwen3.layers import apply_rope, no_weight_init

log = structlog.get_logger(__name__)

DECODE_CHUNK_FRAMES = 64
"""Frames per internal step of the one-shot ``decode`` (bounds peak memory)."""

_StateDict = dict[int, Any]
"""Streaming state: id(layer) -> whatever that layer carries between pushes."""


@dataclass(frozen=True, slots=True)
class CodecDecoderConfig:
    """Shapes of the codec decoder (``decoder_config`` of ``speech_tokenizer/config.json``)."""

    codebook_size: int
    """Entries per codebook."""
    codebook_dim: int
    """Width of the dequantized frame before ``pre_conv``, channels (codebooks are half of it)."""
    num_quantizers: int
    """Codebooks per frame (1 semantic + the rest acoustic)."""
    latent_dim: int
    """Width between pre_conv, the transformer's projections and the upsampler, channels."""
    hidden_size: int
    """Transformer width, channels."""
    intermediate_size: int
    """Transformer MLP width, channels."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """Channels per attention head."""
    attention_bias: bool
    sliding_window: int
    """Keys visible to a query, in frames, the query's own frame included."""
    rope_theta: float
    rms_norm_eps: float
    layer_scale_initial_scale: float
    upsample_rates: tuple[int, ...]
    """Upsampling factors of the final decoder blocks (their product times the ratios is 1920)."""
    upsampling_ratios: tuple[int, ...]
    """Upsampling factors of the ConvNeXt stage right after the transformer."""
    decoder_dim: int
    """Width of the first decoder block, channels (halved by each block)."""

    @property
    def samples_per_frame(self) -> int:
        """Output samples per codec frame."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CodecDecoderConfig:
        """Read the ``decoder_config`` section (defaults are those of the official config class)."""
        hidden = int(raw.get("hidden_size", 1024))
        heads = int(raw.get("num_attention_heads", 16))
        rope = raw.get("rope_theta")
        if rope is None:
            rope = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"codec decoder rope_type {rope_type!r} is not supported (only 'default')")
        return cls(
            codebook_size=int(raw.get("codebook_size", 2048)),
            codebook_dim=int(raw.get("codebook_dim", 512)),
            num_quantizers=int(raw.get("num_quantizers", 16)),
            latent_dim=int(raw.get("latent_dim", 1024)),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size", 3072)),
            num_hidden_layers=int(raw.get("num_hidden_layers", 8)),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", 16)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            attention_bias=bool(raw.get("attention_bias", False)),
            sliding_window=int(raw.get("sliding_window", 72)),
            rope_theta=float(rope),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            layer_scale_initial_scale=float(raw.get("layer_scale_initial_scale", 0.01)),
            upsample_rates=tuple(int(r) for r in raw.get("upsample_rates", (8, 5, 4, 3))),
            upsampling_ratios=tuple(int(r) for r in raw.get("upsampling_ratios", (2, 2))),
            decoder_dim=int(raw.get("decoder_dim", 1536)),
        )


# --------------------------------------------------------------------------- conv layers


GEMM_MAX_COLUMNS = 64
"""Causal convs with at most this many output columns run as one GEMM (see ``CausalConv1d._conv``)."""


VIEW_MIN_BYTES = 1 << 20
"""``_read_decoder`` reads a tensor used as stored below this size instead of mapping it."""

LOW_COLUMNS_BYTES = 1 << 20
"""Bytes of bfloat16 columns one product of a bfloat16-weight conv takes at a time (``_low_conv``).
A streamed push's last stages would stack up to 10 MiB of taps at once, and glibc keeps such freed
blocks in the heap: smaller blocks lower the peak RSS and cost the products a little speed, which
the codec's own thread (``codec_overlap``) mostly hides; the memory was chosen."""


PACKED_MAX_BLOCKS = 4
"""The most blocks a push runs as one batch on a packed weight (``CausalConv1d._packed_conv``):
a larger push (more frames than the daemon's chunks of four) runs as one convolution on the weight
laid out plainly again, which its many columns repay (as a batch of small blocks it took 1.1-1.3x
the time at 8-16 frames, ``scripts/bench_codec.py``)."""


def _onednn_here() -> bool:
    """Whether this torch has oneDNN and oneDNN runs bfloat16 on this CPU (``CausalConv1d.pack_onednn``,
    ``LOW_CONV_ONEDNN``): torch's own check, on x86-64 AVX512 BW, VL and DQ or AVX-NE-CONVERT. An
    AVX2-only CPU has neither: oneDNN refuses to lay out a bfloat16 weight there (a RuntimeError),
    and its bfloat16 decoder runs on stacked taps (docs/engines.md, the codec decoder's precision)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else False


def low_conv_onednn(arch: str | None = None) -> bool:
    """``LOW_CONV_ONEDNN`` for a CPU of ``arch`` (``platform.machine()``'s name; this one by default)."""
    return (arch or platform.machine()).lower() in ("x86_64", "amd64") and _onednn_here()


LOW_CONV_ONEDNN = low_conv_onednn()
"""Whether a bfloat16-weight conv keeps its weight in the conv's layout and runs its many-column
pushes as oneDNN's bfloat16 convolution (x86-64 where oneDNN runs bfloat16: ``_onednn_here``;
``CausalConv1d._onednn_low_conv``) rather than as products of stacked taps (``_low_conv``), whose
copies were a quarter of the bfloat16 decoder's time. On aarch64 it was not measured, and the
stacked taps stay. ``scripts/bench_codec.py``."""


def _takes_native_gemm(weight: Tensor, bias: Tensor | None) -> bool:
    """Whether the native kernels can multiply float32 rows by ``weight`` [N, K] (checked once, at
    ``CodecDecoder.use_native``): float32 or bfloat16 and contiguous on the CPU, K a multiple of 32."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and weight.shape[1] % 32 == 0
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def _few_row_gemm(ext: Any, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``rows @ weight.T (+ bias)`` through the native float32 kernels, for at most
    ``ext.MAX_BLOCKED_ROWS`` rows and a weight that passed ``_takes_native_gemm``.

    ``rows`` [M, K], ``weight`` [N, K] row-major. torch's CPU BLAS packs the whole weight first
    when the other side has only a few columns, so a large weight is read slowly; the native
    kernels stream it (up to ``ext.MAX_STREAM_ROWS`` rows) or run a register-blocked product (up
    to ``ext.MAX_BLOCKED_ROWS``). ``scripts/bench_codec.py`` measures a push both ways.
    """
    code = 1 if weight.dtype == torch.bfloat16 else 0  # the kernels' bfloat16 and float32 formats
    out: Tensor = ext.linear(rows.contiguous(), code, weight, None, None, weight.shape[0], 0, bias)
    return out


def _low_mm(weight: Tensor, columns: Tensor) -> Tensor:
    """``weight @ columns`` for a bfloat16 ``weight`` [N, K] and float32 ``columns`` [..., K, T], in
    float32: the columns rounded to bfloat16, the products summed in float32 by oneDNN (AVX512-BF16
    or AMX dot products where the CPU has them), the sums rounded to bfloat16."""
    return torch.matmul(weight, columns.to(weight.dtype)).float()


def _onednn_conv(x: Tensor, packed: Tensor, dilation: int) -> Tensor:
    """oneDNN's convolution of ``x`` [batch, in, 1, columns] (bfloat16) by a weight it packed
    (``CausalConv1d.pack_onednn``), dilated along the columns, no padding, no bias."""
    out: Tensor = torch.ops.mkldnn._convolution_pointwise(
        x, packed, None, [0, 0], [1, 1], [1, dilation], 1, "none", [], ""
    )
    return out


CODEC_WEIGHTS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The CPU decoder's matrix weights (``EngineOptions.extra['codec_dtype']``, ``auto`` by default)."""
BF16_DOT_FLAGS = {"x86_64": ("avx512_bf16", "amx_bf16"), "aarch64": ("bf16",)}
"""Per architecture, the ``/proc/cpuinfo`` flags of bfloat16 dot-product instructions (x86-64:
AVX512-BF16, AMX-BF16; aarch64: FEAT_BF16's BFDOT and BFMMLA), which oneDNN's bfloat16 products
run on; without them it widens bfloat16 to float32 or falls back to slow code."""


def bf16_dot_products(flags: set[str] | None = None, arch: str | None = None) -> bool:
    """Whether this CPU (or one of ``arch`` with ``flags``, ``/proc/cpuinfo``'s) has bfloat16 dot
    products. On macOS, which has no ``/proc/cpuinfo``, none are found."""
    from s2s_daemon.tts.isa import architecture, this_cpu_flags

    if flags is None:
        flags = set(this_cpu_flags())
    return any(flag in flags for flag in BF16_DOT_FLAGS.get(architecture(arch), ()))


def pick_codec_weights(
    requested: str | None, ext: Any, flags: set[str] | None = None, arch: str | None = None
) -> tuple[torch.dtype, str]:
    """(dtype of the CPU decoder's matrix weights, why) for ``extra['codec_dtype']``.

    ``auto``: bfloat16 where the native kernels are loaded and the CPU has bfloat16 dot products
    (its few-column products stream half the bytes, oneDNN runs the rest on the dot products), and
    its audio is within the quality guard of float32's (``tests/test_codec_precision.py``,
    ``scripts/bench_codec.py``); float32 elsewhere. ``bfloat16`` asks for it anyway (it needs the
    native kernels; without bfloat16 dot products the reason says it is slower than float32 there);
    ``float32`` keeps the float32 decoder. ValueError for another value.
    """
    value = (requested or "auto").strip().lower()
    if value not in ("auto", *CODEC_WEIGHTS):
        raise ValueError(f"codec_dtype {requested!r} is not one of auto, {', '.join(CODEC_WEIGHTS)}")
    if value == "float32":
        return torch.float32, "asked for"
    if ext is None:
        if value == "bfloat16":
            raise ValueError("codec_dtype bfloat16 needs the native CPU kernels")
        return torch.float32, "no native kernels"
    if value == "bfloat16":
        if bf16_dot_products(flags, arch):
            return torch.bfloat16, "asked for"
        return torch.bfloat16, "asked for, on a CPU without bfloat16 dot products: slower than float32 here"
    if bf16_dot_products(flags, arch):
        return torch.bfloat16, "the CPU has bfloat16 dot products"
    return torch.float32, "the CPU has no bfloat16 dot products"


def int8_upsampler(requested: str | None, ext: Any) -> bool:
    """Whether the CPU decoder's upsampler runs its ConvNeXt linears on int8 weights
    (``CodecDecoder.int8_upsampler``): under ``codec_dtype: auto`` where the native kernels are
    loaded, beside either matrix dtype; ``float32`` and ``bfloat16`` keep every matrix in theirs.

    The upsampler's two ConvNeXt blocks hold four linears of 4 x 1024 x 1024 weights, a sixth of
    the decoder's parameters (32 MiB in bfloat16, 64 in float32); as int8 (a scale per output
    row, their input quantized per block of 32 as the talker's is) they take 16 MiB and the
    kernels' integer dot products. Their audio alone is as far from float32's as one bfloat16
    rounding, and with the bfloat16 decoder it stays within the quality guard
    (``tests/test_codec_precision.py``; ``scripts/bench_codec.py`` shows both, and a push's time).
    The pre-transformer's linears in int8 missed the guard, so they keep the matrix dtype.
    """
    return ext is not None and (requested or "auto").strip().lower() == "auto"


def native_row_limit(ext: Any, weight: Tensor, columns: int = 16, reps: int = 3) -> int:
    """Up to how many rows the codec's few-row GEMMs go to the native kernels on this machine: their
    weight-streaming kernel (``ext.MAX_STREAM_ROWS`` rows) always; their register-blocked product
    (up to ``ext.MAX_BLOCKED_ROWS``) only where torch's BLAS is slower with ``columns`` rows of
    ``weight`` [N, K], timed here (best of ``reps``).

    Which wins depends on the BLAS and the CPU (some pack a large weight slowly for a few
    columns, others beat the native product), hence the timing at load; its ``codec_native_rows``
    log line says what it chose.
    """
    x = torch.full((columns, weight.shape[1]), 0.5, dtype=weight.dtype)  # the global RNG left alone

    def best(run: Any) -> float:
        run()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        native = best(lambda: _few_row_gemm(ext, x, weight, None))
        blas = best(lambda: torch.mm(weight, x.t()))
    rows = int(ext.MAX_STREAM_ROWS) if blas < native else int(ext.MAX_BLOCKED_ROWS)
    log.info("codec_native_rows", rows=rows, native_ms=round(native * 1000, 2), blas_ms=round(blas * 1000, 2))
    return rows


class CausalConv1d(nn.Module):
    """Conv1d padded on the left by ``(k - 1) * d`` (stride 1); streams with a column buffer."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation
        """Past input columns the layer needs."""
        self.weight_taps: Tensor | None = None
        """The weight tap-major, ``[out, kernel, in]`` row-major (``relayout``), for the GEMM paths;
        the conv's own weight is then a view of it, so no memory is added. None: ``self.conv`` runs."""
        self.ext: Any = None
        """The native CPU kernels for the few-column GEMM, where ``CodecDecoder.use_native`` found the
        weight fit for them; else None."""
        self.native_rows = 0
        """Output columns up to which ``ext`` runs the GEMM (``CodecDecoder.use_native``)."""
        self.weight_low: Tensor | None = None
        """A bfloat16 weight kept in the conv's own layout ``[out, in, kernel]`` (``relayout`` where
        ``LOW_CONV_ONEDNN``) for ``_onednn_low_conv``; ``weight_taps`` is then None."""
        self.weight_onednn: Tensor | None = None
        """``weight_low`` in oneDNN's own blocked layout for this CPU and a convolution of
        ``onednn_columns`` output columns (``pack_onednn``), which it reads as it is; given the
        plain layout, oneDNN lays the whole weight out anew on every call. None: not packed."""
        self.onednn_columns = 0
        """The output columns of each convolution on ``weight_onednn``: oneDNN's layout depends on
        them, so a push runs in blocks of this many (the last one padded)."""

    def relayout(self) -> None:
        """Store the weight tap-major (``weight_taps``) for the GEMM paths, or a bfloat16 weight as it
        is for oneDNN's bfloat16 convolution (``weight_low``, ``LOW_CONV_ONEDNN``); call after
        loading, on the CPU. Grouped (depthwise) convs keep the convolution."""
        conv = self.conv
        if conv.groups != 1:
            return
        w = conv.weight.detach()
        if w.dtype == torch.bfloat16 and LOW_CONV_ONEDNN:
            self.weight_low = w.contiguous()
            conv.weight = nn.Parameter(self.weight_low, requires_grad=False)
            return
        taps = w.permute(0, 2, 1).contiguous()
        conv.weight = nn.Parameter(taps.permute(0, 2, 1), requires_grad=False)
        self.weight_taps = taps

    def _conv(self, padded: Tensor) -> Tensor:
        """``self.conv(padded)``, as matrix products where the weight was relaid.

        With few columns (a streamed chunk at the 12.5/50 Hz stages) the convolution is bound by
        reading its weights, and the oneDNN path re-lays them out on every call: one GEMM over the
        stacked taps reads them once. With many (the 300 Hz-24 kHz stages), one product per tap
        accumulated into the output, each reading the input in place, beats oneDNN's convolution.
        ``scripts/bench_codec.py`` measures a push of the whole decoder.
        """
        conv = self.conv
        taps = self.weight_taps
        if padded.shape[-1] == self.context:  # no new columns (the convolution refuses them)
            return padded.new_zeros(padded.shape[0], conv.out_channels, 0)
        if self.weight_onednn is not None and padded.dtype == torch.float32:
            return self._packed_conv(padded, self.weight_onednn)
        if self.weight_low is not None and padded.dtype == torch.float32:
            return self._onednn_low_conv(padded, self.weight_low)
        if taps is not None and taps.dtype == torch.bfloat16 and padded.dtype == torch.float32:
            return self._low_conv(padded, taps)
        if taps is None or taps.dtype != padded.dtype or taps.device != padded.device:
            out: Tensor = conv(padded)
            return out
        cout, kernel, cin = taps.shape
        d = conv.dilation[0]
        batch = padded.shape[0]
        t = padded.shape[-1] - self.context
        bias = conv.bias
        if kernel > 1 and t <= GEMM_MAX_COLUMNS:
            # Rows [t, kernel * cin] (index j * cin + c, as the taps'), one per output column.
            if self.ext is not None and batch == 1 and t <= self.native_rows:
                return self._native_columns(padded, t)
            columns = torch.cat([padded[..., j * d : j * d + t] for j in range(kernel)], dim=1)
            out = torch.matmul(taps.view(cout, kernel * cin), columns)
            return out if bias is None else out + bias[None, :, None]
        out = padded.new_empty(batch, cout, t)
        for b in range(batch):
            x, o = padded[b], out[b]
            if bias is None:
                torch.mm(taps[:, 0], x[:, :t], out=o)
            else:
                torch.addmm(bias[:, None], taps[:, 0], x[:, :t], out=o)
            for j in range(1, kernel):
                o.addmm_(taps[:, j], x[:, j * d : j * d + t])
        return out

    def _onednn_low_conv(self, padded: Tensor, weight: Tensor) -> Tensor:
        """``_low_conv`` for a weight in the conv's layout (``weight_low``): up to ``native_rows``
        output columns through the native kernels (rows stacked in the weight's order, input channel
        by tap), more through oneDNN's bfloat16 convolution, which reads the input in place (no
        stacked taps to write) on AVX512-BF16 or AMX dot products and sums in float32."""
        t = padded.shape[-1] - self.context
        if self.ext is not None and padded.shape[0] == 1 and t <= self.native_rows:
            return self._native_columns(padded, t)
        bias = self.conv.bias
        out = F.conv1d(padded.to(weight.dtype), weight, None, dilation=self.conv.dilation[0]).float()
        return out if bias is None else out.add_(bias[None, :, None])

    def _packed_conv(self, padded: Tensor, packed: Tensor) -> Tensor:
        """``_onednn_low_conv`` on the weight oneDNN packed (``weight_onednn``): the columns cut
        into blocks of ``onednn_columns`` (the size it was packed for; the last block padded with
        zeros), each block with its ``context`` columns before it, and the blocks run as one
        batch. With another number of columns oneDNN may want another layout and re-lay the
        packed weight on every call; a batch's size leaves its layout as it is."""
        batch, t = padded.shape[0], padded.shape[-1] - self.context
        block = self.onednn_columns
        blocks = -(-t // block)
        if blocks > PACKED_MAX_BLOCKS:
            return self._onednn_low_conv(padded, packed.to_dense().squeeze(2))
        x = padded.to(torch.bfloat16)
        if blocks * block > t:
            x = F.pad(x, (0, blocks * block - t))
        pieces = x.unfold(-1, block + self.context, block)  # [batch, in, blocks, block + context]
        pieces = pieces.transpose(1, 2).reshape(batch * blocks, x.shape[1], 1, block + self.context)
        y = _onednn_conv(pieces, packed, self.conv.dilation[0])  # [batch * blocks, out, 1, block]
        y = y.view(batch, blocks, -1, block).transpose(1, 2).reshape(batch, -1, blocks * block)
        out = y[..., :t].float()
        bias = self.conv.bias
        return out if bias is None else out.add_(bias[None, :, None])

    def pack_onednn(self, columns: int) -> bool:
        """Give oneDNN ``weight_low`` in its own layout for convolutions of ``columns`` output
        columns on this CPU (``weight_onednn``), in its place: the conv's weight becomes that
        tensor, the plain one is freed, and the native kernels no longer take its few-column pushes.
        Each column's sums are oneDNN's as before; what goes is the re-layout of the whole weight on
        every call, which took longer than the convolution itself (``scripts/bench_codec.py``).
        False where there is no ``weight_low`` or no oneDNN that runs bfloat16 here (``_onednn_here``)."""
        w = self.weight_low
        if w is None or not _onednn_here():
            return False
        shape = [1, w.shape[1], 1, columns + self.context]
        packed = torch._C._nn.mkldnn_reorder_conv2d_weight(  # type: ignore[call-arg]  # input_size: not in torch's stub
            w.unsqueeze(2).to_mkldnn(), [0, 0], [1, 1], [1, self.conv.dilation[0]], 1, shape
        )
        self.weight_onednn, self.onednn_columns, self.weight_low, self.ext = packed, columns, None, None
        self.conv.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def gemm_weight(self) -> Tensor | None:
        """The weight as the native GEMM reads it, ``[out, taps * in]`` in the order its input rows
        are stacked (``_native_columns``), for a conv of more than one tap; else None."""
        if self.weight_low is not None and self.weight_low.shape[2] > 1:
            return self.weight_low.view(self.weight_low.shape[0], -1)
        if self.weight_taps is not None and self.weight_taps.shape[1] > 1:
            return self.weight_taps.view(self.weight_taps.shape[0], -1)
        return None

    def _native_columns(self, padded: Tensor, t: int) -> Tensor:
        """The last ``t`` output columns of one batch (``t <= native_rows``) through the native
        kernels: one input row per column, its taps stacked as ``gemm_weight`` orders them (tap by
        channel for ``weight_taps``, channel by tap for ``weight_low``)."""
        weight = self.gemm_weight()
        assert self.ext is not None and weight is not None
        d = self.conv.dilation[0]
        kernel = self.conv.kernel_size[0]
        x = padded[0]
        if self.weight_low is not None:
            rows = torch.stack([x[:, j * d : j * d + t] for j in range(kernel)], dim=2).transpose(0, 1)
            rows = rows.reshape(t, weight.shape[1])
        else:
            rows = torch.cat([x[:, j * d : j * d + t].t() for j in range(kernel)], dim=1)
        return _few_row_gemm(self.ext, rows, weight, self.conv.bias).t().unsqueeze(0)

    def _low_conv(self, padded: Tensor, taps: Tensor) -> Tensor:
        """``_conv`` with bfloat16 weights and float32 activations (``CodecDecoder`` loaded with
        ``weights=torch.bfloat16``): up to ``native_rows`` output columns through the native kernels
        (float32 rows, bfloat16 weights, float32 sums: weight-bound, no activation rounded), more as
        products of bfloat16 stacked taps (``_low_mm``), a block of columns at a time."""
        cout, kernel, cin = taps.shape
        flat = taps.view(cout, kernel * cin)
        d = self.conv.dilation[0]
        batch = padded.shape[0]
        t = padded.shape[-1] - self.context
        bias = self.conv.bias
        if self.ext is not None and batch == 1 and t <= self.native_rows:
            return self._native_columns(padded, t)
        low = padded.to(taps.dtype)
        out = padded.new_empty(batch, cout, t)
        block = max(GEMM_MAX_COLUMNS, LOW_COLUMNS_BYTES // (kernel * cin * low.element_size()))
        for start in range(0, t, block):
            n = min(block, t - start)
            taps_in = [low[..., start + j * d : start + j * d + n] for j in range(kernel)]
            columns = taps_in[0] if kernel == 1 else torch.cat(taps_in, dim=1)
            out[..., start : start + n] = torch.matmul(flat, columns)
        if bias is not None:
            out += bias[None, :, None]
        return out

    def forward(self, x: Tensor, state: _StateDict | None = None) -> Tensor:
        if self.context == 0:
            return self._conv(x)
        if state is None:
            return self._conv(F.pad(x, (self.context, 0)))
        past = state.get(id(self))
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], self.context)
        full = torch.cat([past, x], dim=-1)
        # A copy: a view would keep the whole chunk's input alive until the next push.
        state[id(self)] = full[..., -self.context :].clone()
        return self._conv(full)


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d trimmed by ``k - s`` on the right; streams by carrying past input columns."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int) -> None:
        super().__init__()
        if kernel % stride != 0:
            raise ValueError("kernel must be a multiple of stride")
        self.conv = nn.ConvTranspose1d(in_ch, out_ch, kernel, stride=stride)
        self.weight_t: Tensor | None = None
        """The weight as a row-major ``[out * kernel, in]`` matrix (``relayout``); the conv's own
        weight is then a view of it, so no memory is added."""
        self.ext: Any = None
        """The native CPU kernels for the GEMM, where ``CodecDecoder.use_native`` found ``weight_t``
        fit for them; else None."""
        self.native_rows = 0
        """Input columns up to which ``ext`` runs the GEMM (``CodecDecoder.use_native``)."""
        self.stride = stride
        self.trim = kernel - stride
        self.context = kernel // stride - 1
        """Past input columns that still contribute to new output blocks."""

    def relayout(self) -> None:
        """Store the weight transposed (``weight_t``) for the few-row GEMM; call after loading."""
        w = self.conv.weight.detach()
        cin, cout, kernel = w.shape
        wt = w.reshape(cin, cout * kernel).t().contiguous()
        self.conv.weight = nn.Parameter(wt.t().reshape(cin, cout, kernel), requires_grad=False)
        self.weight_t = wt

    def _transpose_conv(self, x: Tensor) -> Tensor:
        """``self.conv(x)`` as one matrix product and ``kernel / stride`` shifted adds.

        For kernel = m * stride, output block u (``stride`` samples) is the sum over p < m of
        input column u - p times kernel slice p. PyTorch's CPU ConvTranspose1d takes a slow
        col2im path for these shapes (slow for a streamed frame, ``scripts/bench_codec.py``); a
        GEMM is what the arithmetic really is.
        """
        batch, cin, t = x.shape
        weight = self.conv.weight  # [in, out, kernel]
        cout, kernel = weight.shape[1], weight.shape[2]
        s = self.stride
        m = kernel // s
        columns = x.transpose(1, 2).reshape(batch * t, cin)
        wt = self.weight_t
        if self.ext is not None and wt is not None and columns.shape[0] <= self.native_rows:
            z = _few_row_gemm(self.ext, columns, wt, None).view(batch, t, cout, m, s)
        elif wt is not None and wt.dtype == torch.bfloat16 and x.dtype == torch.float32:
            z = _low_mm(wt, columns.t()).t().reshape(batch, t, cout, m, s)
        elif wt is not None and wt.dtype == x.dtype and wt.device == x.device:
            # [out * kernel, in] row-major: W @ x^T reads the weight in order, faster than x @ W for a few rows.
            z = torch.mm(wt, columns.t()).t().reshape(batch, t, cout, m, s)
        else:
            z = torch.mm(columns, weight.reshape(cin, cout * kernel)).view(batch, t, cout, m, s)
        if m == 1:
            y = z[:, :, :, 0, :].permute(0, 2, 1, 3)
        else:
            y = x.new_zeros(batch, cout, t + m - 1, s)
            for p in range(m):
                y[:, :, p : p + t, :] += z[:, :, :, p, :].permute(0, 2, 1, 3)
        out = y.reshape(batch, cout, (t + m - 1) * s)
        if self.conv.bias is not None:
            out = out + self.conv.bias[None, :, None]
        return out

    def forward(self, x: Tensor, state: _StateDict | None = None) -> Tensor:
        if self.context == 0:
            return self._transpose_conv(x)
        n = x.shape[-1]
        if state is None:
            y = self._transpose_conv(x)
            out: Tensor = y[..., : y.shape[-1] - self.trim]
            return out
        past = state.get(id(self))
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], self.context)
        full = torch.cat([past, x], dim=-1)
        state[id(self)] = full[..., -self.context :].clone()
        y = self._transpose_conv(full)
        start = self.context * self.stride
        out = y[..., start : start + n * self.stride]
        return out


class SnakeBeta(nn.Module):
    """``x + sin^2(x * e^alpha) / (e^beta + 1e-9)``, per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.native: tuple[Any, Tensor, Tensor] | None = None
        """(native kernels, e^alpha, 1 / (e^beta + 1e-9)) once ``use_native`` ran: one fused pass."""

    def use_native(self, ext: Any) -> None:
        """Compute through the native kernels' fused SnakeBeta (float32 on the CPU)."""
        alpha = torch.exp(self.alpha.detach().float()).contiguous()
        inv_beta = (1.0 / (torch.exp(self.beta.detach().float()) + 1e-9)).contiguous()
        self.native = (ext, alpha, inv_beta)

    def forward(self, x: Tensor) -> Tensor:
        if self.native is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            ext, a, ib = self.native
            return ext.snake(x, a, ib)  # type: ignore[no-any-return]
        alpha = torch.exp(self.alpha)[None, :, None]
        inv_beta = 1.0 / (torch.exp(self.beta)[None, :, None] + 1e-9)
        return x + inv_beta * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k=7, LayerNorm, pointwise MLP x4 with GELU, scaled residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, state: _StateDict | None = None) -> Tensor:
        h = self.dwconv(x, state).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        out: Tensor = x + (self.gamma * h).transpose(1, 2)
        return out


class ResidualUnit(nn.Module):
    """SnakeBeta, causal dilated conv k=7, SnakeBeta, conv k=1, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor, state: _StateDict | None = None) -> Tensor:
        out: Tensor = x + self.conv2(self.act2(self.conv1(self.act1(x), state)))
        return out


class DecoderBlock(nn.Module):
    """SnakeBeta, upsampling transposed conv, residual units with dilations 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [
                SnakeBeta(in_dim),
                CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate),
                ResidualUnit(out_dim, 1),
                ResidualUnit(out_dim, 3),
                ResidualUnit(out_dim, 9),
            ]
        )

    def forward(self, x: Tensor, state: _StateDict | None = None) -> Tensor:
        for layer in self.block:
            x = layer(x) if isinstance(layer, SnakeBeta) else layer(x, state)
        return x


# --------------------------------------------------------------------------- transformer


class RMSNorm(nn.Module):
    """RMS norm computed in float32, scaled by a learnt weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        kv = cfg.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, state: _StateDict | None) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        kpos = pos
        if state is not None:
            past = state.get(id(self))
            if past is not None:
                pk, pv, ppos = past
                k = torch.cat([pk, k], dim=2)
                v = torch.cat([pv, v], dim=2)
                kpos = torch.cat([ppos, pos])
            keep = self.window - 1
            state[id(self)] = (k[:, :, -keep:].clone(), v[:, :, -keep:].clone(), kpos[-keep:].clone())
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        rel = pos[:, None] - kpos[None, :]
        allowed = (rel >= 0) & (rel < self.window)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out: Tensor = self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return out


class _Mlp(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LayerScale(nn.Module):
    """A learnt per-channel scale on a residual branch (decoder and encoder transformers)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, state: _StateDict | None) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, pos, state))
        out: Tensor = x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))
        return out


class DecoderTransformer(nn.Module):
    """Sliding-window causal transformer between ``pre_conv`` and the upsampler."""

    inv_freq: Tensor

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        # Computed on the CPU even under a meta-device context (an op on meta imports torch._dynamo).
        steps = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device="cpu")
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta ** (steps / cfg.head_dim)), persistent=False)

    def forward(self, x: Tensor, state: _StateDict | None = None) -> Tensor:
        """``x``: [batch, frames, latent]; positions continue from the frames already streamed."""
        start = 0 if state is None else int(state.get(id(self), 0))
        t = x.shape[1]
        pos = torch.arange(start, start + t, device=x.device)
        if state is not None:
            state[id(self)] = start + t
        freqs = pos.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, pos, state)
        out: Tensor = self.output_proj(self.norm(h))
        return out


# --------------------------------------------------------------------------- quantizer


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))
        self._table: Tensor | None = None
        self.rows_from: FileRows | None = None
        """On the CPU (``_read_decoder``): the stored sums, read row by row when looked up, each row
        divided by its usage as ``table`` divides it; ``embedding_sum`` is then an untouched view of
        the file. The 16 tables of the released decoder are 32 MiB in float32, and a push looks up
        16 rows a frame. None: ``table`` is computed once (``compact``) and looked up."""
        self.rows_dtype: torch.dtype = torch.float32
        """The dtype of the rows ``lookup`` gives with ``rows_from`` (the decoder's)."""
        self._usage: Tensor | None = None
        """``cluster_usage`` in float32, clamped as ``table`` clamps it (``lookup``, first call)."""

    def lookup(self, codes: Tensor) -> Tensor:
        """The centroids of ``codes`` (``F.embedding(codes, self.table())``)."""
        source = self.rows_from
        if source is None or codes.device.type != "cpu":
            return F.embedding(codes, self.table())
        usage = self._usage
        if usage is None:
            usage = self._usage = self.cluster_usage.detach().float().clamp(min=1e-5)
        return (source.take(codes).float() / usage[codes].unsqueeze(-1)).to(self.rows_dtype)

    def compact(self) -> None:
        """Compute the table now and keep only it: ``embedding_sum`` becomes the table and
        ``cluster_usage`` ones (``table`` gives the same values from them), so the stored sums are
        not kept beside the table."""
        with torch.no_grad():
            table = self.table().detach()
        self.embedding_sum = nn.Parameter(table, requires_grad=False)
        self.cluster_usage = nn.Parameter(torch.ones_like(self.cluster_usage.detach()), requires_grad=False)
        self._table = self.embedding_sum.detach()

    def table(self) -> Tensor:
        """Centroids ``embedding_sum / max(cluster_usage, 1e-5)``, computed in float32 once."""
        table = self._table
        if table is None or table.device != self.embedding_sum.device or table.dtype != self.embedding_sum.dtype:
            usage = self.cluster_usage.float().clamp(min=1e-5)
            table = (self.embedding_sum.float() / usage[:, None]).to(self.embedding_sum.dtype)
            self._table = table
        return table


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _VQLayers(nn.Module):
    def __init__(self, n: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_VQ(size, dim) for _ in range(n)])


class _RVQ(nn.Module):
    """One half of the split RVQ: codebooks summed, then projected 1x1 to the frame width."""

    def __init__(self, n: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.vq = _VQLayers(n, size, dim)
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)
        """Unused when decoding; present in the checkpoint."""
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def decode(self, codes: Tensor) -> Tensor:
        """``codes``: [batch, n, frames] -> [batch, out_dim, frames]."""
        total: Tensor | None = None
        for i, layer in enumerate(self.vq.layers):
            assert isinstance(layer, _VQ)
            q = layer._codebook.lookup(codes[:, i])
            total = q if total is None else total + q
        assert total is not None
        out: Tensor = self.output_proj(total.transpose(1, 2))
        return out


class SplitRVQDecoder(nn.Module):
    """Semantic (first codebook) and acoustic (the rest) RVQ halves, summed."""

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = _RVQ(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = _RVQ(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def decode(self, codes: Tensor) -> Tensor:
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# --------------------------------------------------------------------------- the decoder


class CodecDecoder(nn.Module):
    """Codec frames -> 24 kHz audio; one-shot ``decode`` and exact streaming ``stream()``."""

    def __init__(self, cfg: CodecDecoderConfig, sample_rate: int = 24000) -> None:
        super().__init__()
        self.cfg = cfg
        self.sample_rate = sample_rate
        """Hertz of the output."""
        self.samples_per_frame = cfg.samples_per_frame
        """Output samples per codec frame (1920)."""
        self.num_quantizers = cfg.num_quantizers
        self.quantizer = SplitRVQDecoder(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = DecoderTransformer(cfg)
        self.upsample = nn.ModuleList(
            [
                nn.ModuleList(
                    [CausalConvTranspose1d(cfg.latent_dim, cfg.latent_dim, f, f), ConvNeXtBlock(cfg.latent_dim)]
                )
                for f in cfg.upsampling_ratios
            ]
        )
        layers: list[nn.Module] = [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
        for i, rate in enumerate(cfg.upsample_rates):
            layers.append(DecoderBlock(cfg.decoder_dim // 2**i, cfg.decoder_dim // 2 ** (i + 1), rate))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        layers += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(layers)

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_folder(
        cls,
        folder: Path | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        weights: torch.dtype | None = None,
    ) -> CodecDecoder:
        """Load from a ``speech_tokenizer`` folder (``config.json`` + ``model.safetensors``).

        ``weights``: the dtype of the matrix weights (convs other than depthwise, transposed convs,
        linears of a width the native kernels take), ``dtype`` by default. ``torch.bfloat16`` with
        float32 ``dtype`` on the CPU is the bfloat16 decoder (``codec_weights``): weights at half
        the bytes, activations, norms and SnakeBeta in float32; its linears need the native
        kernels (``prepare_native``).
        """
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        cfg = CodecDecoderConfig.from_dict(raw.get("decoder_config") or {})
        sample_rate = int(raw.get("output_sample_rate", 24000))
        with no_weight_init(), torch.device("meta"):
            model = cls(cfg, sample_rate)
        state, rows = _read_decoder(folder / "model.safetensors", model, torch.device(device), dtype, weights or dtype)
        model.load_state_dict(state, strict=True, assign=True)
        del state
        for name, source in rows.items():
            book = model.get_submodule(name)
            assert isinstance(book, _Codebook)
            book.rows_from, book.rows_dtype = source, dtype
        inv_freq = model.pre_transformer.inv_freq  # float32; a cast would round it
        model = model.to(device=device).eval()  # _read_decoder gave every tensor its dtype
        if model._device().type == "cpu":
            for module in model.modules():
                if isinstance(module, (CausalConv1d, CausalConvTranspose1d)):
                    module.relayout()
        for module in model.modules():
            if isinstance(module, _Codebook) and module.rows_from is None:
                module.compact()
        model.pre_transformer.inv_freq = inv_freq.to(device)
        model.requires_grad_(False)
        log.info(
            "codec_decoder_loaded", folder=str(folder), device=str(device), dtype=str(dtype),
            weights=str(weights or dtype),
        )  # fmt: skip
        return model

    def int8_upsampler(self, ext: Any) -> int:
        """Give the upsampler's ConvNeXt linears int8 weights on the native kernels (``int8_upsampler``
        says when); returns how many. Call before packing the rest (``native.pack_linears``), on
        the CPU: each weight is quantized from the dtype it was loaded in."""
        from s2s_daemon.tts.torch_qwen3.native import pack_linears

        return pack_linears(self.upsample, "int8", ext)

    def prepare_native(self, ext: Any, int8: bool = False) -> None:
        """Put the CPU decoder on the native kernels as the engine runs it: with ``int8`` the
        upsampler's linears in int8 (``int8_upsampler``), every other linear packed in the matrix
        weights' dtype, then the convs' few-column products and SnakeBeta (``use_native``)."""
        from s2s_daemon.tts.torch_qwen3.native import pack_linears

        if int8:
            self.int8_upsampler(ext)
        pack_linears(self, "bfloat16" if self.weights_dtype() == torch.bfloat16 else "float32", ext)
        self.use_native(ext)

    def weights_dtype(self) -> torch.dtype:
        """The dtype of the matrix weights (``from_folder``'s ``weights``)."""
        return self.pre_conv.conv.weight.dtype

    def use_native(self, ext: Any) -> int:
        """Run the few-column GEMMs of the convs and the SnakeBeta activations through the native
        kernels; returns how many layers take them (call after loading, on the CPU, float32 activations).

        Up to how many columns: with float32 weights, ``native_row_limit`` measures it once on this
        machine's BLAS (the largest transposed conv's weight), for these convs and the decoder's float32
        ``PackedLinear``s; with bfloat16 weights, up to the streaming kernel's rows (weight-bound, no
        activation rounded), oneDNN's bfloat16 products beyond (``scripts/bench_codec.py`` compares).
        """
        from s2s_daemon.tts.torch_qwen3.native import PackedLinear

        largest = max(
            (m.weight_t for m in self.modules() if isinstance(m, CausalConvTranspose1d) and m.weight_t is not None),
            key=lambda w: w.numel(),
            default=None,
        )
        if largest is not None and largest.dtype == torch.bfloat16:
            rows = int(ext.MAX_STREAM_ROWS)
        elif largest is not None and _takes_native_gemm(largest, None):
            rows = native_row_limit(ext, largest)
        else:
            rows = 0
        count = 0
        for module in self.modules():
            if isinstance(module, (CausalConv1d, CausalConvTranspose1d)):
                module.native_rows = rows
            elif isinstance(module, PackedLinear) and module.fmt == "float32":
                module.max_rows = min(module.max_rows, rows or int(ext.MAX_BLOCKED_ROWS))
            if isinstance(module, CausalConv1d):
                weight = module.gemm_weight()
                if weight is not None and _takes_native_gemm(weight, module.conv.bias):
                    module.ext = ext
                    count += 1
            elif isinstance(module, CausalConvTranspose1d):
                if module.weight_t is not None and _takes_native_gemm(module.weight_t, None):
                    module.ext = ext
                    count += 1
            elif isinstance(module, SnakeBeta):
                module.use_native(ext)
                count += 1
        return count

    def pack_onednn(self) -> int:
        """Give the convs kept for oneDNN's bfloat16 convolution (``weight_low``) their weight in
        oneDNN's layout for one frame's columns, in place of the plain one
        (``CausalConv1d.pack_onednn``); returns how many. Call after ``use_native``, on the CPU: the
        columns a frame gives each conv are counted on a one-frame push. Every push of these convs
        then runs on oneDNN, those of a few columns too.

        The engine does not call it: the layout is the one oneDNN wants at the threads in force
        here, and a push with another count lays the weight out again on every call (from this
        layout, slower than from the plain one). ``scripts/bench_codec.py``'s ``bfloat16-packed``
        form measures it, packed at ``--pack-threads``."""
        convs = [m for m in self.modules() if isinstance(m, CausalConv1d) and m.weight_low is not None]
        if not convs or not _onednn_here():
            return 0
        columns: dict[int, int] = {}

        def count(module: nn.Module, args: tuple[Any, ...]) -> None:
            columns.setdefault(id(module), int(args[0].shape[-1]))

        hooks = [m.register_forward_pre_hook(count) for m in convs]
        try:
            with torch.inference_mode():
                self.stream().push(torch.zeros(1, self.num_quantizers, dtype=torch.long))
        finally:
            for hook in hooks:
                hook.remove()
        packed = sum(m.pack_onednn(columns[id(m)]) for m in convs)
        if packed:
            log.info("codec_onednn_packed", convs=packed, of=len(convs))
        return packed

    # ---------------------------------------------------------------- running

    def _run(self, codes: Tensor, state: _StateDict | None) -> Tensor:
        """``codes``: [batch, num_quantizers, frames] -> [batch, frames * samples_per_frame]."""
        h = self.quantizer.decode(codes)
        h = self.pre_conv(h, state)
        h = self.pre_transformer(h.transpose(1, 2), state).transpose(1, 2)
        for stage in self.upsample:
            assert isinstance(stage, nn.ModuleList)
            for layer in stage:
                h = layer(h, state)
        for layer in self.decoder:
            h = layer(h) if isinstance(layer, SnakeBeta) else layer(h, state)
        out: Tensor = h.clamp(-1.0, 1.0)[:, 0]
        return out

    def _check(self, codes: Tensor) -> Tensor:
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [frames, {self.num_quantizers}], got {tuple(codes.shape)}")
        if codes.numel() and bool(((codes < 0) | (codes >= self.cfg.codebook_size)).any()):  # one device sync
            raise ValueError(f"codes must lie in [0, {self.cfg.codebook_size})")
        return codes.to(device=self._device(), dtype=torch.long).T.unsqueeze(0)

    def _device(self) -> torch.device:
        return self.pre_conv.conv.weight.device

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """One-shot decode: ``codes`` [frames, 16] -> float samples [frames * 1920] at 24 kHz."""
        c = self._check(codes)
        state: _StateDict = {}
        step = DECODE_CHUNK_FRAMES
        pieces = [self._run(c[..., i : i + step], state) for i in range(0, c.shape[-1], step)]
        if not pieces:
            return torch.zeros(0, device=self._device(), dtype=self.pre_conv.conv.weight.dtype)
        return torch.cat(pieces, dim=-1)[0]

    @torch.inference_mode()
    def forward_full(self, codes: Tensor) -> Tensor:
        """The plain stateless forward over all frames at once (reference for tests)."""
        return self._run(self._check(codes), None)[0]

    def stream(self) -> StreamingDecodeState:
        """Start a streaming decode; see the module docstring for the scheme."""
        return StreamingDecodeState(self)

    def receptive_field_frames(self) -> int:
        """Frames before a new frame that can still change its audio (the state carried covers them)."""
        cfg = self.cfg
        frames = float(cfg.num_hidden_layers * (cfg.sliding_window - 1))
        frames += self.pre_conv.context
        rate = 1
        for stage in self.upsample:
            assert isinstance(stage, nn.ModuleList)
            tconv, block = stage[0], stage[1]
            assert isinstance(tconv, CausalConvTranspose1d) and isinstance(block, ConvNeXtBlock)
            frames += tconv.context / rate
            rate *= tconv.stride
            frames += block.dwconv.context / rate
        for layer in self.decoder:
            if isinstance(layer, CausalConv1d):
                frames += layer.context / rate
            elif isinstance(layer, DecoderBlock):
                tconv = layer.block[1]
                assert isinstance(tconv, CausalConvTranspose1d)
                frames += tconv.context / rate
                rate *= tconv.stride
                for unit in layer.block[2:]:
                    assert isinstance(unit, ResidualUnit)
                    frames += unit.conv1.context / rate
        return math.ceil(frames)


class StreamingDecodeState:
    """Incremental decoder: each ``push`` returns the audio of exactly the frames pushed."""

    def __init__(self, decoder: CodecDecoder) -> None:
        self._decoder = decoder
        self._state: _StateDict = {}
        self.frames = 0
        """Frames pushed so far."""

    @torch.inference_mode()
    def push(self, codes: Tensor) -> Tensor:
        """``codes`` [n, 16] -> samples [n * 1920] for exactly these frames (causal: no look-ahead)."""
        dec = self._decoder
        c = dec._check(codes)
        if c.shape[-1] == 0:
            return torch.zeros(0, device=dec._device(), dtype=dec.pre_conv.conv.weight.dtype)
        self.frames += c.shape[-1]
        return dec._run(c, self._state)[0]

    def copy(self) -> StreamingDecodeState:
        """An independent stream that continues from exactly this point (the state's tensors copied):
        a voice's reference frames are decoded once, and each request continues from a copy."""
        twin = StreamingDecodeState(self._decoder)
        twin._state = {key: _copied(value) for key, value in self._state.items()}
        twin.frames = self.frames
        return twin

    def state_bytes(self) -> int:
        """Bytes of the tensors the stream carries between pushes."""
        total = 0
        for value in self._state.values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, Tensor):
                    total += item.numel() * item.element_size()
        return total

    def flush(self) -> Tensor:
        """Nothing is held back (no look-ahead), so this is always empty."""
        return torch.zeros(0, device=self._decoder._device(), dtype=self._decoder.pre_conv.conv.weight.dtype)


def _copied(value: Any) -> Any:
    """A streaming state's value with its tensors cloned (tensors, tuples of them, or plain ints)."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_copied(item) for item in value)
    return value


def matrix_weights(model: CodecDecoder) -> set[str]:
    """Names of the weights ``from_folder``'s ``weights`` dtype applies to: convs other than
    depthwise, transposed convs, and linears whose width the native kernels take."""
    from s2s_daemon.tts.torch_qwen3.native import packable

    names = set()
    for name, m in model.named_modules():
        if isinstance(m, CausalConvTranspose1d) or (isinstance(m, CausalConv1d) and m.conv.groups == 1):
            names.add(f"{name}.conv.weight")
        elif isinstance(m, nn.Linear) and packable(m.in_features, "bfloat16"):
            names.add(f"{name}.weight")
    return names


def _read_decoder(
    path: Path, model: CodecDecoder, device: torch.device, dtype: torch.dtype, weights: torch.dtype
) -> tuple[dict[str, Tensor], dict[str, FileRows]]:
    """(the ``decoder.*`` tensors of a speech-tokenizer file, prefix removed, for ``model`` (on meta),
    in ``dtype`` (``matrix_weights`` in ``weights``); on the CPU, the codebooks' sums as rows read
    when looked up, by codebook module name: ``_Codebook.rows_from``).

    Tensors used as stored are views of the file's mapping (pages read when first used); those
    that loading converts (cast, moved to another device, relaid by the convs' ``relayout``, the
    codebooks turned into tables by ``compact``) are read into buffers of their own and converted
    one at a time, so the mapping's pages of their stored form never become resident beside the
    converted copy, and no second copy of the decoder is ever whole. Tensors smaller than
    ``VIEW_MIN_BYTES`` are read too: a fault on a mapping makes the kernel map the cached pages
    around it (``fault_around_bytes``, 64 KiB), so a view of each small bias and norm would keep
    up to 64 KiB of the file resident.
    """

    prefix = "decoder."
    # inv_freq is derived, never needed
    files = TensorFiles([path], lambda key: key.startswith(prefix) and not key.endswith("rotary_emb.inv_freq"))
    relaid = {
        f"{name}.conv.weight"
        for name, m in model.named_modules()
        if isinstance(m, CausalConvTranspose1d)
        or (isinstance(m, CausalConv1d) and m.conv.groups == 1 and m.conv.kernel_size[0] > 1)
    }
    matrices = matrix_weights(model) if weights != dtype else set()
    out: dict[str, Tensor] = {}
    rows: dict[str, FileRows] = {}
    try:
        for key, stored in files.tensors.items():
            name = key[len(prefix) :]
            target = weights if name in matrices else dtype
            if name.endswith("._codebook.embedding_sum") and device.type == "cpu" and len(stored.shape) == 2:
                out[name] = files.view(key)  # never touched: its rows are read when looked up
                rows[name.removesuffix(".embedding_sum")] = files.rows(key)
                continue
            cast = stored.dtype.is_floating_point and stored.dtype != target
            codebook = name.endswith(("._codebook.embedding_sum", "._codebook.cluster_usage"))
            converted = name in relaid or codebook or device.type != "cpu" or cast
            t = files.read(key) if converted or stored.nbytes < VIEW_MIN_BYTES else files.view(key)
            out[name] = t.to(target) if cast else t
            del t
    finally:
        files.close()
    return out, rows
