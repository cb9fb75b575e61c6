"""``tts.options`` of the torch engine, typed (``OptionsSchema``): what each knob takes, checked
by ``check-config`` and before the model loads; docs/configuration.md describes each. No torch here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from s2s_daemon.tts.engine import OptionsSchema

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


class TorchOptions(OptionsSchema):
    first_chunk_frames: int | None = Field(None, ge=1, le=50)
    """Frames of an utterance's first chunk (later ones are ``tts.chunk_frames``); None: the engine's."""
    text_streaming: bool | None = None
    """Text fed step by step (True) or whole in the prompt; None: the official default per mode."""
    threads: int | None = Field(None, ge=1, le=1024)
    """Fixes the CPU's intra-op threads, as ``tts.torch.threads`` does."""
    max_batch: int | None = Field(None, ge=1, le=64)
    """Requests decoded together; None: 4 with the native CPU kernels, else 1."""
    prefix_cache_rows: int | None = Field(None, ge=0)
    """Prompt positions whose keys and values are kept for prompts that begin the same way; 0: off."""
    max_frames: int | None = Field(None, ge=1)
    """A cap on an utterance's codec frames, below its text's budget."""
    cuda_graphs: bool = True
    prepared_cache: str | None = None
    """Where the prepared weights are kept (``prepared.cache_root``: ``0``/``off`` turns it off)."""
    codec_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The CPU codec decoder's matrix weights (``codec.pick_codec_weights``)."""
    codec_overlap: Literal["auto", "on", "off"] = "auto"
    """The codec on a thread of its own beside the talker (``overlap.py``)."""
    voice_cache: str | None = None
    """Where clone prompts are kept; ``off``: memory only."""

    @field_validator("codec_overlap", mode="before")
    @classmethod
    def _switch(cls, value: object) -> object:
        if isinstance(value, str):
            word = value.strip().lower()
            return "on" if word in ON else "off" if word in OFF else word
        return value

    @field_validator("codec_dtype", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value
