"""Qwen3 decoder building blocks in plain torch, named so the official state dict loads unchanged.

RMSNorm, grouped-query attention with per-head q/k RMSNorm and rotary embeddings, SwiGLU MLP.
Attention writes into a caller-owned static KV cache; nothing here grows a tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from s2s_daemon.tts.torch_qwen3.config import DecoderConfig


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``parts``' outputs (same input)."""
    out_features = sum(p.out_features for p in parts)
    has_bias = parts[0].bias is not None
    with no_weight_init(), torch.device("meta"):  # the weights are assigned below: no random init
        fused = nn.Linear(parts[0].in_features, out_features, bias=has_bias)
    if parts[0].weight.is_meta:
        # A skeleton whose weights come later (prepared.py): the meta shapes are all it needs, and
        # torch.cat on meta tensors imports torch._dynamo for its meta kernel (seconds of a start).
        return fused
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts], dim=0), requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(
            torch.cat([p.bias.detach() for p in parts if p.bias is not None], dim=0), requires_grad=False
        )
    return fused


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")  # fmt: skip


@contextmanager
def no_weight_init() -> Iterator[None]:
    """Build modules without their random initialisation (their weights are loaded afterwards).

    ``torch.nn.init``'s functions become no-ops meanwhile. Even on the meta device they are not
    free: the first ``normal_`` there imports ``torch._dynamo`` (seconds of a start), and a real
    ``kaiming_uniform_`` over a fused 6144 x 1024 weight costs more than copying the weights in.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def keep(tensor: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def fuse_projections(root: nn.Module) -> None:
    """Fuse q/k/v and gate/up projections of every layer under ``root`` (after weights are loaded)."""
    for module in list(root.modules()):
        if isinstance(module, (Attention, SwiGLU)):
            module.fuse()


SMALL_BATCH_ROWS = (2, 32)
"""Row counts (inclusive) that ``SmallBatchLinear`` computes as ``(W @ x^T)^T``."""


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` that computes a few rows (2..32) as ``(W @ x^T)^T`` on the CPU.

    torch's CPU BLAS runs ``x @ W^T`` for a handful of rows at a fraction of the speed of the
    same product written ``W @ x^T`` (``scripts/bench_codec.py`` measures the decoder with it).
    Those shapes are every linear of the codec decoder's transformer and ConvNeXt blocks on a
    streamed chunk, a short prompt's prefill and the code predictor's 2-row first step. Other row
    counts, other devices and dtypes, and non-contiguous weights take ``F.linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        w = self.weight
        if not (SMALL_BATCH_ROWS[0] <= rows <= SMALL_BATCH_ROWS[1]) or w.device.type != "cpu":
            return F.linear(x, w, self.bias)
        if w.dtype != torch.float32 or x.dtype != torch.float32 or not w.is_contiguous():
            return F.linear(x, w, self.bias)
        out = torch.mm(w, x.reshape(rows, self.in_features).t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def small_batch_linears(root: nn.Module) -> int:
    """Make every plain ``nn.Linear`` under ``root`` a ``SmallBatchLinear`` (same parameters)."""
    count = 0
    for module in root.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
            count += 1
    return count


def matvec_layout(root: nn.Module) -> int:
    """Store wide CPU float32 weights column-major; returns how many linears changed.

    Decoding runs every linear on one row. For ``out_features > in_features`` torch's CPU BLAS
    reads a column-major weight (``W.t().contiguous().t()``, same values and shape) faster than a
    row-major ``[out, in]`` one in that matrix-vector product; square and narrow weights gain
    nothing and stay as they are. Decoding gets faster per frame, a prefill a little slower
    (``scripts/bench_torch.py``). Call after ``fuse_projections``; the int8 path replaces these
    linears and does not need it.
    """
    count = 0
    for module in root.modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or module.out_features <= module.in_features:
            continue
        module.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
        count += 1
    return count


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the official model does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The official order (normalize in float32, cast back, then scale) is kept. For float32 input
        # the explicit form runs half the ops of F.rms_norm's CPU decomposition (no casts), which
        # matters on the ~430 norms of a decoded frame, each over one 128..1024-wide row.
        if x.dtype == torch.float32:
            return self.weight * (x * (x * x).mean(-1, keepdim=True).add_(self.eps).rsqrt_())
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(cfg: DecoderConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, float32 ``[max_positions, head_dim]``.

    For multimodal RoPE the channel pairs are split among the temporal/height/width axes (interleaved
    or in sections). A TTS prompt is text only, so the three axes carry the same position and every
    pair sees that position: the table below is built per axis and assembled the official way, which
    makes the equivalence explicit rather than assumed.
    """
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    pos = torch.arange(max_positions, dtype=torch.float64)
    axis_pos = [pos, pos, pos] if cfg.mrope_section else [pos]
    freqs_per_axis = [torch.outer(p, inv_freq) for p in axis_pos]  # each [P, half]
    if cfg.mrope_section:
        sections = cfg.mrope_section
        if cfg.mrope_interleaved:
            freqs = freqs_per_axis[0].clone()
            n_axes = len(sections)
            for axis in range(1, n_axes):
                idx = torch.arange(axis, sections[axis] * n_axes, n_axes)
                freqs[:, idx] = freqs_per_axis[axis][:, idx]
        else:
            parts = []
            start = 0
            for axis, width in enumerate(sections):
                parts.append(freqs_per_axis[axis % 3][:, start : start + width])
                start += width
            freqs = torch.cat(parts, dim=-1)
    else:
        freqs = freqs_per_axis[0]
    assert freqs.shape[-1] == half
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[1, heads, T, head_dim]`` by cos/sin ``[T, head_dim]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention with q/k norms over the head dimension."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None
        """q, k and v projections in one matrix once ``fuse()`` ran (after loading)."""

    def fuse(self) -> None:
        """Replace q/k/v projections by one linear: one matrix-vector product instead of three."""
        qkv = fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = qkv

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward over ``x`` ``[1, T, hidden]`` placed at positions ``start..start+T-1``.

        Two cache disciplines:
        - ``positions`` None (eager): write the cache slice ``[start, start+T)`` and attend to
          ``[0, start+T)`` by slicing; causal within the block.
        - ``positions`` given (static shapes for CUDA graphs, T == 1): write at ``positions`` with
          ``index_copy_`` and attend over the whole cache with the additive ``mask``.
        """
        _, t, _ = x.shape
        nq = self.num_heads * self.head_dim
        nkv = self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            q_lin, k_lin, v_lin = qkv[..., :nq], qkv[..., nq : nq + nkv], qkv[..., nq + nkv :]
        else:
            q_lin, k_lin, v_lin = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q_lin.reshape(1, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k_lin.reshape(1, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v_lin.reshape(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin).to(x.dtype)
        k = apply_rope(k, cos, sin).to(x.dtype)
        if positions is None:
            end = start + t
            k_cache[:, :, start:end].copy_(k)
            v_cache[:, :, start:end].copy_(v)
            keys = k_cache[:, :, :end]
            values = v_cache[:, :, :end]
            if t == 1:
                out = F.scaled_dot_product_attention(q, keys, values, scale=self.scale, enable_gqa=True)
            elif start == 0:
                out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                causal = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=causal, scale=self.scale, enable_gqa=True
                )
        else:
            k_cache.index_copy_(2, positions, k)
            v_cache.index_copy_(2, positions, v)
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=self.scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(1, t, self.num_heads * self.head_dim)
        return self.o_proj(out)  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.intermediate = intermediate
        self.gate_up_proj: nn.Linear | None = None
        """gate and up projections in one matrix once ``fuse()`` ran."""

    def fuse(self) -> None:
        self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gu = self.gate_up_proj(x)
            return self.down_proj(F.silu(gu[..., : self.intermediate]) * gu[..., self.intermediate :])  # type: ignore[no-any-return]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, start, mask, positions)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


NATIVE_STACK_ROWS = 4
"""Positions per call that ``native.Stack`` streams each weight for (its ``kMaxRows``): decoding steps
and the code predictor's 2-position first step. A stack of integer weights also takes a prompt, up to
``Stack.max_rows`` positions a call; float weights' prompts take the Python layers."""


