"""Configs and parameter layouts of Qwen3-TTS-12Hz checkpoints, written without the official package.

`model_config` / `speech_tokenizer_config` return the JSON the hub repos carry (explicit values, never
class defaults); `model_param_shapes` / `speech_tokenizer_param_shapes` return every tensor name the
official `from_pretrained` expects, with its shape. The names follow qwen-tts 0.1.1
(`qwen_tts.core.models.modeling_qwen3_tts`, `qwen_tts.core.tokenizer_12hz`) and transformers 4.57
(`MimiModel` for the speech tokenizer's encoder); tests/fixtures/qwen3_tiny/expected_keys.json holds the
key set recorded from the official classes.

Sizes: `0.6b` and `1.7b` are the released shapes. `tiny` keeps every structural feature (MRoPE in
three interleaved sections, 16 code groups, a code predictor narrower than the talker, a text width
different from the talker width, GQA, a SnakeBeta decoder block plus two ConvNeXt upsamplers giving 1920x)
at widths small enough to commit, and wide enough that mlx-audio's shape-guessing of conv layouts
(`check_array_shape_qwen3`) cannot go wrong: every kernel-1 conv has more than 64 input channels and
every other conv has more input channels than taps. Its codec has 256 codes per codebook, so every
codec special id is the released id minus 1920 (talker vocab 1152 = 128 + 1024, as 3072 = 2048 + 1024).
Its codec decoder has one decoder block (the released one has four): a narrower multi-block decoder
cannot satisfy mlx-audio's layout guess (the last block's kernel-1 convs need > 64 channels, and
each block halves the width), and a wider one would not fit the fixture budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Final

SIZES: Final = ("tiny", "0.6b", "1.7b")
KINDS: Final = ("custom_voice", "voice_design", "base")

Shape = tuple[int, ...]
Json = dict[str, Any]

# Text-side special tokens, at these offsets from the first special id (as in the Qwen2/3 vocab, where
# <|endoftext|> is 151643). Only the first three and the three tts ones matter to Qwen3-TTS; the others
# fill the gap so that the offsets match the released tokenizer.
TEXT_SPECIAL_TOKENS: Final = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)

# Released codec-side ids (0.6B and 1.7B share them).
_CODEC_IDS: Final = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
_LANGUAGE_IDS: Final = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
    "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
_SPEAKER_IDS: Final = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
_SPEAKER_DIALECTS: Final[dict[str, str | bool]] = {
    "serena": False,
    "vivian": False,
    "uncle_fu": False,
    "ryan": False,
    "aiden": False,
    "ono_anna": False,
    "sohee": False,
    "eric": "sichuan_dialect",
    "dylan": "beijing_dialect",
}


@dataclass(frozen=True, slots=True)
class SizeSpec:
    """Widths of one model size; all fields are counts (channels, layers, heads, entries)."""

    text_base_vocab: int
    """Ordinary BPE entries before the first special token (151643 in the released tokenizer)."""
    text_vocab_size: int
    """Rows of the talker's text embedding."""
    text_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]
    codebook_size: int
    """Codes per codebook; the talker vocab is this plus 1024 control ids."""
    cp_hidden_size: int
    cp_intermediate_size: int
    cp_num_hidden_layers: int
    cp_num_attention_heads: int
    cp_num_key_value_heads: int
    cp_head_dim: int
    spk_channels: tuple[int, ...]
    spk_attention_channels: int
    spk_se_channels: int
    model_size_tag: str
    """`tts_model_size` in config.json; the official code drops CustomVoice instructs for "0b6"."""
    dec_hidden_size: int
    dec_intermediate_size: int
    dec_num_hidden_layers: int
    dec_num_attention_heads: int
    dec_head_dim: int
    dec_latent_dim: int
    dec_codebook_dim: int
    dec_decoder_dim: int
    dec_upsample_rates: tuple[int, ...]
    dec_upsampling_ratios: tuple[int, ...]
    enc_num_filters: int
    enc_hidden_size: int
    enc_intermediate_size: int
    enc_num_hidden_layers: int
    enc_num_attention_heads: int
    enc_head_dim: int
    enc_codebook_dim: int
    speech_tokenizer_dtype: str = "float32"
    """dtype of speech_tokenizer/model.safetensors; bfloat16 for tiny to halve the committed fixture."""


