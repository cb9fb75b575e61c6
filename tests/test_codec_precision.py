"""The quality guard of the codec decoder's paths, and how ``auto`` chooses one.

Every path ``codec_dtype`` can choose (``pick_codec_weights``'s matrix dtype, and under ``auto`` the
upsampler's int8 linears, ``int8_upsampler``) is decoded against the float32 decoder on random
decoders of the released 0.6B shapes and on the tiny golden fixture (the official float32
waveform), and must meet ``quality.MIN_SNR_DB`` and ``quality.MAX_LOG_MEL_DB``. A path broken on
purpose must miss them (the guard can fail).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.errors import ConfigError  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import codec as codec_mod  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import native, quality  # noqa: E402
from s2s_daemon.tts.torch_qwen3.codec import CodecDecoder, int8_upsampler, pick_codec_weights  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(900)]

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
AUTO_PATHS = {torch.float32, torch.bfloat16}
"""The matrix dtypes ``auto`` can choose (``pick_codec_weights``)."""
GUARDED = [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)]
"""(matrix dtype, int8 upsampler) of every path but float32's own: ``auto``'s two (its int8
upsampler beside either dtype) and ``codec_dtype: bfloat16``; each is guarded below."""


@pytest.fixture(scope="module")
def ext() -> Any:
    reason = native.why_not_here()
    if reason is not None:
        pytest.skip(f"the bfloat16 decoder needs the native kernels: {reason}")
    module = native.load()
    assert module is not None, native.unavailable_reason()
    return module


def _decoder(folder: Path, weights: Any, ext: Any, int8: bool = False, packed: bool = False) -> CodecDecoder:
    """As the engine loads it on the CPU; ``packed``: the convs on weights oneDNN laid out at load
    (``pack_onednn``, which the engine no longer calls; scripts/bench_codec.py still measures it)."""
    decoder = CodecDecoder.from_folder(folder, "cpu", torch.float32, weights)
    decoder.prepare_native(ext, int8)
    int8_linears = [m for m in decoder.modules() if isinstance(m, native.PackedLinear) and m.fmt == "int8"]
    assert len(int8_linears) == (4 if int8 else 0)  # two ConvNeXt blocks' pwconv1 and pwconv2
    if packed:
        decoder.pack_onednn()
    return decoder


def _streamed(decoder: CodecDecoder, codes: Any, chunk: int) -> Any:
    stream = decoder.stream()
    return torch.cat([stream.push(codes[i : i + chunk]) for i in range(0, codes.shape[0], chunk)])


def write_decoder(out: Path, size: str, seed: int) -> Path:
    """A speech-tokenizer folder with the decoder of ``make_checkpoint``'s random ``size`` checkpoint
    (its init: audible, unclipped noise), for ``seed``; the encoder is left out."""
    from safetensors.torch import save_file

    from s2s_daemon.tools import checkpoint_layout as layout
    from s2s_daemon.tools.make_checkpoint import _tensors

    spec = layout.SIZE_SPECS[size]
    shapes = {k: v for k, v in layout.speech_tokenizer_param_shapes(size).items() if k.startswith("decoder.")}
    final_conv = f"decoder.decoder.{len(spec.dec_upsample_rates) + 2}.conv.weight"
    tensors = _tensors(shapes, seed, torch.float32, final_conv, len(spec.dec_upsample_rates))
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(layout.speech_tokenizer_config(size)), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def released_shapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield write_decoder(tmp_path_factory.mktemp("codec") / "speech_tokenizer", "0.6b", seed=7)


def _assert_guarded(reference: Any, audio: Any, what: str) -> quality.Quality:
    q = quality.compare(reference, audio)
    assert q.passes, f"{what}: {q}"
    return q


@pytest.mark.slow
def test_every_auto_path_passes_on_a_random_released_shape_decoder(ext: Any, released_shapes: Path) -> None:
    """Random 0.6B-shaped weights, random codes, streamed in four-frame pushes and one 12-frame push
    (the paths differ by columns: native few-row products, oneDNN beyond)."""
    codes = torch.randint(0, 2048, (12, 16), generator=torch.Generator().manual_seed(3))
    reference = _decoder(released_shapes, torch.float32, ext)
    expected = reference.decode(codes)
    assert float(expected.pow(2).mean().sqrt()) > 0.02 and float((expected.abs() >= 1).float().mean()) < 0.01
    del reference
    packs = codec_mod.LOW_CONV_ONEDNN and torch.backends.mkldnn.is_available()
    for weights, int8, packed in [(w, i, False) for w, i in GUARDED] + [(torch.bfloat16, True, packs)]:
        decoder = _decoder(released_shapes, weights, ext, int8, packed)
        assert decoder.weights_dtype() == weights
        convs = [m for m in decoder.modules() if isinstance(m, codec_mod.CausalConv1d)]
        if not packed:  # as the engine loads it: nothing laid out for oneDNN
            assert all(m.weight_onednn is None for m in convs)
        else:
            # oneDNN's layout, for one frame's columns: pre_conv (12.5 Hz), the first decoder conv
            # (50 Hz), at the four upsampled stages (8x, 5x, 4x, 3x) three residual units of two
            # convs each, and the last conv; the depthwise ones stay convolutions of their own
            columns = sorted(m.onednn_columns for m in convs if m.weight_onednn is not None)
            assert columns == [1, 4] + [32] * 6 + [160] * 6 + [640] * 6 + [1920] * 7
            assert all(m.weight_low is None for m in convs if m.weight_onednn is not None)
        what = f"{weights}{' with an int8 upsampler' if int8 else ''}{', packed for oneDNN' if packed else ''}"
        for chunk in (4, 12):
            _assert_guarded(expected, _streamed(decoder, codes, chunk), f"{what}, pushes of {chunk}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cv_ryan_english", "base_icl"])
def test_every_auto_path_passes_on_the_golden_fixture(ext: Any, case: str) -> None:
    """The tiny checkpoint's decoder on the official talker's codes: against the official float32
    waveform, and against our float32 decoder."""
    import numpy as np

    with np.load(FIXTURES / "golden" / f"{case}.npz") as data:
        codes, official = torch.from_numpy(data["codes"]), torch.from_numpy(data["wav"])
    folder = FIXTURES / ("base" if case.startswith("base") else "custom_voice") / "speech_tokenizer"
    ours = _decoder(folder, torch.float32, ext).decode(codes)
    if case == "cv_ryan_english":  # the ICL golden's wav has the reference's frames cut off
        _assert_guarded(official, ours, "float32 against the official waveform")
    for weights, int8 in GUARDED:
        audio = _streamed(_decoder(folder, weights, ext, int8), codes, 4)
        what = f"{weights}{' with an int8 upsampler' if int8 else ''}"
        _assert_guarded(ours, audio, f"{what} against float32")
        if case == "cv_ryan_english":
            _assert_guarded(official, audio, f"{what} against the official waveform")


@pytest.mark.slow
def test_a_broken_path_misses_the_guard(ext: Any, released_shapes: Path) -> None:
    """The decoder run in bfloat16 throughout (activations, residual sums and SnakeBeta too, as on a
    GPU): what the bfloat16 path keeps in float32, and what the guard must reject; silence too."""
    codes = torch.randint(0, 2048, (12, 16), generator=torch.Generator().manual_seed(5))
    expected = _decoder(released_shapes, torch.float32, ext).decode(codes)
    assert quality.compare(expected, _decoder(released_shapes, torch.bfloat16, ext).decode(codes)).passes
    throughout = CodecDecoder.from_folder(released_shapes, "cpu", torch.bfloat16).decode(codes).float()
    broken = quality.compare(expected, throughout)
    assert not broken.passes, f"a decoder in bfloat16 throughout passed the guard: {broken}"
    silent = quality.compare(expected, torch.zeros_like(expected))
    assert not silent.passes and silent.log_mel_db > 10 * quality.MAX_LOG_MEL_DB


def test_where_onednn_runs_no_bfloat16_the_bfloat16_decoder_runs_on_stacked_taps(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AVX2-only x86-64 CPU (an Intel N100, an AMD EPYC before Zen 4: torch's
    ``_is_mkldnn_bf16_supported`` is false) gets no oneDNN bfloat16 convolution, whose weight
    oneDNN refuses to lay out there (``codec_dtype: bfloat16`` stopped the load with a RuntimeError):
    the convs keep their weights tap-major, as on aarch64, none is packed, and the audio is within
    the guard."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not codec_mod._onednn_here()
    assert not codec_mod.low_conv_onednn("x86_64")
    monkeypatch.setattr(codec_mod, "LOW_CONV_ONEDNN", codec_mod.low_conv_onednn())  # as imported on that CPU
    folder = FIXTURES / "custom_voice" / "speech_tokenizer"
    decoder = _decoder(folder, torch.bfloat16, ext)
    convs = [m for m in decoder.modules() if isinstance(m, codec_mod.CausalConv1d) and m.conv.groups == 1]
    assert convs and all(m.weight_low is None and m.weight_onednn is None for m in convs)
    assert all(m.weight_taps is not None and m.weight_taps.dtype == torch.bfloat16 for m in convs)
    cfg = decoder.cfg
    codes = torch.randint(0, cfg.codebook_size, (12, cfg.num_quantizers), generator=torch.Generator().manual_seed(4))
    expected = _decoder(folder, torch.float32, ext).decode(codes)
    for chunk in (4, 12):
        _assert_guarded(expected, _streamed(decoder, codes, chunk), f"stacked taps, pushes of {chunk}")


def test_the_bfloat16_path_keeps_activations_norms_and_snake_in_float32(ext: Any) -> None:
    folder = FIXTURES / "custom_voice" / "speech_tokenizer"
    decoder = _decoder(folder, torch.bfloat16, ext)
    seen: set[Any] = set()
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
        for m in decoder.modules()
        if isinstance(m, (codec_mod.SnakeBeta, codec_mod.RMSNorm, torch.nn.LayerNorm))
    ]
    decoder.stream().push(torch.zeros(3, 16, dtype=torch.long))
    for hook in hooks:
        hook.remove()
    assert seen == {torch.float32}
    snakes = [m for m in decoder.modules() if isinstance(m, codec_mod.SnakeBeta)]
    assert snakes and all(m.alpha.dtype == torch.float32 and m.beta.dtype == torch.float32 for m in snakes)
    convs = [m for m in decoder.modules() if isinstance(m, codec_mod.CausalConvTranspose1d)]
    assert convs and all(m.weight_t is not None and m.weight_t.dtype == torch.bfloat16 for m in convs)
    linears = [m for m in decoder.modules() if isinstance(m, native.PackedLinear)]
    assert linears and all(m.fmt == "bfloat16" for m in linears)


@pytest.mark.parametrize(
    ("requested", "has_ext", "arch", "flags", "want"),
    [
        ("auto", True, "x86_64", {"avx2", "fma", "avx512f", "avx512_bf16"}, torch.bfloat16),  # AMD EPYC (Zen 4/5)
        (None, True, "x86_64", {"avx2", "fma", "amx_bf16", "amx_tile", "avx512_bf16"}, torch.bfloat16),  # Xeon SPR
        ("auto", True, "x86_64", {"avx2", "fma"}, torch.float32),  # AVX2-only EPYC
        ("auto", True, "x86_64", {"avx2", "fma", "avx512f", "avx512bw"}, torch.float32),  # AVX-512 without bfloat16
        ("auto", False, "x86_64", {"avx512_bf16"}, torch.float32),  # no native kernels (no compiler at install)
        ("auto", True, "aarch64", {"asimd", "asimddp", "sve", "i8mm", "bf16"}, torch.bfloat16),  # Graviton 3
        ("auto", True, "aarch64", {"asimd", "asimddp"}, torch.float32),  # Raspberry Pi 5
        ("auto", True, "aarch64", {"asimd", "avx512_bf16"}, torch.float32),  # another architecture's flag
        ("float32", True, "aarch64", {"bf16"}, torch.float32),
        ("float32", True, "x86_64", {"avx512_bf16"}, torch.float32),
        ("bfloat16", True, "x86_64", {"avx2", "fma"}, torch.bfloat16),  # asked for: allowed, if slow
        (" BFloat16 ", True, "x86_64", set(), torch.bfloat16),
    ],
)
def test_auto_chooses_bfloat16_only_with_bfloat16_dot_products(
    requested: str | None, has_ext: bool, arch: str, flags: set[str], want: Any
) -> None:
    dtype, why = pick_codec_weights(requested, object() if has_ext else None, flags, arch)
    assert dtype == want and why
    # the int8 upsampler comes with auto alone, wherever the kernels are: float32 and bfloat16 are kept whole
    assert int8_upsampler(requested, object() if has_ext else None) == (has_ext and requested in (None, "auto"))
    if dtype == torch.bfloat16 and not codec_mod.bf16_dot_products(flags, arch):  # the load's log says so
        assert "slower than float32" in why, why
    assert dtype in AUTO_PATHS


@pytest.mark.parametrize(("requested", "has_ext"), [("fp8", True), ("bfloat16", False)])
def test_a_codec_dtype_that_cannot_be_had_is_an_error(requested: str, has_ext: bool) -> None:
    with pytest.raises(ValueError, match="codec_dtype"):
        pick_codec_weights(requested, object() if has_ext else None, set())


def test_the_engine_takes_the_codec_dtype_option(ext: Any) -> None:
    import numpy as np

    from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest
    from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine

    def engine(value: str) -> TorchQwen3Engine:
        options = EngineOptions(model=str(FIXTURES / "custom_voice"), device="cpu", kernels="native",
                                extra={"codec_dtype": value, "prepared_cache": "0", "max_frames": "6"})  # fmt: skip
        e = TorchQwen3Engine(options)
        e.load_blocking()
        return e

    request = SynthesisRequest(text="Hello there.", voice="Ryan", language="english", greedy=True)
    audio = {}
    for value in ("float32", "bfloat16", "auto"):
        e = engine(value)
        try:
            int8 = {m.fmt for m in e.codec.upsample.modules() if isinstance(m, native.PackedLinear)} == {"int8"}
            assert int8 == (value == "auto"), value  # auto's upsampler only; the others keep their dtype
            # no weight laid out for oneDNN at the load's threads (pushes run with others: docs/internals.md)
            assert all(getattr(m, "weight_onednn", None) is None for m in e.codec.modules())
            if value != "auto":
                assert e.codec.weights_dtype() == getattr(torch, value)
            audio[value] = torch.from_numpy(np.concatenate(list(e.synthesize_blocking(request, lambda: False))))
        finally:
            e.close_blocking()
    _assert_guarded(audio["float32"], audio["bfloat16"], "the engine's bfloat16 decoder")
    _assert_guarded(audio["float32"], audio["auto"], "the engine's decoder under auto")
    with pytest.raises(ConfigError, match=r"tts\.options\.codec_dtype"):  # typed options: exit 78, as check-config says
        engine("half")
