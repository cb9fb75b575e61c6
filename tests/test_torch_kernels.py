"""The CPU fast paths of the torch engine compute what the plain torch modules compute."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.torch_qwen3 import codec as codec_mod  # noqa: E402
from s2s_daemon.tts.torch_qwen3.codec import CausalConv1d, CausalConvTranspose1d  # noqa: E402
from s2s_daemon.tts.torch_qwen3.layers import SMALL_BATCH_ROWS, SmallBatchLinear, small_batch_linears  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("relaid", [False, True], ids=["conv", "taps"])
@pytest.mark.parametrize(
    ("cin", "cout", "kernel", "dilation", "columns"),
    [
        (64, 32, 7, 1, 16),
        (48, 64, 7, 3, 10),
        (32, 32, 7, 9, 1),
        (16, 8, 3, 1, 4),
        (32, 16, 7, 1, 200),
        (24, 40, 1, 1, 90),
    ],
)  # 200 and 90 columns: past GEMM_MAX_COLUMNS, one product per tap once relaid
@torch.inference_mode()
def test_causal_conv_gemm_path_equals_the_convolution(
    cin: int, cout: int, kernel: int, dilation: int, columns: int, relaid: bool
) -> None:
    torch.manual_seed(0)
    layer = CausalConv1d(cin, cout, kernel, dilation=dilation)
    x = torch.randn(2, cin, columns)
    expected = layer.conv(torch.nn.functional.pad(x, (layer.context, 0)))
    if relaid:
        layer.relayout()  # the tap-major weight the loader makes on the CPU
        assert layer.weight_taps is not None and layer.weight_taps.shape == (cout, kernel, cin)
        torch.testing.assert_close(layer.conv(torch.nn.functional.pad(x, (layer.context, 0))), expected)  # a view
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Streamed in two pieces through the state, the same again.
    state: dict[int, torch.Tensor] = {}
    split = max(1, columns // 2)
    streamed = torch.cat([layer(x[..., :split], state), layer(x[..., split:], state)], dim=-1)
    torch.testing.assert_close(streamed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["stacked-taps", "onednn-conv", "onednn-packed"])
@pytest.mark.parametrize(
    ("kernel", "dilation", "columns"), [(7, 1, 200), (7, 9, 90), (3, 1, 70), (1, 1, 80), (7, 3, 12)]
)
@torch.inference_mode()
def test_bfloat16_conv_of_many_columns_either_way(
    kernel: int, dilation: int, columns: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16-weight conv with float32 activations (the bfloat16 codec decoder) past the few-row
    kernels: as products of stacked taps or as oneDNN's bfloat16 convolution (``LOW_CONV_ONEDNN``,
    x86-64), on the plain weight or on the one oneDNN packed for blocks of 16 columns (up to four
    blocks as a batch, the last one padded; more as one convolution on the weight laid out plainly
    again), what the float32 convolution gives on the input and weights rounded to bfloat16, within
    the rounding of the sums to bfloat16; streamed in two pieces, the same."""
    onednn = path != "stacked-taps"
    if path == "onednn-packed" and not codec_mod._onednn_here():
        pytest.skip("no oneDNN that runs bfloat16 here (torch without oneDNN, or an AVX2-only CPU)")
    monkeypatch.setattr(codec_mod, "LOW_CONV_ONEDNN", onednn)
    torch.manual_seed(2)
    layer = CausalConv1d(64, 40, kernel, dilation=dilation)
    layer.conv.weight.data = layer.conv.weight.data.bfloat16().float()
    x = torch.randn(2, 64, columns).bfloat16().float()
    expected = layer.conv(torch.nn.functional.pad(x, (layer.context, 0)))
    layer.conv.weight.data = layer.conv.weight.data.bfloat16()  # 64 inputs: a width the kernels take
    layer.relayout()
    kept = layer.weight_low if onednn else layer.weight_taps
    assert kept is not None and kept.dtype == torch.bfloat16
    assert (layer.weight_taps is None) == onednn
    if path == "onednn-packed":
        assert layer.pack_onednn(16)
        assert layer.weight_low is None and layer.weight_onednn is not None and layer.conv.weight.is_mkldnn
    torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-2)
    state: dict[int, torch.Tensor] = {}
    split = columns // 2
    streamed = torch.cat([layer(x[..., :split], state), layer(x[..., split:], state)], dim=-1)
    torch.testing.assert_close(streamed, expected, rtol=1e-2, atol=1e-2)
    if path == "onednn-packed":
        return  # packed where no push takes the native kernels: its plain weight is gone
    # A few columns on the native kernels (float32 rows, bfloat16 weights), in either weight layout.
    from s2s_daemon.tts.torch_qwen3 import native

    ext = native.load()
    if ext is None or kernel == 1:
        return
    layer.ext, layer.native_rows = ext, 4
    state = {}
    pieces = [layer(x[:1, :, i : i + 3], state) for i in range(0, 12, 3)]
    torch.testing.assert_close(torch.cat(pieces, dim=-1), expected[:1, :, :12], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("cin", "cout", "kernel", "stride"), [(64, 32, 4, 2), (48, 24, 6, 3), (32, 16, 16, 8), (40, 40, 2, 2)]
)
@torch.inference_mode()
def test_transposed_conv_as_gemm_equals_conv_transpose1d(cin: int, cout: int, kernel: int, stride: int) -> None:
    torch.manual_seed(1)
    layer = CausalConvTranspose1d(cin, cout, kernel, stride)
    x = torch.randn(2, cin, 9)
    full = layer.conv(x)
    expected = full[..., : full.shape[-1] - layer.trim]
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    layer.relayout()  # the transposed weight copy the loader makes on the CPU
    assert layer.weight_t is not None
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.conv(x), full, rtol=1e-5, atol=1e-5)  # the conv's weight is a view


@pytest.mark.parametrize("rows", [1, 2, 4, 16, 32, 33, 64])
@torch.inference_mode()
def test_small_batch_linear_equals_linear(rows: int) -> None:
    torch.manual_seed(2)
    plain = torch.nn.Linear(96, 160)
    fast = torch.nn.Linear(96, 160)
    fast.load_state_dict(plain.state_dict())
    assert small_batch_linears(torch.nn.Sequential(fast)) == 1
    assert isinstance(fast, SmallBatchLinear)
    x = torch.randn(1, rows, 96)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_the_thresholds_cover_the_shapes_they_were_measured_on() -> None:
    assert SMALL_BATCH_ROWS[0] <= 2 and SMALL_BATCH_ROWS[1] >= 16  # codec chunks, predictor step 0
    assert codec_mod.GEMM_MAX_COLUMNS >= 16  # the first codec conv on a 4-frame chunk