_RELEASED_CODEC: Final[dict[str, Any]] = {
    "dec_hidden_size": 512,
    "dec_intermediate_size": 1024,
    "dec_num_hidden_layers": 8,
    "dec_num_attention_heads": 16,
    "dec_head_dim": 64,
    "dec_latent_dim": 1024,
    "dec_codebook_dim": 512,
    "dec_decoder_dim": 1536,
    "dec_upsample_rates": (8, 5, 4, 3),
    "dec_upsampling_ratios": (2, 2),
    "enc_num_filters": 64,
    "enc_hidden_size": 512,
    "enc_intermediate_size": 2048,
    "enc_num_hidden_layers": 8,
    "enc_num_attention_heads": 8,
    "enc_head_dim": 64,
    "enc_codebook_dim": 256,
}

# What the released 0.6B and 1.7B share (their public config.json files); they differ in the
# talker's hidden and intermediate sizes only.
_RELEASED_TALKER: Final[dict[str, Any]] = {
    "text_base_vocab": 151643,
    "text_vocab_size": 151936,
    "text_hidden_size": 2048,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mrope_section": (24, 20, 20),
    "codebook_size": 2048,
    "cp_hidden_size": 1024,
    "cp_intermediate_size": 3072,
    "cp_num_hidden_layers": 5,
    "cp_num_attention_heads": 16,
    "cp_num_key_value_heads": 8,
    "cp_head_dim": 128,
    "spk_channels": (512, 512, 512, 512, 1536),
    "spk_attention_channels": 128,
    "spk_se_channels": 128,
}

SIZE_SPECS: Final[dict[str, SizeSpec]] = {
    "tiny": SizeSpec(
        text_base_vocab=500,
        text_vocab_size=576,
        text_hidden_size=96,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        mrope_section=(6, 5, 5),
        codebook_size=128,
        cp_hidden_size=48,
        cp_intermediate_size=144,
        cp_num_hidden_layers=2,
        cp_num_attention_heads=4,
        cp_num_key_value_heads=2,
        cp_head_dim=16,
        spk_channels=(72, 72, 72, 72, 216),
        spk_attention_channels=72,
        spk_se_channels=72,
        model_size_tag="0b6",
        dec_hidden_size=64,
        dec_intermediate_size=128,
        dec_num_hidden_layers=2,
        dec_num_attention_heads=4,
        dec_head_dim=16,
        dec_latent_dim=32,
        dec_codebook_dim=132,
        dec_decoder_dim=130,
        dec_upsample_rates=(8,),
        dec_upsampling_ratios=(16, 15),
        enc_num_filters=4,
        enc_hidden_size=64,
        enc_intermediate_size=128,
        enc_num_hidden_layers=2,
        enc_num_attention_heads=4,
        enc_head_dim=16,
        enc_codebook_dim=16,
        speech_tokenizer_dtype="bfloat16",
    ),
    "0.6b": SizeSpec(
        hidden_size=1024, intermediate_size=3072, model_size_tag="0b6", **_RELEASED_TALKER, **_RELEASED_CODEC
    ),
    "1.7b": SizeSpec(
        hidden_size=2048, intermediate_size=6144, model_size_tag="1b7", **_RELEASED_TALKER, **_RELEASED_CODEC
    ),
}

NUM_CODE_GROUPS: Final = 16
ENC_NUM_QUANTIZERS: Final = 32
ENC_UPSAMPLING_RATIOS: Final = (8, 6, 5, 4)
SAMPLE_RATE_HZ: Final = 24000
FRAME_RATE_HZ: Final = 12.5
SAMPLES_PER_FRAME: Final = 1920


def codec_id_shift(spec: SizeSpec) -> int:
    """How far this size's codec control ids sit below the released ones (0, or 1920 for tiny)."""
    return 2048 - spec.codebook_size