class DecoderStack(nn.Module):
    """``layers`` + final ``norm``; the embedding tables live with the owner (names follow the checkpoint)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.native: Any = None
        """``native.Stack`` running one CPU position in C++ (set by ``native.fuse_stacks``)."""
        self.native_prompt = False
        """Longer inputs (a prompt) through ``native`` too, up to ``native.max_rows`` positions a call
        (set by ``native.fuse_stacks`` for integer weights, where that is the faster path)."""

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run every layer; returns the final-normed hidden states ``[1, T, hidden]``."""
        n = x.shape[1]
        if self.native is not None and positions is None and n <= NATIVE_STACK_ROWS:
            return self.native.run(x, cache.k, cache.v, cos, sin, start)  # type: ignore[no-any-return]
        if self.native is not None and positions is None and self.native_prompt:
            # A prompt block by block: each block attends to the cache the blocks before it wrote.
            step = self.native.max_rows
            if n <= step:
                return self.native.run(x, cache.k, cache.v, cos, sin, start)  # type: ignore[no-any-return]
            blocks = [
                self.native.run(
                    x[:, i : i + step].contiguous(),
                    cache.k,
                    cache.v,
                    cos[i : i + step].contiguous(),
                    sin[i : i + step].contiguous(),
                    start + i,
                )
                for i in range(0, n, step)
            ]
            return torch.cat(blocks, dim=1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], start, mask, positions)
        return self.norm(x)  # type: ignore[no-any-return]

    def run_rows(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache], rows: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Rows of several sequences in one pass (a decoding step of several requests).

        Row ``r`` of ``x`` ``[1, R, hidden]`` sits at position ``rows[r][1]`` of
        ``caches[rows[r][0]]`` and attends to that cache up to there; ``cos``/``sin`` ``[R, head_dim]``
        are the rows' own. Rows of one cache at consecutive positions are causal among themselves.
        The native stack reads each weight once for up to ``NATIVE_STACK_ROWS`` rows (integer
        weights: ``native.max_rows``); elsewhere each run of one cache's consecutive rows is its own
        ``run`` (correct, not faster).
        """
        n = x.shape[1]
        if self.native is not None:
            parts = []
            step = self.native.max_rows if self.native_prompt else NATIVE_STACK_ROWS
            for i in range(0, n, step):  # rows in order: a later call sees an earlier one's keys
                part = rows[i : i + step]
                parts.append(
                    self.native.run_rows(
                        x[:, i : i + len(part)].contiguous(),
                        [c.k for c in caches],
                        [c.v for c in caches],
                        cos[i : i + len(part)].contiguous(),
                        sin[i : i + len(part)].contiguous(),
                        [c for c, _ in part],
                        [p for _, p in part],
                    )
                )
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        outs = []
        i = 0
        while i < n:
            cache, start = rows[i]
            j = i + 1
            while j < n and rows[j] == (cache, start + j - i):
                j += 1
            outs.append(self.run(x[:, i:j], cos[i:j], sin[i:j], caches[cache], start))
            i = j
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class KVCache:
    """Preallocated keys and values for every layer: ``[layers, 1, kv_heads, max_len, head_dim]``.

    On the CPU the buffers are left unwritten: every reader there (the eager attention's slice, the
    native stack) reads only the positions written before it, and a page of a fresh allocation
    becomes resident only when written, so a cache sized for the whole frame budget costs memory
    for the positions an utterance reaches. CUDA graphs attend over the whole cache under a mask,
    where an unwritten NaN would poison the sum: zeros there.
    """

    __slots__ = ("k", "max_len", "v")

    def __init__(self, cfg: DecoderConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (cfg.num_layers, 1, cfg.num_kv_heads, max_len, cfg.head_dim)
        make = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k = make(shape, device=device, dtype=dtype)
        self.v = make(shape, device=device, dtype=dtype)
        self.max_len = max_len
