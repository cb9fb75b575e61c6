"""What the torch engine declares (its ``s2s_daemon.engines`` entry point names ``ENGINE``): its
``tts.torch`` block (``TorchSection``) and its ``tts.options`` (``TorchOptions``), typed, checked by
``check-config`` and before the model loads; docs/configuration.md describes each. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from s2s_daemon.engines import EngineSection, EngineSpec
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


class TorchSection(EngineSection):
    """``tts.torch``."""

    device: str = "auto"
    """``auto`` (cuda, then mps, then cpu), ``cpu``, ``cuda``, ``cuda:1``, ``mps``."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "auto"
    """``auto``: bfloat16 on CUDA, float32 elsewhere (activations; the weights follow ``quantization``)."""
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    """The talker's weights on the CPU: ``int8`` (per output channel), ``int4`` (per group of 64
    inputs, needs the native kernels), ``none`` (as ``dtype``), or ``auto``: int8 where the native
    kernels run, else none (``formats.py``; the choice and its reason are logged)."""
    kernels: Literal["auto", "native", "torch"] = "auto"
    """CPU linear kernels: ``native`` (the C kernels built at install), ``torch``'s own, or ``auto``
    (native when they were built and this CPU runs them)."""
    isa: Literal["auto", "generic", "avx2", "avx512", "amx", "neon", "dotprod", "i8mm"] = "auto"
    """The native kernels' instruction-set path: ``auto`` (the widest this CPU has) or a cap for
    tests and benchmarks (x86-64: ``generic``, ``avx2``, ``avx512``, ``amx``; aarch64: ``generic``,
    ``neon``, ``dotprod``, ``i8mm``); a path this CPU cannot run is refused by ``preflight``."""
    threads: int | Literal["auto"] = "auto"
    """Intra-op threads on the CPU: ``auto`` follows what the machine leaves free (affinity, a cgroup
    CPU quota, other processes, steal time; re-checked while running, ``tts/threads.py``); a number
    fixes it."""

    @field_validator("threads")
    @classmethod
    def _threads_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 1024:
            raise ValueError("must be auto or a number from 1 to 1024")
        return value

    def engine_fields(self) -> Mapping[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "kernels": self.kernels,
            "isa": self.isa,
            "threads": self.threads if isinstance(self.threads, int) else None,
        }


ENGINE = EngineSpec(
    engine="s2s_daemon.tts.torch_qwen3:TorchQwen3Engine",
    install="s2s-daemon[torch]",
    requires=("torch", "safetensors", "tokenizers"),  # transformers only for tokenizers tokenizer.json misses
    section=TorchSection,
    options=TorchOptions,
)
"""The torch engine, as ``pyproject.toml``'s ``s2s_daemon.engines`` entry point ``torch`` names it."""