def text_special_ids(spec: SizeSpec) -> dict[str, int]:
    """Token -> id of every text special token."""
    return {tok: spec.text_base_vocab + i for i, tok in enumerate(TEXT_SPECIAL_TOKENS)}


def talker_config(spec: SizeSpec) -> Json:
    shift = codec_id_shift(spec)
    code_predictor = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": spec.cp_head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.cp_hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.cp_intermediate_size,
        "layer_types": ["full_attention"] * spec.cp_num_hidden_layers,
        "max_position_embeddings": 65536,
        "max_window_layers": 28,
        "model_type": "qwen3_tts_talker_code_predictor",
        "num_attention_heads": spec.cp_num_attention_heads,
        "num_code_groups": NUM_CODE_GROUPS,
        "num_hidden_layers": spec.cp_num_hidden_layers,
        "num_key_value_heads": spec.cp_num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.codebook_size,
    }
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "code_predictor_config": code_predictor,
        **{k: v - shift for k, v in _CODEC_IDS.items()},
        "codec_language_id": {k: v - shift for k, v in _LANGUAGE_IDS.items()},
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 32768,
        "model_type": "qwen3_tts_talker",
        "num_attention_heads": spec.num_attention_heads,
        "num_code_groups": NUM_CODE_GROUPS,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "position_id_per_seconds": 13,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "interleaved": True,
            "mrope_section": list(spec.mrope_section),
            "rope_type": "default",
            "type": "default",
        },
        "rope_theta": 1000000,
        "sliding_window": None,
        "spk_id": {},
        "spk_is_dialect": {},
        "text_hidden_size": spec.text_hidden_size,
        "text_vocab_size": spec.text_vocab_size,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.codebook_size + 1024,
    }


def speaker_encoder_config(spec: SizeSpec) -> Json:
    return {
        "enc_attention_channels": spec.spk_attention_channels,
        "enc_channels": list(spec.spk_channels),
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_dim": spec.hidden_size,
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_res2net_scale": 8,
        "enc_se_channels": spec.spk_se_channels,
        "mel_dim": 128,
        "sample_rate": SAMPLE_RATE_HZ,
    }


def model_config(size: str, kind: str) -> Json:
    """config.json of a Qwen3-TTS-12Hz checkpoint of this size and kind."""
    spec = SIZE_SPECS[size]
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    talker = talker_config(spec)
    if kind == "custom_voice":
        shift = codec_id_shift(spec)
        talker["spk_id"] = {k: v - shift for k, v in _SPEAKER_IDS.items()}
        talker["spk_is_dialect"] = dict(_SPEAKER_DIALECTS)
    special = text_special_ids(spec)
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "im_end_token_id": special["<|im_end|>"],
        "im_start_token_id": special["<|im_start|>"],
        "model_type": "qwen3_tts",
        "speaker_encoder_config": speaker_encoder_config(spec),
        "talker_config": talker,
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.3",
        "tts_bos_token_id": special["<tts_text_bos>"],
        "tts_eos_token_id": special["<tts_text_eod>"],
        "tts_model_size": spec.model_size_tag,
        "tts_model_type": kind,
        "tts_pad_token_id": special["<tts_pad>"],
    }


GENERATION_CONFIG: Final[Json] = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}


def generation_config() -> Json:
    return copy.deepcopy(GENERATION_CONFIG)


