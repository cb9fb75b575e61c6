"""The native CPU kernels (``torch_qwen3/native``) against plain torch on the same weights, on
every instruction-set path this CPU can run (x86-64: ``generic``, ``avx2``, ``avx512``; aarch64:
``generic``, ``neon``, ``dotprod``, ``i8mm``), and the paths against each other. The tests marked
``arm64`` also run on emulated aarch64 CPUs (``scripts/arm64_check.sh``).

The library is built at install (``pip install -e .``, as ``scripts/test`` does). Where it is
missing these tests fail when a C++ compiler is on PATH (the install should have built it) and
are skipped, with the reason, where there is none.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from s2s_daemon.tts.isa import architecture, paths_of  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import native  # noqa: E402
from s2s_daemon.tts.torch_qwen3.config import DecoderConfig  # noqa: E402
from s2s_daemon.tts.torch_qwen3.layers import DecoderStack, KVCache, fuse_projections, rope_tables  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]


def _library_or_skip() -> None:
    reason = native.why_not_here()
    if reason is not None and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(f"native kernels not built (no C++ compiler here): {reason}")
    assert reason is None, reason


def _runnable() -> list[str]:
    return [name for name in native.carried_paths() if name in native.runnable_paths()]


@pytest.fixture(scope="module")
def ext() -> Any:
    """The kernels ``auto`` picks."""
    _library_or_skip()
    kernels = native.load()
    assert kernels is not None, native.unavailable_reason()
    return kernels


@pytest.fixture(scope="module", params=list(paths_of(architecture())))
def path(request: pytest.FixtureRequest) -> Any:
    """The kernels of one path of this architecture; skipped where this CPU or build has no such path."""
    _library_or_skip()
    if request.param not in _runnable():
        pytest.skip(f"no {request.param} path here (runnable: {', '.join(_runnable())})")
    kernels = native.load(request.param)
    assert kernels is not None and kernels.isa == request.param
    return kernels


@pytest.mark.arm64
def test_one_build_carries_every_path_of_its_architecture() -> None:
    """x86-64: generic, avx2, avx512, amx (built by a compiler with AMX); aarch64: generic, neon, dotprod, i8mm,
    each checked against the CPU before it runs (``scripts/arm64_check.sh`` runs them on three
    emulated CPUs)."""
    _library_or_skip()
    assert native.carried_paths() == paths_of(architecture())
    assert native.load() is not None and native.load().isa == _runnable()[-1]


def _linear(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.05)
        if bias:
            layer.bias.normal_(0.0, 0.1)
    return layer


@pytest.mark.slow
@pytest.mark.arm64
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_packing_error_is_within_half_a_step(path: Any, fmt: str) -> None:
    layer = _linear(48, 256, bias=False)
    packed = native.PackedLinear(layer, fmt, path, group=64)
    w = layer.weight.detach()
    got = packed.dequantized()
    assert got.shape == w.shape
    err = (got - w).abs()
    if fmt == "float32":
        assert torch.equal(got, w)
    elif fmt == "bfloat16":
        torch.testing.assert_close(got, w.to(torch.bfloat16).float(), rtol=0, atol=0)
    elif fmt == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
        assert bool((err <= step / 2 + 1e-7).all())
    else:
        g = w.reshape(48, 4, 64)
        step = ((g.amax(dim=2) - g.amin(dim=2)) / 15).repeat_interleave(64, dim=1)
        assert bool((err <= step / 2 + 1e-6).all())
    assert packed.weight_bytes < w.numel() * 4 or fmt == "float32"


@pytest.mark.arm64
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(48, 256), (33, 128), (1, 64)])  # odd rows: a lone last row
def test_extension_packs_as_the_reference(ext: Any, fmt: str, shape: tuple[int, int]) -> None:
    """``ext.pack`` (one pass, at load time) writes exactly what the torch-op reference writes:
    codes, scales and mins bit for bit, ties to even and a constant row (zero range) included."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 0.05
    w[0, :32] = 0.25  # a constant block and group
    w[-1, 3] = 0.0
    for group in (32, 64) if fmt == "int4" else (0,):
        got = native._pack(w, fmt, group, ext)
        want = native._pack_reference(w, fmt, group)
        for g, r in zip(got, want, strict=True):
            assert (g is None) == (r is None)
            if g is not None:
                assert g.dtype == r.dtype and torch.equal(g, r)


