"""The talker (codebook 0) and its code predictor (codebooks 1..G-1), as plain torch modules.

Module and parameter names mirror the official ``Qwen3TTSForConditionalGeneration`` so
``model.safetensors`` loads with no renaming: ``talker.model.layers.N...``,
``talker.text_projection.linear_fc1``, ``talker.code_predictor.lm_head.N`` and so on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from s2s_daemon.tts.torch_qwen3.config import TalkerConfig
from s2s_daemon.tts.torch_qwen3.layers import DecoderStack


class TalkerBackbone(DecoderStack):
    """``talker.model``: the decoder stack plus the codec and text embedding tables."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg.decoder)
        self.codec_embedding = nn.Embedding(cfg.decoder.vocab_size, cfg.decoder.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """``talker.text_projection``: text width -> talker width through a SiLU MLP with biases."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))  # type: ignore[no-any-return]


class PredictorBackbone(DecoderStack):
    """``talker.code_predictor.model``: small decoder plus one embedding per codebook 1..G-1."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg.predictor)
        self.codec_embedding = nn.ModuleList(
            [nn.Embedding(cfg.predictor.vocab_size, cfg.decoder.hidden_size) for _ in range(cfg.num_code_groups - 1)]
        )


class CodePredictor(nn.Module):
    """``talker.code_predictor``: predicts codebooks 1..G-1 of a frame from the talker state."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.model = PredictorBackbone(cfg)
        self.lm_head = nn.ModuleList(
            [
                nn.Linear(cfg.predictor.hidden_size, cfg.predictor.vocab_size, bias=False)
                for _ in range(cfg.num_code_groups - 1)
            ]
        )
        self.small_to_mtp_projection: nn.Module
        if cfg.predictor.hidden_size != cfg.decoder.hidden_size:
            self.small_to_mtp_projection = nn.Linear(cfg.decoder.hidden_size, cfg.predictor.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()


class Talker(nn.Module):
    """``talker``."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.model = TalkerBackbone(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.decoder.hidden_size)
        self.codec_head = nn.Linear(cfg.decoder.hidden_size, cfg.decoder.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)


class Qwen3TtsWeights(nn.Module):
    """Root whose ``state_dict`` keys equal the checkpoint's (minus ``speaker_encoder.*``)."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.talker = Talker(cfg)