def speech_tokenizer_config(size: str) -> Json:
    """speech_tokenizer/config.json (Qwen3TTSTokenizerV2, 12.5 Hz, 16 codebooks, 24 kHz)."""
    spec = SIZE_SPECS[size]
    decoder = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "codebook_dim": spec.dec_codebook_dim,
        "codebook_size": spec.codebook_size,
        "decoder_dim": spec.dec_decoder_dim,
        "head_dim": spec.dec_head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.dec_hidden_size,
        "intermediate_size": spec.dec_intermediate_size,
        "latent_dim": spec.dec_latent_dim,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "num_attention_heads": spec.dec_num_attention_heads,
        "num_hidden_layers": spec.dec_num_hidden_layers,
        "num_key_value_heads": spec.dec_num_attention_heads,
        "num_quantizers": NUM_CODE_GROUPS,
        "num_semantic_quantizers": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000,
        "semantic_codebook_size": 4096,
        "sliding_window": 72,
        "upsample_rates": list(spec.dec_upsample_rates),
        "upsampling_ratios": list(spec.dec_upsampling_ratios),
        "vector_quantization_hidden_dimension": spec.dec_codebook_dim,
    }
    encoder = {
        "_frame_rate": FRAME_RATE_HZ,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "audio_channels": 1,
        "codebook_dim": spec.enc_codebook_dim,
        "codebook_size": spec.codebook_size,
        "compress": 2,
        "dilation_growth_rate": 2,
        "head_dim": spec.enc_head_dim,
        "hidden_act": "gelu",
        "hidden_size": spec.enc_hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.enc_intermediate_size,
        "kernel_size": 7,
        "last_kernel_size": 3,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "model_type": "mimi",
        "norm_eps": 1e-05,
        "num_attention_heads": spec.enc_num_attention_heads,
        "num_filters": spec.enc_num_filters,
        "num_hidden_layers": spec.enc_num_hidden_layers,
        "num_key_value_heads": spec.enc_num_attention_heads,
        "num_quantizers": ENC_NUM_QUANTIZERS,
        "num_residual_layers": 1,
        "num_semantic_quantizers": 1,
        "pad_mode": "constant",
        "residual_kernel_size": 3,
        "rope_theta": 10000.0,
        "sampling_rate": SAMPLE_RATE_HZ,
        "sliding_window": 250,
        "trim_right_ratio": 1.0,
        "upsample_groups": spec.enc_hidden_size,
        "upsampling_ratios": list(ENC_UPSAMPLING_RATIOS),
        "use_cache": False,
        "use_causal_conv": True,
        "use_conv_shortcut": False,
        "use_streaming": False,
        "vector_quantization_hidden_dimension": spec.enc_codebook_dim,
    }
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "decode_upsample_rate": SAMPLES_PER_FRAME,
        "decoder_config": decoder,
        "encode_downsample_rate": SAMPLES_PER_FRAME,
        "encoder_config": encoder,
        "encoder_valid_num_quantizers": NUM_CODE_GROUPS,
        "input_sample_rate": SAMPLE_RATE_HZ,
        "model_type": "qwen3_tts_tokenizer_12hz",
        "output_sample_rate": SAMPLE_RATE_HZ,
        "torch_dtype": spec.speech_tokenizer_dtype,
        "transformers_version": "4.57.3",
    }


PREPROCESSOR_CONFIG: Final[Json] = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": SAMPLE_RATE_HZ,
}


# ----------------------------------------------------------------------------------------------
# Parameter layouts
# ----------------------------------------------------------------------------------------------


