"""The official talker prompt, position by position.

Text side: ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`` tokenized once;
the prompt cuts it by position (role = first 3 ids, content = ids[3:-5]). An instruction is
``<|im_start|>user\\n{instruct}<|im_end|>\\n``, a reference transcript
``<|im_start|>assistant\\n{ref}<|im_end|>\\n`` (content = ids[3:-2]).

Each prompt position is the sum of a projected text embedding and a codec embedding:

    [instruct...]                              (text only)
    role(3)                                    (text only)
    tts_pad x (n-2), tts_bos  +  codec[:-1]    codec = think/nothink tag, think_bos, [language],
                                               think_eos, [speaker], codec_pad, codec_bos
    then, without a reference:
      streaming text:   text[0] + codec_bos;   trailing = text[1:], tts_eos
      non-streaming:    (text..., tts_eos) + codec_pad each; tts_pad + codec_bos; trailing = tts_pad
    with a reference (ICL): text = ref_content + content, tts_eos; codec = codec_bos, sum(ref frame embeddings)
      non-streaming:    text + codec_pad each, then codec + tts_pad each; trailing = tts_pad
      streaming:        overlap text and codec position by position; the longer text tail trails,
                        a shorter text is padded with tts_pad.

During decoding, step g adds ``trailing[g]`` (or tts_pad once exhausted) to the sum of the 16
codebook embeddings of the frame just produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from s2s_daemon.tts.engine import UnknownVoiceError, UnsupportedLanguageError
from s2s_daemon.tts.torch_qwen3.config import ModelConfig
from s2s_daemon.tts.torch_qwen3.talker import Talker


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """Text token ids of one request, as the official processor produces them."""

    input_ids: tuple[int, ...]
    """The whole assistant-wrapped text."""
    instruct_ids: tuple[int, ...] | None
    ref_ids: tuple[int, ...] | None
    """The whole wrapped reference transcript (ICL cloning)."""

    @property
    def content_len(self) -> int:
        """Text tokens of the utterance itself."""
        return max(0, len(self.input_ids) - 8)


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def ref_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def tokenize(tokenizer: Any, text: str, instruct: str | None, reference: str | None) -> PromptTokens:
    """Tokenize like ``Qwen3TTSModel._tokenize_texts`` (the tokenizer's defaults, one text, no padding)."""

    def ids(s: str) -> tuple[int, ...]:
        return tuple(int(i) for i in tokenizer(s)["input_ids"])

    return PromptTokens(
        input_ids=ids(assistant_text(text)),
        instruct_ids=ids(instruct_text(instruct)) if instruct else None,
        ref_ids=ids(ref_text(reference)) if reference else None,
    )


def codec_prefix(cfg: ModelConfig, language: str, speaker: str | None) -> list[int]:
    """The codec tag ids before the speaker slot: think/nothink, think_bos, [language], think_eos.

    Raises UnsupportedLanguageError / UnknownVoiceError for names the checkpoint lacks.
    """
    tc = cfg.talker
    lang = language.strip().lower()
    if lang == "auto":
        language_id: int | None = None
    elif lang in tc.language_ids and "dialect" not in lang:
        language_id = tc.language_ids[lang]
    else:
        raise UnsupportedLanguageError(f"language {language!r} is not supported; choose one of {cfg.languages}")
    if speaker is not None:
        key = speaker.strip().lower()
        if key not in tc.speaker_ids:
            raise UnknownVoiceError(f"voice {speaker!r} is unknown; choose one of {', '.join(cfg.voices)}")
        dialect = tc.speaker_dialects.get(key)
        if lang in ("chinese", "auto") and dialect:
            if dialect not in tc.language_ids:
                raise UnsupportedLanguageError(f"dialect {dialect!r} of voice {speaker!r} has no language id")
            language_id = tc.language_ids[dialect]
    if language_id is None:
        return [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    return [tc.codec_think_id, tc.codec_think_bos_id, language_id, tc.codec_think_eos_id]


@dataclass(frozen=True, slots=True)
class PromptEmbeddings:
    """What the decode loop needs: the prefill, the text that trails into decoding, the pad."""

    prefill: torch.Tensor
    """``[1, L, hidden]`` in the model dtype."""
    trailing: torch.Tensor
    """``[N, hidden]``: added at decode steps 0..N-1."""
    pad: torch.Tensor
    """``[hidden]``: projected tts_pad, added once ``trailing`` is exhausted."""


def frame_embedding_sum(talker: Talker, codes: torch.Tensor) -> torch.Tensor:
    """Sum of the 16 codebook embeddings per frame: ``codes`` ``[T, G]`` -> ``[T, hidden]``."""
    parts = [talker.model.codec_embedding(codes[:, 0])]
    for i, table in enumerate(talker.code_predictor.model.codec_embedding):
        parts.append(table(codes[:, i + 1]))
    return torch.stack(parts, dim=1).sum(dim=1)


def build_embeddings(
    talker: Talker,
    cfg: ModelConfig,
    tokens: PromptTokens,
    prefix: list[int],
    speaker: int | torch.Tensor | None,
    ref_codes: torch.Tensor | None,
    non_streaming: bool,
) -> PromptEmbeddings:
    """Assemble the prompt exactly as ``Qwen3TTSForConditionalGeneration.generate`` does (batch of one).

    ``speaker``: a codec id (CustomVoice), a speaker-encoder embedding ``[hidden]`` (Base), or None.
    ``ref_codes``: ``[T, G]`` reference frames for ICL cloning (needs ``tokens.ref_ids``).
    """
    tc = cfg.talker
    table = talker.model.codec_embedding
    device, dtype = table.weight.device, table.out_dtype

    def text(ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        t = torch.tensor([list(ids)], dtype=torch.long, device=device)
        rows = talker.model.text_embedding(t).to(dtype)  # the model's dtype (LookupTable casts them)
        return talker.text_projection(rows)[0]  # type: ignore[no-any-return]

    def codec(ids: list[int]) -> torch.Tensor:
        return talker.model.codec_embedding(torch.tensor(ids, dtype=torch.long, device=device))  # type: ignore[no-any-return]

    special = text([cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id])
    tts_bos, tts_eos, tts_pad = special[0:1], special[1:2], special[2:3]

    codec_rows = [codec(prefix)]
    if isinstance(speaker, int):
        codec_rows.append(codec([speaker]))
    elif isinstance(speaker, torch.Tensor):
        codec_rows.append(speaker.to(device=device, dtype=dtype).view(1, -1))
    codec_rows.append(codec([tc.codec_pad_id, tc.codec_bos_id]))
    codec_seq = torch.cat(codec_rows, dim=0)
    n = codec_seq.shape[0]

    ids = tokens.input_ids
    pieces: list[torch.Tensor] = []
    if tokens.instruct_ids is not None:
        pieces.append(text(tokens.instruct_ids))
    pieces.append(text(ids[:3]))
    pieces.append(torch.cat([tts_pad.expand(n - 2, -1), tts_bos], dim=0) + codec_seq[:-1])

    content = ids[3:-5]
    if ref_codes is not None:
        if tokens.ref_ids is None:
            raise ValueError("ICL cloning needs the reference transcript")
        text_embed = torch.cat([text(tokens.ref_ids[3:-2] + content), tts_eos], dim=0)
        codec_embed = torch.cat([codec([tc.codec_bos_id]), frame_embedding_sum(talker, ref_codes.to(device))], dim=0)
        t_len, c_len = text_embed.shape[0], codec_embed.shape[0]
        if non_streaming:
            pieces.append(text_embed + codec([tc.codec_pad_id] * t_len))
            pieces.append(codec_embed + tts_pad)
            trailing = tts_pad
        elif t_len > c_len:
            pieces.append(text_embed[:c_len] + codec_embed)
            trailing = text_embed[c_len:]
        else:
            padded = torch.cat([text_embed, tts_pad.expand(c_len - t_len, -1)], dim=0)
            pieces.append(padded + codec_embed)
            trailing = tts_pad
    elif non_streaming:
        body = torch.cat([text(content), tts_eos], dim=0)
        pieces.append(body + codec([tc.codec_pad_id] * body.shape[0]))
        pieces.append(tts_pad + codec([tc.codec_bos_id]))
        trailing = tts_pad
    else:
        pieces.append(text(ids[3:4]) + codec_seq[-1:])
        trailing = torch.cat([text(ids[4:-5]), tts_eos], dim=0)
    prefill = torch.cat(pieces, dim=0).unsqueeze(0)
    return PromptEmbeddings(prefill=prefill, trailing=trailing, pad=tts_pad[0])
