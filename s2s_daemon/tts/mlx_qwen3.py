"""The MLX engine: Qwen3-TTS 12 Hz on Apple Silicon (Metal), or the Linux CPU for tests.

The model code is mlx-audio's (``mlx_audio.tts.models.qwen3_tts``); this module chooses and
loads the weights (an ``mlx-community`` repo as stored, a ``Qwen/`` id mapped to the one of the
configured quantization, or an official-layout folder quantized at load), validates requests,
streams mlx-audio's chunks (``chunk_frames`` mapped onto its ``streaming_interval``; a stop is
noticed between chunks) and keeps memory flat between utterances. It imports mlx only inside the
methods that run on the engine thread. Base models' clone prompts are kept in memory and on disk
(``MlxClonePromptCache``) and answered from there when mlx-audio asks its encoders for them.
``scripts/bench_mlx_overhead.py`` measures what this module adds to mlx-audio.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import structlog
from pydantic import Field

from s2s_daemon.engines import EngineSection, EngineSpec
from s2s_daemon.errors import ConfigError
from s2s_daemon.pipeline.vocabulary import (
    DeviceMemory,
    EngineError,
    EngineInfo,
    Samples,
    UnknownVoiceError,
    match_voice,
    normalize_language,
)
from s2s_daemon.pipeline.voices import default_cache_dir
from s2s_daemon.tts.clone_keys import PromptKeys
from s2s_daemon.tts.engine import CheckpointError, EngineOptions, OptionsSchema, ShouldStop, SynthesisRequest
from s2s_daemon.tts.hub import hub_failure

log = structlog.get_logger(__name__)

FRAME_RATE_HZ = 12.5
"""Codec frames per second of the 12 Hz tokenizer."""
QUANT_GROUP_SIZE = 64
"""Weights per quantization group, as in the mlx-community conversions."""
QUANTIZATIONS: dict[str, int | None] = {"4bit": 4, "6bit": 6, "8bit": 8, "bf16": None}
"""``tts.mlx.quantization`` values and their bit widths (``bf16`` is a cast)."""
FLOAT32 = "float32"
"""Extra-only value of ``mlx_quantization``: run the talker in float32 (cross-checks with torch)."""
FRAMES_BASE = 30
FRAMES_PER_TOKEN = 8
"""Frame budget ``FRAMES_BASE + FRAMES_PER_TOKEN * text tokens``, the torch engine's rule."""
CLONE_MEMORY_ENTRIES = 16
"""Clone prompts kept in memory, oldest dropped first (each holds its recording: <= 2.9 MB at 30 s)."""
CLONE_FORMAT = "1"
"""Bumped when what a stored clone prompt holds changes."""
_HUB_QWEN = re.compile(r"^Qwen/(Qwen3-TTS-12Hz-[A-Za-z0-9.]+-[A-Za-z]+)$")
_LOCAL_PREFIXES = ("/", ".", "~")
_MLX_COMMUNITY = "mlx-community/"

# --- voices ---


def display_voice(key: str) -> str:
    """A speaker key of the checkpoint (``uncle_fu``) as users write it (``Uncle_Fu``)."""
    return "_".join(part[:1].upper() + part[1:] for part in key.split("_"))


# --- where the weights come from (pure python) ---


@dataclass(frozen=True, slots=True)
class MlxSource:
    """Where to load from, before anything is read or downloaded."""

    location: str
    """A local folder, or a hub repo id."""
    local: bool
    """True for a folder on this machine."""
    as_stored: bool = False
    """An mlx-community conversion: never quantized again, whatever its dtype."""