def _decoder_layer(
    out: dict[str, Shape], prefix: str, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    """A Qwen3 decoder layer (q/k norm on the head dim, SwiGLU MLP, two RMSNorms)."""
    out[f"{prefix}.self_attn.q_proj.weight"] = (heads * head_dim, hidden)
    out[f"{prefix}.self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
    out[f"{prefix}.self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
    out[f"{prefix}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
    out[f"{prefix}.self_attn.q_norm.weight"] = (head_dim,)
    out[f"{prefix}.self_attn.k_norm.weight"] = (head_dim,)
    out[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
    out[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
    out[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    out[f"{prefix}.input_layernorm.weight"] = (hidden,)
    out[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)


def _conv(out: dict[str, Shape], prefix: str, c_out: int, c_in: int, kernel: int, bias: bool = True) -> None:
    out[f"{prefix}.weight"] = (c_out, c_in, kernel)
    if bias:
        out[f"{prefix}.bias"] = (c_out,)


def _conv_transpose(out: dict[str, Shape], prefix: str, c_in: int, c_out: int, kernel: int) -> None:
    out[f"{prefix}.weight"] = (c_in, c_out, kernel)
    out[f"{prefix}.bias"] = (c_out,)


def model_param_shapes(size: str, kind: str) -> dict[str, Shape]:
    """Every tensor of model.safetensors with its shape."""
    spec = SIZE_SPECS[size]
    h = spec.hidden_size
    out: dict[str, Shape] = {}
    out["talker.model.codec_embedding.weight"] = (spec.codebook_size + 1024, h)
    out["talker.model.text_embedding.weight"] = (spec.text_vocab_size, spec.text_hidden_size)
    for i in range(spec.num_hidden_layers):
        _decoder_layer(
            out,
            f"talker.model.layers.{i}",
            h,
            spec.intermediate_size,
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
    out["talker.model.norm.weight"] = (h,)
    out["talker.text_projection.linear_fc1.weight"] = (spec.text_hidden_size, spec.text_hidden_size)
    out["talker.text_projection.linear_fc1.bias"] = (spec.text_hidden_size,)
    out["talker.text_projection.linear_fc2.weight"] = (h, spec.text_hidden_size)
    out["talker.text_projection.linear_fc2.bias"] = (h,)
    out["talker.codec_head.weight"] = (spec.codebook_size + 1024, h)
    cp = "talker.code_predictor"
    for i in range(spec.cp_num_hidden_layers):
        _decoder_layer(
            out,
            f"{cp}.model.layers.{i}",
            spec.cp_hidden_size,
            spec.cp_intermediate_size,
            spec.cp_num_attention_heads,
            spec.cp_num_key_value_heads,
            spec.cp_head_dim,
        )
    out[f"{cp}.model.norm.weight"] = (spec.cp_hidden_size,)
    for g in range(NUM_CODE_GROUPS - 1):
        out[f"{cp}.model.codec_embedding.{g}.weight"] = (spec.codebook_size, h)
    for g in range(NUM_CODE_GROUPS - 1):
        out[f"{cp}.lm_head.{g}.weight"] = (spec.codebook_size, spec.cp_hidden_size)
    if spec.cp_hidden_size != h:
        out[f"{cp}.small_to_mtp_projection.weight"] = (spec.cp_hidden_size, h)
        out[f"{cp}.small_to_mtp_projection.bias"] = (spec.cp_hidden_size,)
    if kind == "base":
        _speaker_encoder(out, spec)
    return out


def _speaker_encoder(out: dict[str, Shape], spec: SizeSpec) -> None:
    """ECAPA-TDNN: a TDNN, SE-Res2Net blocks, multi-layer aggregation, attentive pooling, fc."""
    cfg = speaker_encoder_config(spec)
    ch: list[int] = cfg["enc_channels"]
    ks: list[int] = cfg["enc_kernel_sizes"]
    scale: int = cfg["enc_res2net_scale"]
    se: int = cfg["enc_se_channels"]
    att: int = cfg["enc_attention_channels"]
    p = "speaker_encoder"
    _conv(out, f"{p}.blocks.0.conv", ch[0], cfg["mel_dim"], ks[0])
    for i in range(1, len(ch) - 1):
        b = f"{p}.blocks.{i}"
        _conv(out, f"{b}.tdnn1.conv", ch[i], ch[i - 1], 1)
        for j in range(scale - 1):
            _conv(out, f"{b}.res2net_block.blocks.{j}.conv", ch[i] // scale, ch[i] // scale, ks[i])
        _conv(out, f"{b}.tdnn2.conv", ch[i], ch[i], 1)
        _conv(out, f"{b}.se_block.conv1", se, ch[i], 1)
        _conv(out, f"{b}.se_block.conv2", ch[i], se, 1)
    _conv(out, f"{p}.mfa.conv", ch[-1], ch[-1], ks[-1])
    _conv(out, f"{p}.asp.tdnn.conv", att, ch[-1] * 3, 1)
    _conv(out, f"{p}.asp.conv", ch[-1], att, 1)
    _conv(out, f"{p}.fc", cfg["enc_dim"], ch[-1] * 2, 1)


def speech_tokenizer_param_shapes(size: str) -> dict[str, Shape]:
    """Every tensor of speech_tokenizer/model.safetensors with its shape."""
    spec = SIZE_SPECS[size]
    out: dict[str, Shape] = {}
    _mimi_encoder(out, spec)
    _codec_decoder(out, spec)
    return out


def _mimi_encoder(out: dict[str, Shape], spec: SizeSpec) -> None:
    """transformers' MimiModel without its decoder side (upsample, decoder_transformer, decoder)."""
    p = "encoder"
    nf = spec.enc_num_filters
    _conv(out, f"{p}.encoder.layers.0.conv", nf, 1, 7)
    idx = 1
    mult = 1
    for ratio in reversed(ENC_UPSAMPLING_RATIOS):
        c = mult * nf
        _conv(out, f"{p}.encoder.layers.{idx}.block.1.conv", c // 2, c, 3)
        _conv(out, f"{p}.encoder.layers.{idx}.block.3.conv", c, c // 2, 1)
        idx += 2  # residual block, ELU
        _conv(out, f"{p}.encoder.layers.{idx}.conv", c * 2, c, ratio * 2)
        idx += 1
        mult *= 2
    idx += 1  # ELU
    _conv(out, f"{p}.encoder.layers.{idx}.conv", spec.enc_hidden_size, mult * nf, 3)
    hid = spec.enc_hidden_size
    for i in range(spec.enc_num_hidden_layers):
        t = f"{p}.encoder_transformer.layers.{i}"
        inner = spec.enc_num_attention_heads * spec.enc_head_dim
        out[f"{t}.self_attn.q_proj.weight"] = (inner, hid)
        out[f"{t}.self_attn.k_proj.weight"] = (inner, hid)
        out[f"{t}.self_attn.v_proj.weight"] = (inner, hid)
        out[f"{t}.self_attn.o_proj.weight"] = (hid, inner)
        out[f"{t}.mlp.fc1.weight"] = (spec.enc_intermediate_size, hid)
        out[f"{t}.mlp.fc2.weight"] = (hid, spec.enc_intermediate_size)
        out[f"{t}.input_layernorm.weight"] = (hid,)
        out[f"{t}.input_layernorm.bias"] = (hid,)
        out[f"{t}.post_attention_layernorm.weight"] = (hid,)
        out[f"{t}.post_attention_layernorm.bias"] = (hid,)
        out[f"{t}.self_attn_layer_scale.scale"] = (hid,)
        out[f"{t}.mlp_layer_scale.scale"] = (hid,)
    _conv(out, f"{p}.downsample.conv", hid, hid, 4, bias=False)
    vq = spec.enc_codebook_dim
    for name, n_q in (("semantic", 1), ("acoustic", ENC_NUM_QUANTIZERS - 1)):
        q = f"{p}.quantizer.{name}_residual_vector_quantizer"
        for i in range(n_q):
            out[f"{q}.layers.{i}.codebook.initialized"] = (1,)
            out[f"{q}.layers.{i}.codebook.cluster_usage"] = (spec.codebook_size,)
            out[f"{q}.layers.{i}.codebook.embed_sum"] = (spec.codebook_size, vq)
        _conv(out, f"{q}.input_proj", vq, hid, 1, bias=False)
        _conv(out, f"{q}.output_proj", hid, vq, 1, bias=False)


def _codec_decoder(out: dict[str, Shape], spec: SizeSpec) -> None:
    """Qwen3TTSTokenizerV2Decoder: split RVQ, pre-conv, sliding-window transformer, upsamplers, vocoder."""
    p = "decoder"
    hid = spec.dec_hidden_size
    inner = spec.dec_num_attention_heads * spec.dec_head_dim
    for i in range(spec.dec_num_hidden_layers):
        t = f"{p}.pre_transformer.layers.{i}"
        out[f"{t}.self_attn.q_proj.weight"] = (inner, hid)
        out[f"{t}.self_attn.k_proj.weight"] = (inner, hid)
        out[f"{t}.self_attn.v_proj.weight"] = (inner, hid)
        out[f"{t}.self_attn.o_proj.weight"] = (hid, inner)
        out[f"{t}.mlp.gate_proj.weight"] = (spec.dec_intermediate_size, hid)
        out[f"{t}.mlp.up_proj.weight"] = (spec.dec_intermediate_size, hid)
        out[f"{t}.mlp.down_proj.weight"] = (hid, spec.dec_intermediate_size)
        out[f"{t}.input_layernorm.weight"] = (hid,)
        out[f"{t}.post_attention_layernorm.weight"] = (hid,)
        out[f"{t}.self_attn_layer_scale.scale"] = (hid,)
        out[f"{t}.mlp_layer_scale.scale"] = (hid,)
    out[f"{p}.pre_transformer.norm.weight"] = (hid,)
    out[f"{p}.pre_transformer.input_proj.weight"] = (hid, spec.dec_latent_dim)
    out[f"{p}.pre_transformer.input_proj.bias"] = (hid,)
    out[f"{p}.pre_transformer.output_proj.weight"] = (spec.dec_latent_dim, hid)
    out[f"{p}.pre_transformer.output_proj.bias"] = (spec.dec_latent_dim,)
    dim = spec.dec_codebook_dim
    for name, n_q in (("rvq_first", 1), ("rvq_rest", NUM_CODE_GROUPS - 1)):
        q = f"{p}.quantizer.{name}"
        _conv(out, f"{q}.input_proj", dim // 2, dim, 1, bias=False)
        _conv(out, f"{q}.output_proj", dim, dim // 2, 1, bias=False)
        for i in range(n_q):
            out[f"{q}.vq.layers.{i}._codebook.cluster_usage"] = (spec.codebook_size,)
            out[f"{q}.vq.layers.{i}._codebook.embedding_sum"] = (spec.codebook_size, dim // 2)
    lat = spec.dec_latent_dim
    _conv(out, f"{p}.pre_conv.conv", lat, dim, 3)
    for u, factor in enumerate(spec.dec_upsampling_ratios):
        b = f"{p}.upsample.{u}"
        _conv_transpose(out, f"{b}.0.conv", lat, lat, factor)
        _conv(out, f"{b}.1.dwconv.conv", lat, 1, 7)
        out[f"{b}.1.norm.weight"] = (lat,)
        out[f"{b}.1.norm.bias"] = (lat,)
        out[f"{b}.1.pwconv1.weight"] = (4 * lat, lat)
        out[f"{b}.1.pwconv1.bias"] = (4 * lat,)
        out[f"{b}.1.pwconv2.weight"] = (lat, 4 * lat)
        out[f"{b}.1.pwconv2.bias"] = (lat,)
        out[f"{b}.1.gamma"] = (lat,)
    d = spec.dec_decoder_dim
    _conv(out, f"{p}.decoder.0.conv", d, lat, 7)
    for i, rate in enumerate(spec.dec_upsample_rates):
        b = f"{p}.decoder.{i + 1}.block"
        c_in, c_out = d // 2**i, d // 2 ** (i + 1)
        out[f"{b}.0.alpha"] = (c_in,)
        out[f"{b}.0.beta"] = (c_in,)
        _conv_transpose(out, f"{b}.1.conv", c_in, c_out, 2 * rate)
        for j in range(3):
            r = f"{b}.{j + 2}"
            out[f"{r}.act1.alpha"] = (c_out,)
            out[f"{r}.act1.beta"] = (c_out,)
            _conv(out, f"{r}.conv1.conv", c_out, c_out, 7)
            out[f"{r}.act2.alpha"] = (c_out,)
            out[f"{r}.act2.beta"] = (c_out,)
            _conv(out, f"{r}.conv2.conv", c_out, c_out, 1)
    n = len(spec.dec_upsample_rates)
    final = d // 2**n
    out[f"{p}.decoder.{n + 1}.alpha"] = (final,)
    out[f"{p}.decoder.{n + 1}.beta"] = (final,)
    _conv(out, f"{p}.decoder.{n + 2}.conv", 1, final, 7)
