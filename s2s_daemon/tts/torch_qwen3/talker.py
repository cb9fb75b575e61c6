"""The talker (codebook 0) and its code predictor (codebooks 1..G-1), as plain torch modules.

Module and parameter names mirror the official ``Qwen3TTSForConditionalGeneration`` so
``model.safetensors`` loads with no renaming: ``talker.model.layers.N...``,
``talker.text_projection.linear_fc1``, ``talker.code_predictor.lm_head.N`` and so on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from s2s_daemon.tts.torch_qwen3.checkpoint import FileRows, TensorFiles
from s2s_daemon.tts.torch_qwen3.config import TalkerConfig
from s2s_daemon.tts.torch_qwen3.layers import DecoderStack


class LookupTable(nn.Embedding):
    """An embedding table kept in the checkpoint's dtype whose rows come out in ``rows_dtype``.

    Casting a looked-up row gives the values a table cast whole would hold, so the tables stay as
    stored (``checkpoint.STORED_DTYPE_TABLES``): mapped from the checkpoint, only the rows looked up
    become resident, at the stored width (bfloat16 in the released checkpoints: half of float32).
    ``scripts/bench_load.py`` shows the resident mappings.
    """

    rows_dtype: torch.dtype | None = None
    """The dtype of the rows handed out (``rows_in``); None: the table's own."""
    rows_from: FileRows | None = None
    """Where CPU lookups read their rows from the checkpoint file (``rows_by_reads``); None: from
    ``weight``, which then stays the mapped view (untouched) for the other paths."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        source = self.rows_from
        rows = source.take(ids) if source is not None and ids.device.type == "cpu" else super().forward(ids)
        dtype = self.rows_dtype
        return rows if dtype is None or rows.dtype == dtype else rows.to(dtype)

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of the rows handed out."""
        return self.rows_dtype if self.rows_dtype is not None else self.weight.dtype


def rows_in(root: nn.Module, dtype: torch.dtype) -> None:
    """Make every ``LookupTable`` under ``root`` hand out rows in ``dtype`` (the runtime dtype)."""
    for module in root.modules():
        if isinstance(module, LookupTable):
            module.rows_dtype = dtype


def rows_by_reads(root: nn.Module, files: TensorFiles) -> int:
    """Make every CPU ``LookupTable`` under ``root`` (named as in the checkpoint) read its rows from
    ``files`` when looked up (``checkpoint.FileRows``); returns how many."""
    count = 0
    for name, module in root.named_modules():
        if not isinstance(module, LookupTable) or module.weight.device.type != "cpu":
            continue
        stored = files.tensors.get(f"{name}.weight")
        if stored is None or stored.shape != tuple(module.weight.shape) or stored.dtype != module.weight.dtype:
            continue
        module.rows_from = files.rows(stored.name)
        count += 1
    return count


class TalkerBackbone(DecoderStack):
    """``talker.model``: the decoder stack plus the codec and text embedding tables."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg.decoder)
        self.codec_embedding = LookupTable(cfg.decoder.vocab_size, cfg.decoder.hidden_size)
        self.text_embedding = LookupTable(cfg.text_vocab_size, cfg.text_hidden_size)


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
            [LookupTable(cfg.predictor.vocab_size, cfg.decoder.hidden_size) for _ in range(cfg.num_code_groups - 1)]
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
        self.native: Any = None
        """``native.Predictor``: a frame's codebooks in one library call (set by ``native.fuse_predictor``)."""
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