def resolve_source(model: str, quantization: str) -> MlxSource:
    """Map ``tts.model`` to a folder or repo; ``Qwen/...`` ids become mlx-community repos."""
    path = Path(model).expanduser()
    if path.is_dir():
        return MlxSource(str(path), local=True)
    if model.startswith(_LOCAL_PREFIXES) or path.exists():
        msg = f"model folder {model!r} does not exist or is not a folder"
        raise CheckpointError(msg)
    match = _HUB_QWEN.match(model)
    if match is not None and quantization in QUANTIZATIONS:
        return MlxSource(f"mlx-community/{match.group(1)}-{quantization}", local=False, as_stored=True)
    return MlxSource(model, local=False, as_stored=model.startswith(_MLX_COMMUNITY))


def chunk_interval_s(chunk_frames: int) -> float:
    """mlx-audio's ``streaming_interval`` that yields exactly ``chunk_frames`` frames per chunk."""
    # mlx-audio computes max(1, int(interval * 12.5)); aim at the middle of the
    # frame so float rounding cannot drop a frame.
    return (max(1, chunk_frames) + 0.5) / FRAME_RATE_HZ


@dataclass(frozen=True, slots=True)
class _Loaded:
    """What load_blocking found out about the checkpoint."""

    model: Any
    """mlx-audio's ``qwen3_tts.Model``."""
    info: EngineInfo
    max_frames: int | None
    """``extra['max_frames']``: a lower cap than the frame budget (tests, benchmarks)."""
    hook: _ClonePromptHook | None = None
    """Base models: mlx-audio's encoder calls answered from the cache."""
    clones: MlxClonePromptCache | None = None
    """Base models: the clone prompts computed so far."""


# --- clone prompts: computed once, kept in memory and on disk ---


@dataclass(frozen=True, slots=True)
class MlxClonePrompt:
    """What mlx-audio's encoders make of one recording."""

    speaker: Any
    """``extract_speaker_embedding``'s x-vector, ``mx.array [1, enc_dim]`` float32."""
    ref_codes: Any | None
    """``speech_tokenizer.encode``'s codes ``[1, groups, frames]`` for ICL cloning; None for x-vector only."""
    audio: Any
    """The recording as mlx-audio loads it (24 kHz mono float32): still handed to mlx-audio. Memory only."""


MlxCompute = Callable[[str, bool], MlxClonePrompt]
"""(recording path, with codes) -> the prompt: runs the encoders."""
MlxLoadAudio = Callable[[str], Any]
"""Recording path -> the recording as mlx-audio loads it."""


