"""The torch speech tokenizer: codec decoder (one-shot and streaming), codec encoder, speaker encoder.

Two kinds of tests:
- self-contained ones on a small random decoder built in memory (streaming exactness, causality,
  bounded state), which need nothing but torch;
- golden ones against outputs of the official qwen-tts package on the committed tiny checkpoint
  (tests/fixtures/qwen3_tiny/, described in its README).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.torch_qwen3.codec import (  # noqa: E402  (after the importorskip)
    DECODE_CHUNK_FRAMES,
    CodecDecoder,
    CodecDecoderConfig,
)
from tests.support.codec import random_decoder  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("torch_one_thread")]


SMALL = CodecDecoderConfig(
    codebook_size=64,
    codebook_dim=24,
    num_quantizers=16,
    latent_dim=32,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=False,
    sliding_window=6,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    layer_scale_initial_scale=0.01,
    upsample_rates=(4, 3),
    upsampling_ratios=(2, 2),
    decoder_dim=32,
)
"""Every structural feature of the real decoder (GQA, sliding window, both upsampling stages,
dilated residual units), 48 samples per frame; a window of 6 frames so short inputs exceed it."""


def _small_decoder(dtype: Any, seed: int = 0) -> CodecDecoder:
    return random_decoder(SMALL, dtype, seed)


def _codes(frames: int, size: int, seed: int = 1) -> Any:
    return torch.randint(0, size, (frames, 16), generator=torch.Generator().manual_seed(seed))


def _streamed(dec: CodecDecoder, codes: Any, chunk: int) -> Any:
    st = dec.stream()
    parts = []
    for i in range(0, codes.shape[0], chunk):
        out = st.push(codes[i : i + chunk])
        assert out.shape == (min(chunk, codes.shape[0] - i) * dec.samples_per_frame,)
        parts.append(out)
    parts.append(st.flush())
    return torch.cat(parts)


# ---------------------------------------------------------------- self-contained decoder tests


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_streaming_is_exact_in_float64(chunk: int) -> None:
    """The state carry is exact: streamed audio equals the one-shot forward to rounding (1e-9)."""
    dec = _small_decoder(torch.float64)
    codes = _codes(23, SMALL.codebook_size)
    full = dec.forward_full(codes)
    assert full.shape == (23 * dec.samples_per_frame,)
    assert full.abs().mean() > 1e-3  # not silence
    streamed = _streamed(dec, codes, chunk)
    assert torch.allclose(streamed, full, rtol=0, atol=1e-9), float((streamed - full).abs().max())


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_streaming_matches_decode_in_float32(chunk: int) -> None:
    """Float32 streaming differs from one-shot decode only by rounding (< 1e-4 absolute)."""
    dec = _small_decoder(torch.float32)
    codes = _codes(23, SMALL.codebook_size)
    one_shot = dec.decode(codes)
    streamed = _streamed(dec, codes, chunk)
    assert (streamed - one_shot).abs().max() < 1e-4


def test_decode_in_internal_chunks_equals_full_forward() -> None:
    """``decode`` runs in chunks of DECODE_CHUNK_FRAMES; past that length it still equals the forward."""
    dec = _small_decoder(torch.float64)
    codes = _codes(DECODE_CHUNK_FRAMES + 9, SMALL.codebook_size, seed=3)
    assert torch.allclose(dec.decode(codes), dec.forward_full(codes), rtol=0, atol=1e-9)


def test_decoder_is_causal_within_its_receptive_field() -> None:
    """Changing frame j leaves earlier audio untouched, changes frame j's audio, and cannot reach
    past ``receptive_field_frames()`` frames later: so the carried state (and no look-ahead) suffices."""
    dec = _small_decoder(torch.float64)
    rf = dec.receptive_field_frames()
    reach = SMALL.num_hidden_layers * (SMALL.sliding_window - 1)  # through the stacked attention windows
    assert rf == 25  # 10 (attention) + 2 (pre_conv) + 12.9 (convs after the transformer), rounded up
    frames, j = rf + 8, 3
    codes = _codes(frames, SMALL.codebook_size)
    other = codes.clone()
    other[j] = (other[j] + 1) % SMALL.codebook_size
    a, b = dec.forward_full(codes), dec.forward_full(other)
    spf = dec.samples_per_frame
    assert torch.equal(a[: j * spf], b[: j * spf])
    assert (a[j * spf : (j + 1) * spf] - b[j * spf : (j + 1) * spf]).abs().max() > 1e-6
    far = (j + reach) * spf  # the transformer alone carries the change this far
    assert (a[far : far + spf] - b[far : far + spf]).abs().max() > 1e-9
    beyond = (j + rf + 1) * spf
    assert torch.allclose(a[beyond:], b[beyond:], rtol=0, atol=1e-12)


def test_transformer_window_matches_the_official_mask() -> None:
    """Official mask: a query at frame q sees keys k with q - window < k <= q (72 frames, itself
    included). Through L layers an input reaches exactly L * (window - 1) frames ahead, not one more."""
    dec = _small_decoder(torch.float64)
    tr = dec.pre_transformer
    x = torch.randn(1, 30, SMALL.latent_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = x.clone()
    j = 4
    y[0, j] += 1.0
    a, b = tr(x), tr(y)
    changed = (a - b).abs().amax(dim=-1)[0]
    reach = SMALL.num_hidden_layers * (SMALL.sliding_window - 1)
    assert torch.all(changed[:j] == 0)
    assert torch.all(changed[j : j + reach + 1] > 1e-12)
    assert torch.all(changed[j + reach + 1 :] == 0)


def test_streaming_state_stays_bounded() -> None:
    """Per-push cost is bounded: the carried state has the same size after 12 and after 60 frames."""
    dec = _small_decoder(torch.float32)
    codes = _codes(60, SMALL.codebook_size)
    st = dec.stream()

    def state_elements() -> int:
        total = 0
        for value in st._state.values():
            items = value if isinstance(value, tuple) else (value,)
            total += sum(v.numel() for v in items if isinstance(v, torch.Tensor))
        return total

    for i in range(0, 12, 4):
        st.push(codes[i : i + 4])
    early = state_elements()
    for i in range(12, 60, 4):
        st.push(codes[i : i + 4])
    assert state_elements() == early
    assert st.frames == 60


def test_streaming_state_holds_no_view_of_a_chunk() -> None:
    """The carried state is what the next push needs, not views keeping a whole chunk's activations
    alive: its storage after a 32-frame push equals its storage after a 1-frame push."""
    dec = _small_decoder(torch.float32)
    codes = _codes(80, SMALL.codebook_size)

    def storage_bytes(st: Any) -> int:
        total = 0
        for value in st._state.values():
            items = value if isinstance(value, tuple) else (value,)
            total += sum(v.untyped_storage().nbytes() for v in items if isinstance(v, torch.Tensor))
        return total

    small, large = dec.stream(), dec.stream()
    small.push(codes[:40])
    large.push(codes[:40])
    small.push(codes[40:41])
    large.push(codes[40:72])
    assert storage_bytes(large) == storage_bytes(small) == small.state_bytes() == large.state_bytes()


def test_a_copied_stream_continues_exactly_and_alone() -> None:
    """``copy`` (a voice's reference decoded once): the copy's audio equals the original's had it
    gone on, bit for bit, and pushing into one leaves the other untouched."""
    dec = _small_decoder(torch.float32)
    codes = _codes(40, SMALL.codebook_size)
    st = dec.stream()
    st.push(codes[:20])
    twin = st.copy()
    assert twin.frames == 20
    other = twin.copy()
    other.push(codes[30:40])  # a different continuation: must not leak into ``twin`` or ``st``
    from_copy = torch.cat([twin.push(codes[i : i + 4]) for i in range(20, 32, 4)])
    from_original = torch.cat([st.push(codes[i : i + 4]) for i in range(20, 32, 4)])
    assert torch.equal(from_copy, from_original)
    assert torch.allclose(torch.cat([dec.decode(codes[:32])[20 * 48 :]]), from_original, atol=1e-4)


def test_decoder_rejects_bad_codes() -> None:
    dec = _small_decoder(torch.float32)
    with pytest.raises(ValueError, match="codes must be"):
        dec.decode(torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="lie in"):
        dec.decode(torch.full((2, 16), SMALL.codebook_size, dtype=torch.long))
    assert dec.stream().push(torch.zeros(0, 16, dtype=torch.long)).numel() == 0


def test_config_reads_rope_parameters_and_head_dim() -> None:
    cfg = CodecDecoderConfig.from_dict(
        {
            "hidden_size": 512,
            "num_attention_heads": 16,
            "head_dim": 64,
            "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
        }
    )
    assert (cfg.head_dim, cfg.rope_theta, cfg.samples_per_frame) == (64, 5000.0, 1920)
    with pytest.raises(ValueError, match="rope_type"):
        CodecDecoderConfig.from_dict({"rope_scaling": {"rope_type": "yarn"}})


# ---------------------------------------------------------------- golden tests (official qwen-tts outputs)

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
GOLDEN = FIXTURES / "golden"


def _golden(name: str) -> dict[str, Any]:
    import numpy as np

    with np.load(GOLDEN / f"{name}.npz") as data:
        return {k: torch.from_numpy(data[k]) for k in data.files}


@pytest.fixture(scope="module")
def tiny_decoder() -> CodecDecoder:
    return CodecDecoder.from_folder(FIXTURES / "custom_voice" / "speech_tokenizer", "cpu", torch.float32)


def test_decode_matches_official_waveform(tiny_decoder: CodecDecoder) -> None:
    """Codes the official talker produced, decoded by the official tokenizer (fp32): equal within 1e-5
    (measured 1.0e-6) on audio of RMS ~0.19."""
    gold = _golden("cv_ryan_english")
    codes, wav = gold["codes"], gold["wav"]
    assert codes.shape == (24, 16)
    out = tiny_decoder.decode(codes)
    assert out.shape == wav.shape == (24 * 1920,)
    assert out.pow(2).mean().sqrt() > 0.05  # not silence
    assert (out - wav).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_streamed_decode_matches_official_waveform(tiny_decoder: CodecDecoder, chunk: int) -> None:
    """Streaming in chunks of 1, 4 and 7 frames: equal to the official one-shot waveform within 1e-5."""
    gold = _golden("cv_ryan_english")
    streamed = _streamed(tiny_decoder, gold["codes"], chunk)
    assert (streamed - gold["wav"]).abs().max() < 1e-5
    assert (streamed - tiny_decoder.decode(gold["codes"])).abs().max() < 1e-5


# ---------------------------------------------------------------- encoder and speaker encoder


def _ref_wav() -> Any:
    import wave

    import numpy as np

    with wave.open(str(GOLDEN / "ref_espeak_24k.wav"), "rb") as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
    return torch.from_numpy(pcm.astype(np.float32) / 32768.0)


def test_encoder_reads_both_checkpoint_layouts(tmp_path: Path) -> None:
    """Hub key layout and the one newer transformers write (``encoder.encoder.encoder_seanet...``)
    give the same codes; shape is [ceil(samples / 1920), 16] with ids in range."""
    from safetensors.torch import load_file, save_file

    from s2s_daemon.tts.torch_qwen3.codec_encoder import SpeechEncoder

    src = FIXTURES / "base" / "speech_tokenizer"
    renamed = {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        for old, new in (
            ("encoder.encoder.layers.", "encoder.encoder.encoder_seanet.layers."),
            ("encoder.encoder_transformer.", "encoder.encoder.encoder_transformer."),
            ("encoder.downsample.", "encoder.encoder.downsample."),
        ):
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        renamed[key] = value
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    wav = _ref_wav()[: 24000 * 2 + 100]
    hub = SpeechEncoder.from_folder(src).encode(wav)
    new = SpeechEncoder.from_folder(tmp_path).encode(wav)
    assert hub.shape == (math.ceil(wav.numel() / 1920), 16)
    assert hub.dtype == torch.long and int(hub.min()) >= 0 and int(hub.max()) < 128
    assert torch.equal(hub, new)
    assert len(set(hub.flatten().tolist())) > 16  # not degenerate


def test_mel_filter_bank_matches_an_independent_slaney_implementation() -> None:
    """Our filters equal transformers' librosa-compatible Slaney filter bank (1024-point FFT, 128 mels,
    0-12 kHz at 24 kHz), and the log-mel frame count follows the official padding."""
    audio_utils = pytest.importorskip("transformers.audio_utils")
    from s2s_daemon.tts.torch_qwen3.speaker_encoder import log_mel_spectrogram, mel_filter_bank

    ours = mel_filter_bank()
    ref = audio_utils.mel_filter_bank(
        num_frequency_bins=513,
        num_mel_filters=128,
        min_frequency=0.0,
        max_frequency=12000.0,
        sampling_rate=24000,
        norm="slaney",
        mel_scale="slaney",
    ).T
    assert ours.shape == (128, 513)
    assert abs(ours - ref).max() < 1e-7
    mel = log_mel_spectrogram(torch.zeros(24000), torch.from_numpy(ours))
    assert mel.shape == ((24000 + 768 - 1024) // 256 + 1, 128)
    assert torch.allclose(mel, torch.full_like(mel, math.log(1e-5)))


@pytest.mark.slow
def test_streamed_decode_after_reference_context_matches_official_clone() -> None:
    """Voice clone (ICL): the official decodes ref codes ++ generated codes and cuts the ref part.
    Pushing the 49 ref frames as context, then the 24 new ones in chunks of 4, gives that audio."""
    dec = CodecDecoder.from_folder(FIXTURES / "base" / "speech_tokenizer")
    gold = _golden("base_icl")
    st = dec.stream()
    assert st.push(gold["ref_code"]).shape == (49 * 1920,)
    new = torch.cat([st.push(gold["codes"][i : i + 4]) for i in range(0, 24, 4)])
    assert (new - gold["wav"]).abs().max() < 1e-5
    assert (dec.decode(gold["codes"]) - gold["wav_codes_only"]).abs().max() < 1e-5


def test_encoder_codes_equal_official() -> None:
    """Codes of the reference recording equal the official Mimi encoder's exactly (measured: 0 of 784 differ)."""
    from s2s_daemon.tts.torch_qwen3.codec_encoder import SpeechEncoder

    gold = _golden("ref_audio")
    codes = SpeechEncoder.from_folder(FIXTURES / "base" / "speech_tokenizer").encode(_ref_wav())
    assert codes.shape == gold["encoder_codes"].shape == (49, 16)
    assert torch.equal(codes, gold["encoder_codes"])


