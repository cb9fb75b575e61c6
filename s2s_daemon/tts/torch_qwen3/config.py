"""Typed views of a Qwen3-TTS 12 Hz checkpoint's ``config.json`` and ``generation_config.json``.

Every dimension the model code uses comes from here, so 0.6B and 1.7B (and the tiny test
checkpoints) load through one path. No torch import: this module is plain data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s2s_daemon.tts.engine import CheckpointError

MODEL_TYPE = "qwen3_tts"
MODES = ("custom_voice", "voice_design", "base")


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Shape of one Qwen3 decoder stack (talker or code predictor)."""

    hidden_size: int
    """Width of the residual stream, channels."""
    intermediate_size: int
    """Width of the SwiGLU MLP, channels."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Channels per attention head."""
    rms_norm_eps: float
    rope_theta: float
    """RoPE base period."""
    attention_bias: bool
    vocab_size: int
    """Codec vocabulary of this stack's output head(s)."""
    mrope_section: tuple[int, ...] = ()
    """Rotary pairs per position axis (temporal, height, width); empty for plain RoPE."""
    mrope_interleaved: bool = False


@dataclass(frozen=True, slots=True)
class TalkerConfig:
    """The talker: the main decoder that predicts codebook 0, plus its code predictor."""

    decoder: DecoderConfig
    predictor: DecoderConfig
    text_vocab_size: int
    text_hidden_size: int
    """Width of the text embedding before the text projection MLP, channels."""
    num_code_groups: int
    """Codebooks per codec frame (16 for the 12 Hz tokenizer)."""
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    speaker_ids: dict[str, int]
    """Lower-case speaker name -> codec id (CustomVoice)."""
    speaker_dialects: dict[str, str | None]
    """Lower-case speaker name -> dialect language key, or None."""
    language_ids: dict[str, int]
    """Lower-case language key (``english``, ``sichuan_dialect``...) -> codec id."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Top-level facts of a checkpoint."""

    talker: TalkerConfig
    mode: str
    """``custom_voice``, ``voice_design`` or ``base``."""
    model_size: str
    """``0b6``, ``1b7``... as written by the checkpoint (may be empty)."""
    im_start_id: int
    im_end_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    speaker_embedding_dim: int
    """Output width of the speaker encoder (Base), channels."""

    @property
    def languages(self) -> tuple[str, ...]:
        """Canonical language names: ``auto`` then every non-dialect key, as the official model lists them."""
        return ("auto", *(k for k in self.talker.language_ids if "dialect" not in k))

    @property
    def voices(self) -> tuple[str, ...]:
        """Preset speaker names in display spelling (``uncle_fu`` -> ``Uncle_Fu``)."""
        if self.mode != "custom_voice":
            return ()
        return tuple("_".join(p.capitalize() for p in k.split("_")) for k in self.talker.speaker_ids)


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    """How one stage picks tokens; ``do_sample`` False means argmax."""

    do_sample: bool
    temperature: float
    top_k: int
    """0 disables top-k."""
    top_p: float
    """1.0 disables nucleus filtering."""


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """``generation_config.json`` with the official hard defaults filling gaps."""

    talker: SamplingSettings
    predictor: SamplingSettings
    repetition_penalty: float
    """Applied to codebook-0 logits of codes already generated (HF semantics)."""
    max_new_tokens: int
    """Upper bound on codec frames whatever the text length."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def _req(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise CheckpointError(f"config.json: {where}.{key} is missing")
    return section[key]


def _decoder(section: dict[str, Any], where: str, *, rope: bool) -> DecoderConfig:
    hidden = int(_req(section, "hidden_size", where))
    heads = int(_req(section, "num_attention_heads", where))
    head_dim = section.get("head_dim") or hidden // heads
    act = section.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: {where}.hidden_act {act!r} is not supported (silu only)")
    if section.get("use_sliding_window"):
        raise CheckpointError(f"config.json: {where}.use_sliding_window is not supported")
    mrope: tuple[int, ...] = ()
    interleaved = False
    scaling = section.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", None):
        raise CheckpointError(f"config.json: {where}.rope_scaling type {rope_type!r} is not supported")
    if rope and scaling.get("mrope_section"):
        mrope = tuple(int(x) for x in scaling["mrope_section"])
        interleaved = bool(scaling.get("interleaved", False))
        if sum(mrope) != int(head_dim) // 2:
            raise CheckpointError(f"config.json: {where}.rope_scaling.mrope_section does not sum to head_dim/2")
    return DecoderConfig(
        hidden_size=hidden,
        intermediate_size=int(_req(section, "intermediate_size", where)),
        num_layers=int(_req(section, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(section.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(section.get("rms_norm_eps", 1e-6)),
        rope_theta=float(section.get("rope_theta", 10000.0)),
        attention_bias=bool(section.get("attention_bias", False)),
        vocab_size=int(_req(section, "vocab_size", where)),
        mrope_section=mrope,
        mrope_interleaved=interleaved,
    )


def load_model_config(folder: Path) -> ModelConfig:
    """Parse ``folder/config.json``; CheckpointError names what is wrong."""
    raw = _read_json(folder / "config.json")
    model_type = raw.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(f"config.json: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
    tokenizer_type = raw.get("tokenizer_type")
    if tokenizer_type not in (None, "qwen3_tts_tokenizer_12hz"):
        raise CheckpointError(f"config.json: tokenizer_type {tokenizer_type!r} is not the 12 Hz tokenizer")
    mode = raw.get("tts_model_type") or "custom_voice"
    if mode not in MODES:
        raise CheckpointError(f"config.json: tts_model_type {mode!r} is not one of {', '.join(MODES)}")
    tc = _req(raw, "talker_config", "")
    if not isinstance(tc, dict):
        raise CheckpointError("config.json: talker_config is not an object")
    pc = _req(tc, "code_predictor_config", "talker_config")
    decoder = _decoder(tc, "talker_config", rope=True)
    predictor = _decoder(pc, "talker_config.code_predictor_config", rope=False)
    groups = int(_req(tc, "num_code_groups", "talker_config"))
    if int(pc.get("num_code_groups", groups)) != groups:
        raise CheckpointError("config.json: talker and code predictor disagree on num_code_groups")
    speakers = {str(k).lower(): int(v) for k, v in (tc.get("spk_id") or {}).items()}
    dialects_raw = tc.get("spk_is_dialect") or {}
    dialects = {str(k).lower(): (str(v) if v else None) for k, v in dialects_raw.items()}
    languages = {str(k).lower(): int(v) for k, v in (tc.get("codec_language_id") or {}).items()}
    talker = TalkerConfig(
        decoder=decoder,
        predictor=predictor,
        text_vocab_size=int(_req(tc, "text_vocab_size", "talker_config")),
        text_hidden_size=int(_req(tc, "text_hidden_size", "talker_config")),
        num_code_groups=groups,
        codec_eos_id=int(_req(tc, "codec_eos_token_id", "talker_config")),
        codec_think_id=int(_req(tc, "codec_think_id", "talker_config")),
        codec_nothink_id=int(_req(tc, "codec_nothink_id", "talker_config")),
        codec_think_bos_id=int(_req(tc, "codec_think_bos_id", "talker_config")),
        codec_think_eos_id=int(_req(tc, "codec_think_eos_id", "talker_config")),
        codec_pad_id=int(_req(tc, "codec_pad_id", "talker_config")),
        codec_bos_id=int(_req(tc, "codec_bos_id", "talker_config")),
        speaker_ids=speakers,
        speaker_dialects=dialects,
        language_ids=languages,
    )
    se = raw.get("speaker_encoder_config") or {}
    return ModelConfig(
        talker=talker,
        mode=mode,
        model_size=str(raw.get("tts_model_size") or ""),
        im_start_id=int(raw.get("im_start_token_id", 151644)),
        im_end_id=int(raw.get("im_end_token_id", 151645)),
        tts_pad_id=int(raw.get("tts_pad_token_id", 151671)),
        tts_bos_id=int(raw.get("tts_bos_token_id", 151672)),
        tts_eos_id=int(raw.get("tts_eos_token_id", 151673)),
        speaker_embedding_dim=int(se.get("enc_dim", decoder.hidden_size)),
    )


def load_generation_settings(folder: Path) -> GenerationSettings:
    """Parse ``folder/generation_config.json``; a missing file means the official hard defaults."""
    path = folder / "generation_config.json"
    raw = _read_json(path) if path.exists() else {}

    def pick(key: str, default: Any) -> Any:
        value = raw.get(key)
        return default if value is None else value

    return GenerationSettings(
        talker=SamplingSettings(
            do_sample=bool(pick("do_sample", True)),
            temperature=float(pick("temperature", 0.9)),
            top_k=int(pick("top_k", 50)),
            top_p=float(pick("top_p", 1.0)),
        ),
        predictor=SamplingSettings(
            do_sample=bool(pick("subtalker_dosample", True)),
            temperature=float(pick("subtalker_temperature", 0.9)),
            top_k=int(pick("subtalker_top_k", 50)),
            top_p=float(pick("subtalker_top_p", 1.0)),
        ),
        repetition_penalty=float(pick("repetition_penalty", 1.05)),
        max_new_tokens=int(pick("max_new_tokens", 2048)),
    )