class MlxClonePromptCache:
    """Memory and disk cache of clone prompts for one loaded model (engine thread only)."""

    def __init__(self, model_key: str, folder: Path | None) -> None:
        self.model_key = model_key
        """The model, quantization, device and mlx-audio version the prompts belong to."""
        self.folder = folder
        """Where prompts are stored; None keeps them in memory only."""
        self._memory: OrderedDict[str, MlxClonePrompt] = OrderedDict()
        self._keys = PromptKeys(CLONE_FORMAT, model_key)
        self.computed = 0
        """Prompts computed by the encoders (tests, logs)."""
        self.loaded = 0
        """Prompts read from disk."""

    def key(self, path: str, with_codes: bool) -> str:
        return self._keys.key(path, with_codes)

    def get(self, path: str, with_codes: bool, compute: MlxCompute, load_audio: MlxLoadAudio) -> MlxClonePrompt:
        """The prompt for the recording at ``path``: from memory, else disk, else ``compute``."""
        key = self.key(path, with_codes)
        found = self._memory.get(key)
        if found is not None:
            self._memory.move_to_end(key)
            return found
        found = self._load(key, path, with_codes, load_audio)
        if found is None:
            found = compute(path, with_codes)
            self.computed += 1
            self._store(key, found)
        self._memory[key] = found
        while len(self._memory) > CLONE_MEMORY_ENTRIES:
            self._memory.popitem(last=False)
        return found

    def _path(self, key: str) -> Path | None:
        return self.folder / f"mlx-{key}.safetensors" if self.folder is not None else None

    def _load(self, key: str, path: str, with_codes: bool, load_audio: MlxLoadAudio) -> MlxClonePrompt | None:
        stored = self._path(key)
        if stored is None or not stored.is_file():
            return None
        import mlx.core as mx

        try:
            arrays = mx.load(str(stored))
            if isinstance(arrays, dict):
                mx.eval(*arrays.values())  # read now, not lazily once the file may have been replaced
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("clone_prompt_unreadable", path=str(stored), error=str(exc))
            return None
        if not isinstance(arrays, dict) or "speaker" not in arrays or (with_codes and "ref_codes" not in arrays):
            return None
        self.loaded += 1
        return MlxClonePrompt(arrays["speaker"], arrays.get("ref_codes") if with_codes else None, load_audio(path))

    def _store(self, key: str, prompt: MlxClonePrompt) -> None:
        stored = self._path(key)
        if stored is None:
            return
        import mlx.core as mx

        arrays = {"speaker": prompt.speaker}
        if prompt.ref_codes is not None:
            arrays["ref_codes"] = prompt.ref_codes
        try:
            stored.parent.mkdir(parents=True, exist_ok=True)
            # mx.save_safetensors appends ".safetensors" to a name without it: give it one.
            fd, tmp = tempfile.mkstemp(dir=stored.parent, prefix=f".{key}.", suffix=".tmp.safetensors")
            os.close(fd)
            try:
                mx.save_safetensors(tmp, arrays, metadata={"format": CLONE_FORMAT})
                os.replace(tmp, stored)  # atomic: a reader sees the old file or the whole new one
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, RuntimeError) as exc:  # a read-only cache folder costs speed, not the request
            log.warning("clone_prompt_not_stored", path=str(stored), error=str(exc))


class _ClonePromptHook:
    """Installed on the loaded model: mlx-audio's two encoder entry points answer from ``pending``.

    With nothing pending (warm-up, benchmarks driving ``mlx_model`` directly) they run mlx-audio's
    own methods, looked up on the class at each call.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.pending: MlxClonePrompt | None = None
        self.used: set[str] = set()
        self.warned = False
        """``mlx_clone_cache_bypassed`` was logged."""
        model.extract_speaker_embedding = self._speaker
        if model.speech_tokenizer is not None:
            model.speech_tokenizer.encode = self._codes

    def speaker_embedding(self, audio: Any) -> Any:
        """mlx-audio's own ``extract_speaker_embedding`` (the speaker encoder runs)."""
        return type(self.model).extract_speaker_embedding(self.model, audio)

    def reference_codes(self, audio: Any) -> Any:
        """mlx-audio's own ``speech_tokenizer.encode`` of a ``[1, 1, samples]`` recording (the codec encoder runs)."""
        tokenizer = self.model.speech_tokenizer
        return type(tokenizer).encode(tokenizer, audio)

    def _speaker(self, audio: Any, sr: int = 24000) -> Any:
        if self.pending is not None:
            self.used.add("speaker")
            return self.pending.speaker
        return type(self.model).extract_speaker_embedding(self.model, audio, sr)

    def _codes(self, audio: Any) -> Any:
        if self.pending is not None and self.pending.ref_codes is not None:
            self.used.add("codes")
            return self.pending.ref_codes
        return self.reference_codes(audio)


class MlxSection(EngineSection):
    """``tts.mlx``."""

    device: Literal["auto", "metal", "cpu"] = "auto"
    """``auto`` (Metal when there is one, else the CPU), ``metal`` or ``cpu``."""
    quantization: Literal["4bit", "6bit", "8bit", "bf16"] = "6bit"

    def engine_fields(self) -> Mapping[str, Any]:
        return {"device": self.device, "quantization": self.quantization}