def test_speaker_mel_and_embedding_match_official() -> None:
    """Log-mel front end as the official's (librosa filters); embedding cosine > 0.9999 and within
    1e-4 (measured: 1.4e-6 on a vector of norm 18.5 with AVX2, 3.3e-6 with AVX-512).

    The mel is compared as energies: MKL's FFT rounds differently on AVX-512 and AVX2 CPUs, and
    near the 1e-5 floor the log turns a 2.5e-8 difference into 2e-3 (measured on an AVX-512 Xeon).
    """
    from s2s_daemon.tts.torch_qwen3.speaker_encoder import SpeakerEncoder, log_mel_spectrogram

    gold = _golden("ref_audio")
    spk = SpeakerEncoder.from_folder(FIXTURES / "base", "cpu", torch.float32)
    wav = _ref_wav()
    mel = log_mel_spectrogram(wav, spk.mel_filters)
    assert mel.shape == gold["speaker_mel"].shape == (367, 128)
    torch.testing.assert_close(mel.exp(), gold["speaker_mel"].exp(), rtol=1e-3, atol=1e-6)
    loud = gold["speaker_mel"] > -5.0  # energy above 7e-3: the log no longer amplifies rounding
    assert loud.sum() > 1000 and (mel - gold["speaker_mel"])[loud].abs().max() < 1e-4
    emb = spk.embed(wav)
    ref = gold["speaker_embedding"]
    assert emb.shape == ref.shape == (64,)
    assert torch.nn.functional.cosine_similarity(emb, ref, dim=0) > 0.9999
    assert (emb - ref).abs().max() < 1e-4


def test_speaker_encoder_from_state_dict_takes_either_prefix() -> None:
    from safetensors.torch import load_file

    from s2s_daemon.tts.torch_qwen3.speaker_encoder import SpeakerEncoder

    cfg = json.loads((FIXTURES / "base" / "config.json").read_text())["speaker_encoder_config"]
    full = load_file(str(FIXTURES / "base" / "model.safetensors"))
    prefixed = {k: v for k, v in full.items() if k.startswith("speaker_encoder.")}
    bare = {k.removeprefix("speaker_encoder."): v for k, v in prefixed.items()}
    wav = _ref_wav()[:24000]
    a = SpeakerEncoder.from_state_dict(prefixed, cfg).embed(wav)
    b = SpeakerEncoder.from_state_dict(bare, cfg).embed(wav)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="too short"):
        SpeakerEncoder.from_state_dict(bare, cfg).embed(torch.zeros(512))