@pytest.mark.arm64
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 33, 70])  # streamed, blocked (<= 64), widened for torch.mm
@pytest.mark.parametrize("shape", [(64, 96), (320, 512), (33, 128)])  # odd out_features: a lone last row
def test_linear_matches_the_dequantized_weight(path: Any, fmt: str, rows: int, shape: tuple[int, int]) -> None:
    """Each path against a float reference: the float product of the weight as it dequantizes
    (and, for few rows of integer weights, of the input as the kernels quantize it)."""
    n, k = shape
    layer = _linear(n, k, bias=True, seed=rows)
    packed = native.PackedLinear(layer, fmt, path, group=32 if k % 64 else 64)
    x = torch.randn(1, rows, k)
    expected = F.linear(x, packed.dequantized(), layer.bias.detach())
    got = packed(x)
    assert got.shape == (1, rows, n)
    if fmt in ("int8", "int4") and rows <= path.MAX_BLOCKED_ROWS:
        # Integer products (decoding's rows and a prompt's) quantize the input to int8 per block of
        # 32 (as GGML's Q8_0 does) and multiply in integers: the same as float products with that
        # quantized input; the amx path's prompt rounds it to bfloat16 (_integer_reference).
        # Beyond, blocks of widened weights go to torch.mm with the float input.
        expected = _integer_reference(path.isa, fmt, x, packed.dequantized(), layer.bias.detach())
        assert float((got - F.linear(x, packed.dequantized(), layer.bias.detach())).abs().max()) > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.arm64
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 33, 70])
def test_every_path_computes_what_the_generic_one_does(fmt: str, rows: int) -> None:
    """The paths against each other on the same packed tensors: the same products in another
    summation order (within float32 rounding of the sums)."""
    _library_or_skip()
    generic = native.load("generic")
    assert generic is not None
    layer = _linear(96, 256, bias=True, seed=rows + 7)
    reference = native.PackedLinear(layer, fmt, generic, group=64)
    x = torch.randn(rows, 256) * 2
    want = reference(x)
    for name in _runnable():
        other = native.load(name)
        assert other is not None
        packed = native.PackedLinear.from_parts(
            fmt, reference.data, reference.scales, reference.mins, reference.bias, 256, 96, other, 64
        )
        assert torch.equal(packed.dequantized(), reference.dequantized()), name
        expected = want
        if name == "amx" and fmt in ("int8", "int4") and other.MAX_STREAM_ROWS < rows <= other.MAX_BLOCKED_ROWS:
            expected = _integer_reference(name, fmt, x, reference.dequantized(), reference.bias)
        torch.testing.assert_close(packed(x), expected, rtol=2e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def _q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to int8 per block of 32 along the last axis, scale max|x| / 127."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    scale = amax / 127
    # Rounded as kernels.h's quantize_rows rounds: x times 127 / amax (x / scale rounds a value near
    # a half step the other way now and then: one code apart, 1e-3 of the output).
    q = torch.where(amax > 0, torch.round(blocks * (127 / amax.clamp(min=1e-30))), torch.zeros_like(blocks))
    return (q * scale).reshape(x.shape)


def _integer_reference(
    isa: str, fmt: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What the kernels of path ``isa`` compute for ``x`` (2 to 64 rows) by int8 or 4-bit weights
    that dequantize to ``weight``: the float product of the input quantized as ``_q8_blocks`` does;
    on ``amx`` a prompt (more than ``MAX_STREAM_ROWS`` rows) multiplies on bfloat16 tiles instead:
    the input rounded to bfloat16, int8 codes exact (the row's scale applied to the sums), 4-bit
    weights rounded to bfloat16 once dequantized."""
    if isa == "amx" and x.shape[-2] > native.load("amx").MAX_STREAM_ROWS:  # type: ignore[union-attr]
        w = weight if fmt == "int8" else weight.bfloat16().float()
        return F.linear(x.bfloat16().float(), w, bias)
    return F.linear(_q8_blocks(x), weight, bias)


@pytest.mark.arm64
def test_int4_group_sizes(path: Any) -> None:
    layer = _linear(40, 256, bias=False)
    for rows in (3, 33):  # decoding's rows and a prompt's (several blocks a group on the prompt's tiles)
        x = torch.randn(rows, 256)
        for group in (32, 64, 128, 256):
            packed = native.PackedLinear(layer, "int4", path, group=group)
            want = _integer_reference(path.isa, "int4", x, packed.dequantized(), None)
            torch.testing.assert_close(packed(x), want, rtol=1e-4, atol=1e-4)
    # An odd count of blocks (the x86 pair kernel's last block alone) and a group that is neither
    # 32 nor a multiple of 64 (the x86 paths' other kernel), one to four input rows and a prompt's.
    layer = _linear(40, 96, bias=True)
    for group in (32, 96):
        packed = native.PackedLinear(layer, "int4", path, group=group)
        for rows in (1, 2, 3, 4, 5, 33):
            x = torch.randn(rows, 96)
            want = _integer_reference(path.isa, "int4", x, packed.dequantized(), packed.bias)
            torch.testing.assert_close(packed(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("k", [2048, 6144])  # the 1.7B talker's width and its MLP's down projection
def test_integer_products_at_the_talkers_widths(path: Any, fmt: str, k: int) -> None:
    """The integer kernels at the 1.7B talker's input widths (the tests above stop at 512), one to
    four input rows (a frame, a batch's step) and a prompt's (tiles of weight rows, four input
    rows at a time, a last group of one or three): the kernels' scratch, their block pairs and
    their group sums over many blocks against the float product of what they quantize."""
    layer = _linear(70, k, bias=False, seed=k)
    packed = native.PackedLinear(layer, fmt, path, group=64)
    for rows in (1, 2, 3, 4, 5, 39):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = _integer_reference(path.isa, fmt, x, packed.dequantized(), None)
        got = packed(x)
        # float32 sums of thousands of products in another order: within 1e-5 of the output's
        # largest value (they come within 1e-6; a wrong block, scale or group sum is off by >1e-2).
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-5 * scale, (fmt, k, rows)


def test_bad_weights_are_refused(ext: Any) -> None:
    """Checked before the library reads anything: it reads as much memory as the shape promises."""
    with pytest.raises(ValueError, match="multiple of 32"):
        ext.linear(torch.randn(1, 40), 0, torch.randn(8, 40), None, None, 8, 0, None)
    with pytest.raises(ValueError, match="scales"):
        ext.linear(torch.randn(1, 64), 2, torch.zeros(8, 64, dtype=torch.int8), None, None, 8, 0, None)
    with pytest.raises(ValueError, match="float32"):
        ext.linear(torch.randn(1, 64).double(), 0, torch.randn(8, 64), None, None, 8, 0, None)
    with pytest.raises(ValueError, match="elements"):  # a weight smaller than its shape says
        ext.linear(torch.randn(1, 64), 0, torch.randn(4, 64), None, None, 8, 0, None)
    with pytest.raises(ValueError, match="features"):  # an input of another width
        native.PackedLinear(_linear(8, 64, bias=False), "int8", ext)(torch.randn(1, 96))


def _stack(seed: int) -> tuple[DecoderStack, DecoderConfig]:
    cfg = DecoderConfig(
        hidden_size=64,
        intermediate_size=192,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=100,
        attention_bias=False,
    )
    torch.manual_seed(seed)
    stack = DecoderStack(cfg)
    with torch.no_grad():
        for p in stack.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
    stack.eval().requires_grad_(False)
    fuse_projections(stack)
    return stack, cfg


# The glue (norms, RoPE, cache writes, attention, residuals) is the same code for every weight
# format; float weights keep the comparison exact. With int8/int4 the input of each product is
# quantized, so a last-bit difference upstream can move a rounding step and the two paths drift.
@pytest.mark.arm64
@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
@torch.inference_mode()
def test_native_stack_equals_the_python_layers(path: Any, fmt: str) -> None:
    stack, cfg = _stack(seed=3)
    native.pack_linears(stack, fmt, path, group=32)
    assert native.fuse_stacks(stack, path) == 1
    assert stack.native is not None
    fused = stack.native
    cos, sin = rope_tables(cfg, 64, torch.device("cpu"))
    caches = [KVCache(cfg, 64, torch.device("cpu"), torch.float32) for _ in range(2)]
    prompt = torch.randn(1, 7, cfg.hidden_size)
    for cache in caches:
        stack.native = None
        stack.run(prompt, cos[:7], sin[:7], cache, 0)  # the prefill always takes the Python layers
    pos = 7
    for rows in (1, 1, 2, 1, 3, 4, 1, 2):  # blocks of positions, causal within each, as the predictor's first step
        x = torch.randn(1, rows, cfg.hidden_size)
        stack.native = None
        expected = stack.run(x, cos[pos : pos + rows], sin[pos : pos + rows], caches[0], pos)
        stack.native = fused
        got = stack.run(x, cos[pos : pos + rows], sin[pos : pos + rows], caches[1], pos)
        assert got.shape == (1, rows, cfg.hidden_size)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
        pos += rows
    # the positions written (a CPU cache is left unwritten beyond them)
    torch.testing.assert_close(caches[1].k[..., :pos, :], caches[0].k[..., :pos, :], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(caches[1].v[..., :pos, :], caches[0].v[..., :pos, :], rtol=2e-5, atol=2e-5)


@pytest.mark.arm64
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@torch.inference_mode()
def test_every_paths_stack_computes_what_the_generic_one_does(fmt: str) -> None:
    """The whole stack on each path against the generic path's, one sequence at a time (``run``)
    and several sequences' rows together (``run_rows``), for each weight format. The integer
    formats quantize each product's input, so the paths' last-bit differences can move a rounding
    step: a looser bound there."""
    _library_or_skip()
    stack, cfg = _stack(seed=6)
    generic = native.load("generic")
    assert generic is not None
    native.pack_linears(stack, fmt, generic, group=32)
    cos, sin = rope_tables(cfg, 64, torch.device("cpu"))
    tol = 2e-5 if fmt in ("float32", "bfloat16") else 2e-2
    x = [torch.randn(1, rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows)) for rows in (3, 1, 4, 2)]
    results: dict[str, list[torch.Tensor]] = {}
    for name in _runnable():
        kernels = native.load(name)
        assert kernels is not None
        native.fuse_stacks(stack, kernels)
        caches = [KVCache(cfg, 64, torch.device("cpu"), torch.float32) for _ in range(2)]
        outs, pos = [], 0
        for block in x:
            n = block.shape[1]
            outs.append(stack.native.run(block, caches[0].k, caches[0].v, cos[pos : pos + n], sin[pos : pos + n], pos))
            pos += n
        # rows of two sequences in one call: cache 1 at positions 0, 1 and cache 0 at its next one
        rows = torch.cat([x[0][:, :2], x[1]], dim=1)
        where = [1, 1, 0]
        at = [0, 1, pos]
        outs.append(
            stack.native.run_rows(
                rows,
                [c.k for c in caches],
                [c.v for c in caches],
                torch.stack([cos[p] for p in at]),
                torch.stack([sin[p] for p in at]),
                where,
                at,
            )
        )
        outs.append(caches[0].k[..., : pos + 1, :].clone())
        results[name] = outs
    assert "generic" in results
    for name, outs in results.items():
        for got, want in zip(outs, results["generic"], strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
    # the second sequence's first rows equal the first sequence's first rows (same input, positions)
    torch.testing.assert_close(results["generic"][4][:, :2], results["generic"][0][:, :2], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(96, 256), (33, 128), (2, 64), (6, 96)])  # odd rows: the lone last row stays
# AVX2; 96 inputs: an odd count of blocks
def test_avx512_integer_kernels_equal_the_avx2_ones_bit_for_bit(fmt: str, shape: tuple[int, int]) -> None:
    """The AVX-512 VNNI kernels compute exactly what the AVX2 ones do, for 1-4 input rows
    (decoding, a batch's step, a prompt's block), with and without a bias."""
    _library_or_skip()
    if not {"avx2", "avx512"} <= set(_runnable()):
        pytest.skip(f"this CPU does not run both the avx2 and avx512 paths ({', '.join(_runnable())})")
    wide, narrow = native.load("avx512"), native.load("avx2")
    assert wide is not None and narrow is not None
    n, k = shape
    for bias in (False, True):
        packed = native.PackedLinear(_linear(n, k, bias=bias, seed=n + k), fmt, wide, group=32 if k < 128 else 64)
        same = native.PackedLinear.from_parts(
            fmt, packed.data, packed.scales, packed.mins, packed.bias, k, n, narrow, packed.group or 64
        )
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, k) * 3
            a, b = packed(x), same(x)
            assert torch.equal(a, b), (fmt, shape, bias, rows, float((a - b).abs().max()))


def test_stack_refuses_a_position_past_the_cache(ext: Any) -> None:
    stack, cfg = _stack(seed=4)
    native.pack_linears(stack, "float32", ext)
    native.fuse_stacks(stack, ext)
    cos, sin = rope_tables(cfg, 64, torch.device("cpu"))
    cache = KVCache(cfg, 8, torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        stack.native.run(torch.randn(1, 1, 64), cache.k, cache.v, cos[8:9], sin[8:9], 8)


def test_stack_needs_every_linear_packed(ext: Any) -> None:
    stack, _ = _stack(seed=5)
    assert native.fuse_stacks(stack, ext) == 0
    assert stack.native is None


# ---------------------------------------------------------------- the codec decoder's kernels


@pytest.mark.arm64
@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
@pytest.mark.parametrize("time", [1, 7, 8, 1003])  # vector body and scalar tail
def test_snake_matches_the_formula(path: Any, scale: float, time: int) -> None:
    """Fused SnakeBeta against the formula in float64: as close as torch's own float32 (measured
    2e-5 relative at |x * alpha| ~ 100, where rounding x * alpha dominates)."""
    from s2s_daemon.tts.torch_qwen3.codec import SnakeBeta

    gen = torch.Generator().manual_seed(time)
    act = SnakeBeta(24).requires_grad_(False)
    act.alpha.copy_(torch.randn(24, generator=gen))
    act.beta.copy_(torch.randn(24, generator=gen))
    x = torch.randn(2, 24, time, generator=gen) * scale
    a = torch.exp(act.alpha.double())[None, :, None]
    exact = x.double() + torch.sin(x.double() * a) ** 2 / (torch.exp(act.beta.double())[None, :, None] + 1e-9)
    plain = act(x)
    act.use_native(path)
    fused = act(x)
    bound = 1e-6 + 2 * float(((plain.double() - exact).abs() / (1 + exact.abs())).max())
    assert float(((fused.double() - exact).abs() / (1 + exact.abs())).max()) <= bound
    assert not torch.equal(fused, x)


class _Counting:
    """The extension with its calls counted (to see which path a layer took)."""

    def __init__(self, ext: Any) -> None:
        self._ext = ext
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._ext, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return target(*args, **kwargs)

        return call


@pytest.mark.arm64
def test_codec_decoder_on_native_kernels_equals_plain_torch(ext: Any) -> None:
    """A random decoder whose widths the kernels take (multiples of 32): its few-column conv GEMMs and
    SnakeBeta run natively, streamed in chunks of 1 and 4 frames, and match plain torch's one-shot
    decode within 1e-4 (float32 summation order)."""
    from s2s_daemon.tts.torch_qwen3.codec import CodecDecoder, CodecDecoderConfig
    from tests.support.codec import random_decoder

    cfg = CodecDecoderConfig(
        codebook_size=64, codebook_dim=32, num_quantizers=16, latent_dim=64, hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=False, sliding_window=6, rope_theta=10000.0, rms_norm_eps=1e-5,
        layer_scale_initial_scale=0.01, upsample_rates=(4, 3), upsampling_ratios=(2, 2), decoder_dim=64,
    )  # fmt: skip
    plain = random_decoder(cfg)
    fast = CodecDecoder(cfg)
    fast.load_state_dict(plain.state_dict())
    fast.eval().requires_grad_(False)
    for module in fast.modules():
        if hasattr(module, "relayout"):
            module.relayout()
    counting = _Counting(ext)
    assert fast.use_native(counting) > 0
    counting.calls.clear()  # use_native timed the kernels once (native_row_limit)
    codes = torch.randint(0, 64, (13, 16), generator=torch.Generator().manual_seed(1))
    expected = plain.decode(codes)
    assert expected.abs().mean() > 1e-3  # not silence
    for chunk in (1, 4):
        stream = fast.stream()
        got = torch.cat([stream.push(codes[i : i + chunk]) for i in range(0, 13, chunk)])
        assert float((got - expected).abs().max()) < 1e-4
    assert counting.calls.get("linear", 0) > 0  # the pre-conv, first conv and transposed convs
    assert counting.calls.get("snake", 0) > 0


def _slowed(fn: Any, delay_s: float) -> Any:
    import time

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)  # the slower kernel the test needs: the behaviour under test
        return fn(*args, **kwargs)

    return slow


class _SlowLinear:
    """The extension with its ``linear`` 50 ms slower."""

    def __init__(self, ext: Any) -> None:
        self._ext = ext
        self.linear = _slowed(ext.linear, 0.05)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ext, name)


def test_native_row_limit_takes_the_blas_beyond_the_streaming_rows_where_it_is_faster(ext: Any) -> None:
    from s2s_daemon.tts.torch_qwen3.codec import native_row_limit

    assert native_row_limit(_SlowLinear(ext), torch.randn(64, 64)) == ext.MAX_STREAM_ROWS


def test_native_row_limit_keeps_the_blocked_product_where_the_blas_is_slower(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s2s_daemon.tts.torch_qwen3.codec import native_row_limit

    monkeypatch.setattr(torch, "mm", _slowed(torch.mm, 0.05))
    assert native_row_limit(ext, torch.randn(64, 64)) == ext.MAX_BLOCKED_ROWS


@pytest.mark.slow
def test_the_kernels_let_go_of_the_gil(ext: Any) -> None:
    """A long native call (a prefill, a decoder chunk) must not freeze the event loop: stops, MQTT,
    signals (a second Ctrl-C) and the watchdog run beside it. Holding the GIL, the ticker below ticked
    about 10 times a second during the call (a second Ctrl-C waited 2.5 s for a prefill); free of it,
    hundreds."""
    import threading
    import time

    x = torch.randn(1, 256, 1_000_000)  # one call of a second or two on one core
    alpha, inv_beta = torch.rand(256), torch.rand(256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core left for the ticker on a 2-core box
    try:
        ticks: list[float] = []
        span: list[float] = []
        running = threading.Event()
        done = threading.Event()

        def call() -> None:
            running.set()
            span.append(time.perf_counter())
            ext.snake(x, alpha, inv_beta)
            span.append(time.perf_counter())
            done.set()

        worker = threading.Thread(target=call)
        worker.start()
        running.wait(5)
        while not done.is_set():  # Python bytecode: every tick needs the GIL
            ticks.append(time.perf_counter())
            time.sleep(0.001)  # the measurement: a tick each millisecond the GIL allows
        worker.join(60)
    finally:
        torch.set_num_threads(threads)
    began, ended = span
    inside = sum(1 for t in ticks if began < t < ended)
    assert inside >= 100 * (ended - began), f"{inside} ticks in {ended - began:.2f} s of a native call"


@pytest.mark.slow
def test_the_kernels_release_the_gil(ext: Any) -> None:
    """A long product on one thread leaves the interpreter to the others (the event loop, a codec
    push on its own thread): the main thread runs Python code while the product is still running.
    Held, the main thread could only go on once the product had returned."""
    import threading
    import time

    weight = torch.randn(2048, 2048)
    rows = 128
    while True:  # a product of at least half a second here, whatever the machine
        x = torch.randn(rows, 2048)
        start = time.perf_counter()
        ext.linear(x, 0, weight, None, None, 2048, 0, None)
        if time.perf_counter() - start > 0.5 or rows >= 1 << 16:
            break
        rows *= 4
    inside = threading.Event()
    x = torch.randn(rows * 4, 2048)

    def product() -> None:
        inside.set()
        ext.linear(x, 0, weight, None, None, 2048, 0, None)

    worker = threading.Thread(target=product)
    worker.start()
    assert inside.wait(10)
    # Into the product (half a second at least): no event can say the thread is inside the native
    # call; a margin is all there is.
    time.sleep(0.05)
    total = sum(range(10_000))  # Python code: needs the GIL
    running = worker.is_alive()
    worker.join()
    assert total and running, "the product held the GIL"