class MlxOptions(OptionsSchema):
    """``tts.options`` of the MLX engine (docs/configuration.md); no mlx import."""

    max_frames: int | None = Field(None, ge=1)
    """A cap on an utterance's codec frames, below its text's budget (tests, benchmarks)."""
    voice_cache: str | None = None
    """Where clone prompts are kept (the torch engine's folder by default); ``off``: memory only."""
    mlx_quantization: Literal["4bit", "6bit", "8bit", "bf16", "float32"] | None = None
    """Overrides ``tts.mlx.quantization`` (``float32``: unquantized, for the tests' parity checks)."""


class MlxQwen3Engine:
    """Qwen3-TTS through mlx-audio; every method runs on the engine's one worker thread."""

    park_thread_on_close = True
    """MLX aborts the process at exit when the thread that ran it has ended: keep it parked."""

    def __init__(self, options: EngineOptions) -> None:
        self._options = options
        typed = MlxOptions.read(options.extra)
        quant = typed.mlx_quantization or options.quantization
        if quant not in QUANTIZATIONS and quant != FLOAT32:
            msg = f"tts.mlx.quantization must be one of {', '.join(QUANTIZATIONS)}, not {quant!r}"
            raise ConfigError(msg)
        self._quantization = quant
        self._max_frames = typed.max_frames
        self._voice_cache = typed.voice_cache
        self._loaded: _Loaded | None = None
        self._thread: int | None = None

    # -- protocol --

    def load_blocking(self) -> EngineInfo:
        """Resolve, (download,) load and quantize the weights; return what the model offers."""
        if self._loaded is not None:
            return self._loaded.info
        self._thread = threading.get_ident()
        import mlx.core as mx

        device = self._select_device(mx)
        source = resolve_source(self._options.model, self._quantization)
        folder = self._fetch(source)
        config = _read_config(folder)
        started = time.perf_counter()
        model = self._load_model(folder)
        stored_bits = (config.get("quantization") or {}).get("bits")
        if stored_bits is not None or source.as_stored:
            dtype = f"{stored_bits}bit" if stored_bits is not None else _talker_dtype(model)
            if self._quantization != dtype:
                log.info("mlx_checkpoint_as_stored", stored=dtype, configured=self._quantization)
        else:
            dtype = _quantize_at_load(model, self._quantization)
        if device == "cpu":
            # As the torch engine does: a CPU gains nothing from a bf16 codec decoder, and
            # float32 keeps the two engines' waveforms comparable. (The decoder is an
            # mx.compile wrapper that forwards set_dtype to the module; it has not been
            # traced yet, so the cast is what it will run with.)
            model.speech_tokenizer.decoder.set_dtype(mx.float32)
        mx.eval(model.parameters())
        gc.collect()
        mx.clear_cache()
        mode = str(getattr(model.config, "tts_model_type", "base"))
        voices = tuple(display_voice(k) for k in model.get_supported_speakers())
        languages = ("auto", *dict.fromkeys(str(x).lower() for x in model.get_supported_languages() if x != "auto"))
        info = EngineInfo(
            engine="mlx",
            model=self._options.model,
            device=device,
            sample_rate=int(model.sample_rate),
            voices=voices,
            languages=languages,
            dtype=dtype,
            mode=mode,
        )
        hook = clones = None
        if mode == "base" and getattr(model, "speaker_encoder", None) is not None:
            hook = _ClonePromptHook(model)
            clones = MlxClonePromptCache(_clone_model_key(folder, dtype, device), self._clone_folder())
        self._loaded = _Loaded(model=model, info=info, max_frames=self._max_frames, hook=hook, clones=clones)
        log.info(
            "mlx_engine_loaded",
            source=source.location,
            folder=str(folder),
            dtype=dtype,
            mode=mode,
            device=device,
            load_s=round(time.perf_counter() - started, 3),
            active_mib=round(mx.get_active_memory() / 2**20, 1),
        )
        return info

    def warmup_blocking(self) -> None:
        """Synthesize one two-frame chunk so the first request pays no first-call costs."""
        info = self._require().info
        request = SynthesisRequest(
            text="Hello.",
            voice=info.voices[0] if info.mode == "custom_voice" and info.voices else None,
            language="auto",
            instruct="A calm, clear voice." if info.mode == "voice_design" else None,
            chunk_frames=2,
            seed=0,
        )
        for _ in self._stream(request, lambda: False, max_frames=2):
            pass

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[Samples]:
        """Yield float32 chunks of ``request.chunk_frames`` frames; stop between chunks."""
        return self._stream(request, should_stop, max_frames=self._require().max_frames)

    @property
    def mlx_model(self) -> Any:
        """mlx-audio's loaded ``qwen3_tts.Model`` (benchmarks, cross-checks; engine thread only)."""
        return self._require().model

    def memory_blocking(self) -> DeviceMemory:
        """MLX's own counters: memory held by arrays now and the high-water mark, MiB."""
        self._check_thread()
        import mlx.core as mx

        return DeviceMemory(
            kind="mlx",
            allocated_mib=mx.get_active_memory() / 2**20,
            peak_mib=mx.get_peak_memory() / 2**20,
        )

    def close_blocking(self) -> None:
        """Drop the model and hand MLX's cached buffers back to the system."""
        if self._loaded is None:
            return
        self._check_thread()
        import mlx.core as mx

        self._loaded = None
        gc.collect()
        mx.clear_cache()
        log.info("mlx_engine_closed", active_mib=round(mx.get_active_memory() / 2**20, 1))

    # -- streaming --

    def _stream(
        self, request: SynthesisRequest, should_stop: ShouldStop, *, max_frames: int | None
    ) -> Iterator[Samples]:
        # Validate before the generator starts, so a bad request fails at the call.
        loaded = self._require()
        kwargs = self._generate_kwargs(loaded, request, max_frames)
        return self._chunks(loaded, request, kwargs, should_stop)

    def _chunks(
        self, loaded: _Loaded, request: SynthesisRequest, kwargs: dict[str, Any], should_stop: ShouldStop
    ) -> Iterator[Samples]:
        import mlx.core as mx

        model = loaded.model
        if request.seed is not None:
            mx.random.seed(request.seed)
        entry = kwargs.pop("entry")
        prompt: MlxClonePrompt | None = kwargs.pop("clone_prompt", None)
        hook = loaded.hook
        if hook is not None:
            hook.pending, hook.used = prompt, set()
        results = getattr(model, entry)(**kwargs)
        chunks = 0
        finished = False
        try:
            while not should_stop():
                try:
                    result = next(results)
                except StopIteration:
                    finished = True
                    break
                except (ValueError, RuntimeError, FileNotFoundError, OSError) as exc:
                    msg = f"mlx-audio failed: {exc}"
                    raise EngineError(msg) from exc
                if chunks == 0 and hook is not None and prompt is not None:
                    self._check_prompt_used(hook, prompt)
                if should_stop():
                    break
                chunks += 1
                yield np.array(result.audio.astype(mx.float32), dtype=np.float32, copy=True)
        finally:
            if hook is not None:
                hook.pending = None
            self._release(model, results, finished)
            log.debug("mlx_utterance_released", chunks=chunks, active_mib=round(mx.get_active_memory() / 2**20, 1))

    def _release(self, model: Any, results: Any, finished: bool) -> None:
        """Free everything one utterance held, whether it finished or was stopped."""
        import mlx.core as mx

        results.close()
        if not finished:
            # A finished stream has reset the decoder itself; a stopped one left its conv
            # buffers and KV cache behind (a walk over all modules).
            model.speech_tokenizer.decoder.reset_streaming_state()
        # mlx-audio's own ICL cache (keyed by the recording's length and sum) is superseded by the
        # clone-prompt cache (keyed by its hash): emptied, so the codes always come from ours.
        icl_cache: dict[Any, Any] = getattr(model, "_icl_cache", {})
        icl_cache.clear()
        mx.clear_cache()

    @staticmethod
    def _check_prompt_used(hook: _ClonePromptHook, prompt: MlxClonePrompt) -> None:
        """Log (once) when mlx-audio prepared the prompt without asking the hook: it ran its encoders."""
        wanted = {"speaker"} | ({"codes"} if prompt.ref_codes is not None else set())
        if not wanted <= hook.used and not hook.warned:
            hook.warned = True
            log.warning("mlx_clone_cache_bypassed", wanted=sorted(wanted), used=sorted(hook.used))

    def _generate_kwargs(self, loaded: _Loaded, request: SynthesisRequest, max_frames: int | None) -> dict[str, Any]:
        """Validate ``request`` as the torch engine does and turn it into mlx-audio arguments."""
        info = loaded.info
        voice = match_voice(request.voice, info.voices, None)
        language = normalize_language(request.language, info.languages)
        instruct = request.instruct or None
        ref_audio = request.ref_audio or None
        if ref_audio is not None:
            if info.mode != "base":
                msg = f"voice cloning from a reference recording needs a Base model, not {info.mode}"
                raise UnknownVoiceError(msg)
            if not Path(ref_audio).is_file():
                msg = f"cannot read reference audio {ref_audio!r}: no such file"
                raise EngineError(msg)
        prompt = self._clone_prompt(loaded, ref_audio, request.ref_text or None) if ref_audio is not None else None
        kwargs: dict[str, Any] = {
            "text": request.text,
            "language": language,
            "stream": True,
            "streaming_interval": chunk_interval_s(request.chunk_frames),
            "max_tokens": self._budget(loaded.model, request.text, max_frames),
            "verbose": False,
        }
        if request.greedy:
            kwargs["temperature"] = 0.0
        if info.mode == "voice_design":
            # generate() insists on an instruct; the official model (and the torch engine)
            # also speak without one, so call the VoiceDesign entry point directly.
            kwargs["instruct"] = instruct or ""
            return {"entry": "generate_voice_design", **kwargs}
        kwargs["lang_code"] = kwargs.pop("language")
        kwargs.update(
            voice=voice.lower() if voice else None,
            instruct=instruct if info.mode == "custom_voice" else None,
            ref_audio=prompt.audio if prompt is not None else ref_audio,
            ref_text=(request.ref_text or None) if ref_audio is not None else None,
            split_pattern="",
        )
        return {"entry": "generate", "clone_prompt": prompt, **kwargs}

    # -- clone prompts --

    def _clone_prompt(self, loaded: _Loaded, path: str, ref_text: str | None) -> MlxClonePrompt | None:
        """The cached prompt of the recording at ``path``; None when this build cannot clone (mlx-audio decides)."""
        if loaded.clones is None or loaded.hook is None:
            return None
        tokenizer = loaded.model.speech_tokenizer
        with_codes = ref_text is not None and bool(getattr(tokenizer, "has_encoder", False))
        hook = loaded.hook

        def compute(recording: str, codes: bool) -> MlxClonePrompt:
            import mlx.core as mx

            audio = self._read_reference(loaded, recording)
            started = time.perf_counter()
            try:
                speaker = hook.speaker_embedding(audio)
                ref_codes = hook.reference_codes(audio[None, None, :]) if codes else None
                mx.eval(speaker, *(() if ref_codes is None else (ref_codes,)))
            except (ValueError, RuntimeError, TypeError, IndexError) as exc:
                msg = f"cannot compute the clone prompt of {recording!r}: {exc}"
                raise EngineError(msg) from exc
            log.info(
                "clone_prompt_computed",
                path=recording,
                icl=codes,
                seconds=round(audio.shape[0] / loaded.info.sample_rate, 2),
                ms=round((time.perf_counter() - started) * 1000, 1),
            )
            return MlxClonePrompt(speaker, ref_codes, audio)

        try:
            return loaded.clones.get(path, with_codes, compute, lambda p: self._read_reference(loaded, p))
        except OSError as exc:
            msg = f"cannot read reference audio {path!r}: {exc}"
            raise EngineError(msg) from exc

    @staticmethod
    def _read_reference(loaded: _Loaded, path: str) -> Any:
        """The recording as mlx-audio's ``generate`` loads a path: resampled to the model's rate, mono."""
        from mlx_audio.utils import load_audio

        try:
            return load_audio(path, sample_rate=loaded.info.sample_rate)
        except Exception as exc:  # miniaudio's DecodeError is a bare Exception; any failure here is the file's
            msg = f"cannot read reference audio {path!r}: {exc}"
            raise EngineError(msg) from exc

    def _clone_folder(self) -> Path | None:
        """Where clone prompts are stored: the torch engine's folder (``voice_cache``, ``$S2S_VOICE_CACHE``)."""
        value = self._voice_cache or os.environ.get("S2S_VOICE_CACHE")
        if not value:
            return default_cache_dir()
        return None if value.lower() in ("off", "none", "false", "0") else Path(value).expanduser()

    @staticmethod
    def _budget(model: Any, text: str, cap: int | None) -> int:
        """Codec frames allowed: the torch engine's rule, so a missed end-of-speech ends soon."""
        tokens = len(model.tokenizer.encode(text))
        configured = int((model.generate_config or {}).get("max_new_tokens") or 2048)
        budget = min(configured, FRAMES_BASE + FRAMES_PER_TOKEN * tokens)
        return max(1, min(budget, cap)) if cap is not None else budget

    # -- loading --

    def _select_device(self, mx: Any) -> str:
        wanted = self._options.device
        metal = bool(mx.metal.is_available())
        if wanted in ("cpu",) or (wanted == "auto" and not metal):
            mx.set_default_device(mx.cpu)
            return "cpu"
        if wanted in ("auto", "metal", "gpu", "mps"):
            if not metal:
                msg = f"tts.mlx.device {wanted!r} needs Metal, which this machine does not have"
                raise EngineError(msg)
            mx.set_default_device(mx.gpu)
            return "metal"
        msg = f"tts.mlx.device: the mlx engine runs on 'cpu' or 'metal', not {wanted!r}"
        raise EngineError(msg)

    def _fetch(self, source: MlxSource) -> Path:
        if source.local:
            return Path(source.location)
        from huggingface_hub import constants
        from mlx_audio.utils import get_model_path

        try:
            return Path(get_model_path(source.location, revision=self._options.revision))
        except Exception as exc:  # hub errors come in many classes (OSError, ValueError, httpx's): sorted here
            cache = str(constants.HF_HUB_CACHE)
            offline = bool(constants.HF_HUB_OFFLINE)
            raise hub_failure(source.location, self._options.revision, exc, offline=offline, cache=cache) from exc

    def _load_model(self, folder: Path) -> Any:
        from mlx_audio.tts.utils import load_model
        from transformers.utils import logging as hf_logging

        # mlx-audio reports progress and swallowed errors with print(); keep stdout
        # clean for the CLI and turn the text into a log event. Its AutoTokenizer call
        # makes transformers warn about the unknown qwen3_tts config: quiet it meanwhile.
        captured = io.StringIO()
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity(logging.ERROR)
        try:
            with contextlib.redirect_stdout(captured):
                model = load_model(folder, lazy=True, strict=True)
        except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
            msg = f"cannot load {folder} with mlx-audio: {exc}"
            raise CheckpointError(msg) from exc
        finally:
            hf_logging.set_verbosity(verbosity)
            if captured.getvalue().strip():
                log.debug("mlx_audio_output", text=captured.getvalue().strip())
        if getattr(model, "model_type", None) != "qwen3_tts":
            msg = f"{folder} is not a Qwen3-TTS checkpoint"
            raise CheckpointError(msg)
        if model.tokenizer is None or model.speech_tokenizer is None:
            missing = "text tokenizer" if model.tokenizer is None else "speech tokenizer"
            msg = f"{folder}: the {missing} did not load ({captured.getvalue().strip()[-300:]})"
            raise CheckpointError(msg)
        return model

    def _require(self) -> _Loaded:
        self._check_thread()
        if self._loaded is None:
            msg = "the mlx engine is not loaded; call load_blocking first"
            raise EngineError(msg)
        return self._loaded

    def _check_thread(self) -> None:
        if self._thread is not None and threading.get_ident() != self._thread:
            msg = "MLX work must stay on the engine thread that loaded the model"
            raise EngineError(msg)


def _read_config(folder: Path) -> dict[str, Any]:
    for needed in ("config.json", "speech_tokenizer/config.json"):
        if not (folder / needed).is_file():
            msg = f"{folder} is not a complete Qwen3-TTS checkpoint: {needed} is missing"
            raise CheckpointError(msg)
    if not any(folder.glob("*.safetensors")):
        msg = f"{folder} has no *.safetensors weights"
        raise CheckpointError(msg)
    try:
        config: dict[str, Any] = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        msg = f"{folder}/config.json cannot be read: {exc}"
        raise CheckpointError(msg) from exc
    if config.get("model_type") != "qwen3_tts":
        msg = f"{folder} is a {config.get('model_type')!r} checkpoint, not qwen3_tts"
        raise CheckpointError(msg)
    return config


def _quantize_at_load(model: Any, quantization: str) -> str:
    """Cast the talker to bfloat16 and quantize its linear layers; returns the dtype label.

    Like mlx-audio's own conversion: embeddings, the speaker encoder and the speech
    tokenizer stay as stored, and layers whose input width does not divide the
    group size stay in bfloat16.
    """
    import mlx.core as mx
    from mlx.nn.layers.quantized import quantize

    if quantization == FLOAT32:
        model.talker.set_dtype(mx.float32)
        return "float32"
    model.talker.set_dtype(mx.bfloat16)
    bits = QUANTIZATIONS[quantization]
    if bits is None:
        return "bfloat16"
    wanted: Callable[[str, Any], bool] = model.model_quant_predicate

    def predicate(path: str, module: Any) -> bool:
        weight = getattr(module, "weight", None)
        return (
            hasattr(module, "to_quantized")
            and weight is not None
            and weight.shape[-1] % QUANT_GROUP_SIZE == 0
            and bool(wanted(path, module))
        )

    quantize(model.talker, group_size=QUANT_GROUP_SIZE, bits=bits, class_predicate=predicate)
    return quantization


def _clone_model_key(folder: Path, dtype: str, device: str) -> str:
    """The model (its folder and weight files as they are now), quantization, device and mlx-audio of a prompt."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mlx_audio_version = version("mlx-audio")
    except PackageNotFoundError:
        mlx_audio_version = "?"
    stamps = ["mlx", mlx_audio_version, str(folder.resolve()), dtype, device]
    for weights in (*sorted(folder.glob("*.safetensors")), *sorted(folder.glob("speech_tokenizer/*.safetensors"))):
        st = weights.stat()
        stamps.append(f"{weights.name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(stamps)


def _talker_dtype(model: Any) -> str:
    """The dtype of an unquantized talker, named as ``EngineInfo.dtype`` names it."""
    return str(model.talker.codec_head.weight.dtype).removeprefix("mlx.core.")


ENGINE = EngineSpec(
    engine=MlxQwen3Engine,  # this module imports mlx only inside the engine's methods
    install="s2s-daemon[mlx]",
    requires=("mlx", "mlx_audio"),
    section=MlxSection,
    options=MlxOptions,
)
"""The mlx engine, as ``pyproject.toml``'s ``s2s_daemon.engines`` entry point ``mlx`` names it."""
