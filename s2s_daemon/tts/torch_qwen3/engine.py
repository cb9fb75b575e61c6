"""``TorchQwen3Engine``: the project's own streaming Qwen3-TTS 12 Hz in plain torch.

Load: resolve the checkpoint, parse its configs and load the text tokenizer first, so a wrong
``tts.model`` fails before anything slow; then the native CPU kernels (built at install), the
talker (built on the meta device, then assigned its weights) and the codec decoder (and encoders
for Base models). Synthesize: build the official prompt, run the frame loop, and every
``chunk_frames`` frames push the new codes through the streaming codec decoder.

The frame budget (``frame_budget``) ends a missed end-of-speech: 2.4 s plus 0.64 s of audio per
text token, two to three times what real speech spends. ``EngineOptions.extra`` tunes the rest
(``max_frames``, ``first_chunk_frames``, ``prefix_cache_rows``, ``codec_overlap``,
``codec_dtype``, ``voice_cache``; docs/configuration.md lists them).
"""

from __future__ import annotations

import hashlib
import os
import time
import wave
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from s2s_daemon.pipeline.voices import default_cache_dir
from s2s_daemon.tts.engine import (
    CheckpointError,
    DeviceMemory,
    EngineError,
    EngineInfo,
    EngineOptions,
    Samples,
    ShouldStop,
    SynthesisRequest,
    UnknownVoiceError,
)
from s2s_daemon.tts.threads import ThreadPolicy
from s2s_daemon.tts.torch_qwen3 import memory
from s2s_daemon.tts.torch_qwen3.checkpoint import load_weights, resolve_checkpoint
from s2s_daemon.tts.torch_qwen3.clone_cache import ClonePrompt, ClonePromptCache
from s2s_daemon.tts.torch_qwen3.config import (
    GenerationSettings,
    ModelConfig,
    load_generation_settings,
    load_model_config,
)
from s2s_daemon.tts.torch_qwen3.device import pick_device
from s2s_daemon.tts.torch_qwen3.formats import choose_format
from s2s_daemon.tts.torch_qwen3.layers import fuse_projections, matvec_layout, no_weight_init, small_batch_linears
from s2s_daemon.tts.torch_qwen3.options import TorchOptions
from s2s_daemon.tts.torch_qwen3.overlap import ChunkQueue, CodecWorker, set_threads
from s2s_daemon.tts.torch_qwen3.prompt import PromptEmbeddings, PromptTokens, build_embeddings, codec_prefix, tokenize
from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions, PrefixCache, Sequence, TalkerRuntime
from s2s_daemon.tts.torch_qwen3.talker import Qwen3TtsWeights, rows_by_reads, rows_in

log = structlog.get_logger(__name__)

FRAMES_BASE = 30
MAX_BATCH = 4
"""Requests decoded together on the native kernels: their decoding kernels take up to 4 rows."""
FIRST_CHUNK_FRAMES = 1
"""Frames of an utterance's first chunk (``extra['first_chunk_frames']``; later chunks are
``chunk_frames``): one frame brings the first audio sooner (``scripts/bench_torch.py`` measures
it); the codec decoder is exact in any chunking (the bfloat16 one within its quality guard), so
the audio is the same."""
FRAMES_PER_TOKEN = 8
SAMPLE_RATE = 24000
REF_STREAMS = 4
"""References (ICL cloning) whose decoded codec state is kept: the decoder needs a reference's frames
as left context before a request's own; a request with a kept reference continues from a copy
(a few MB), and its first chunk comes several times sooner than with the reference decoded again
(``scripts/bench_ref_stream.py`` measures it). Oldest dropped first."""


def frame_budget(text_tokens: int, max_new_tokens: int, cap: int | None = None) -> int:
    """Codec frames allowed for an utterance of ``text_tokens`` tokens (see the module docstring)."""
    budget = min(max_new_tokens, FRAMES_BASE + FRAMES_PER_TOKEN * max(0, text_tokens))
    return min(budget, cap) if cap is not None else budget


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere (``formats.choose_format`` says why)."""
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[requested.lower()]
    except KeyError:
        raise EngineError(f"dtype {requested!r} is not one of auto, {', '.join(_DTYPES)}") from None


def read_wav_24k(path: str) -> np.ndarray:
    """A PCM WAV file as mono float32 at 24 kHz (resampled with soxr when needed)."""
    try:
        with wave.open(path, "rb") as wf:
            rate, channels, width = wf.getframerate(), wf.getnchannels(), wf.getsampwidth()
            raw = wf.readframes(wf.getnframes())
    except (OSError, wave.Error, EOFError) as exc:
        raise EngineError(f"cannot read reference audio {path!r}: {exc}") from exc
    if width == 2:
        audio = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 4:
        audio = np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2147483648.0
    elif width == 1:
        audio = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    else:
        raise EngineError(f"reference audio {path!r}: {8 * width}-bit samples are not supported")
    audio = audio.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE:
        try:
            import soxr
        except ImportError as exc:
            raise EngineError(f"reference audio is {rate} Hz; resampling needs soxr (the audio extra)") from exc
        audio = soxr.resample(audio, rate, SAMPLE_RATE).astype(np.float32)
    return np.ascontiguousarray(audio, dtype=np.float32)


class TorchQwen3Engine:
    """The torch backend of ``TtsEngine``; every ``_blocking`` method runs on the engine thread."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.cfg: ModelConfig | None = None
        self.gen: GenerationSettings | None = None
        self.runtime: TalkerRuntime | None = None
        self.tokenizer: Any = None
        self.codec: Any = None
        self.speech_encoder: Any = None
        self.speaker_encoder: Any = None
        self.clone_prompts: ClonePromptCache | None = None
        """Speaker embeddings and reference codes already computed (Base models)."""
        self.ref_streams: OrderedDict[tuple[tuple[int, ...], bytes], Any] = OrderedDict()
        """Codec streams that decoded a reference's frames (``REF_STREAMS``), by the frames' shape and digest."""
        self.codec_worker: CodecWorker | None = None
        """The codec's own thread (``extra['codec_overlap']``, ``overlap.py``); None: decoded in line."""
        self._overlap = "off"
        """``_overlap_mode()`` where ``codec_worker`` is set: ``on`` or ``auto``."""
        self.folder: Path | None = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.info: EngineInfo | None = None
        self.threads: ThreadPolicy | None = None
        """The CPU's intra-op threads (None on an accelerator); adjusted between frames."""

    # -- options --------------------------------------------------------------------------
    def _opts(self) -> TorchOptions:
        """``tts.options`` typed (``options.py``); read at each use, so that a benchmark may change
        ``options.extra`` between requests. ``ConfigError`` naming a wrong key."""
        return TorchOptions.read(self.options.extra)

    def _overlap_mode(self) -> str:
        """``codec_overlap``: ``auto`` (the default: the codec on its own thread for an utterance
        that starts with two threads or more, in line when the engine runs one, as beside a busy
        process), ``on`` (always) or ``off``."""
        return self._opts().codec_overlap

    def _threads_now(self) -> int:
        """The engine thread's intra-op threads in force (``ThreadPolicy``'s count on the CPU)."""
        return self.threads.threads if self.threads is not None else torch.get_num_threads()

    def _text_streaming(self, mode: str) -> bool:
        """Official defaults: text fed step by step only for Base; ``extra['text_streaming']`` overrides."""
        value = self._opts().text_streaming
        return mode == "base" if value is None else value

    # -- protocol -------------------------------------------------------------------------
    def load_blocking(self) -> EngineInfo:
        with memory.loading():
            return self._load()

    def _load(self) -> EngineInfo:
        started = time.perf_counter()
        device = pick_device(self.options.device)
        self._start_threads(device)
        quantization, kernels = self._kernel_options(device)
        overlap = self._overlap_mode()
        # The checkpoint is found and its configs and tokenizer read before the native kernels are
        # loaded and the weights packed: a wrong tts.model fails in seconds.
        folder = resolve_checkpoint(self.options.model, self.options.revision)
        cfg = load_model_config(folder)
        gen = load_generation_settings(folder)
        tokenizer = self._load_tokenizer(folder)
        log.info("checkpoint_read", folder=str(folder), mode=cfg.mode, read_s=round(time.perf_counter() - started, 2))
        choice = choose_format(device.type, self.options.dtype, quantization, kernels, self._native_reason)
        dtype = pick_dtype(choice.dtype, device)
        dtype, weight_format, ext = self._weight_format(device, dtype, choice.quantization, kernels)
        log.info(
            "engine_format",
            device=device.type,
            weights=weight_format,
            activations=str(dtype).removeprefix("torch."),
            kernels="native" if ext is not None else "torch",
            chosen="auto" if choice.auto else "configured",
            reason=choice.reason,
            **({"isa": ext.isa, "isa_reason": ext.isa_reason} if ext is not None else {}),
        )
        weights, self.codec = self._load_weights(cfg, folder, device, dtype, weight_format, ext)
        if cfg.mode == "base":
            self._load_clone_encoders(folder, device, dtype)
        runtime = TalkerRuntime(weights, cfg, device, dtype)
        runtime.kernels = ext  # the native kernels: on the CPU only (_weight_format)
        prefix_rows = self._opts().prefix_cache_rows
        if prefix_rows is not None:
            runtime.prefixes = PrefixCache(prefix_rows) if prefix_rows > 0 else None
        if device.type == "cuda" and self._opts().cuda_graphs:
            from s2s_daemon.tts.torch_qwen3.graphs import CudaGraphSteps

            runtime.graphs = CudaGraphSteps()
        policy = self.threads
        ceiling = (policy.fixed or policy.default) if policy is not None else torch.get_num_threads()
        if device.type == "cpu" and (overlap == "on" or (overlap == "auto" and ceiling >= 2)):
            self.codec_worker = CodecWorker(threads=max(1, ceiling // 2))
            self._overlap = overlap
        log.info("codec_overlap", mode=overlap, worker=self.codec_worker is not None,
                 codec_threads=self.codec_worker.threads if self.codec_worker is not None else None)  # fmt: skip
        self.cfg, self.gen, self.runtime, self.tokenizer = cfg, gen, runtime, tokenizer
        self.folder, self.device, self.dtype = folder, device, dtype
        self.info = EngineInfo(
            engine="torch",
            model=self.options.model,
            device=str(device) if device.type != "cuda" else f"cuda:{device.index or 0}",
            sample_rate=int(getattr(self.codec, "sample_rate", SAMPLE_RATE)),
            voices=cfg.voices,
            languages=cfg.languages,
            dtype=weight_format,
            mode=cfg.mode,
            format_reason=choice.reason,
            isa=f"{ext.isa} ({ext.isa_reason})" if ext is not None else "",
        )
        log.info(
            "torch_engine_loaded",
            model=self.options.model,
            folder=str(folder),
            mode=cfg.mode,
            device=self.info.device,
            dtype=self.info.dtype,
            kernels="native" if ext is not None else "torch",
            voices=len(cfg.voices),
            load_s=round(time.perf_counter() - started, 2),
        )
        return self.info

    def _load_weights(
        self, cfg: ModelConfig, folder: Path, device: torch.device, dtype: torch.dtype, weight_format: str, ext: Any
    ) -> tuple[Qwen3TtsWeights, Any]:
        """(talker weights, codec decoder)."""
        if ext is not None:
            # Native kernels: the talker prepared linear by linear from the checkpoint (never a
            # float32 copy of the model) or mapped from the prepared-weights cache (prepared.py).
            from s2s_daemon.tts.torch_qwen3.prepared import load_talker

            weights = load_talker(cfg, folder, weight_format, ext, dtype, self._opts().prepared_cache)
        else:
            weights = self._load_torch_talker(cfg, folder, device, dtype, weight_format)
        return weights, self._load_codec(folder, device, dtype, ext)

    def _load_torch_talker(
        self, cfg: ModelConfig, folder: Path, device: torch.device, dtype: torch.dtype, weight_format: str
    ) -> Qwen3TtsWeights:
        """The talker for torch's own kernels: float weights in ``dtype``, or FBGEMM int8 linears."""
        with no_weight_init(), torch.device("meta"):
            weights = Qwen3TtsWeights(cfg.talker)
        files = load_weights(weights, folder, device, dtype)
        weights.eval()
        weights.requires_grad_(False)
        rows_in(weights, dtype)
        rows_by_reads(weights, files)
        fuse_projections(weights)
        if weight_format == "int8":
            from s2s_daemon.tts.torch_qwen3.quant import quantize_linears

            quantize_linears(weights.talker)
        else:
            matvec_layout(weights.talker)
            small_batch_linears(weights.talker)
        return weights

    def _load_tokenizer(self, folder: Path) -> Any:
        """The text tokenizer (``text_tokenizer.py``: ``tokenizer.json`` without transformers for Qwen2)."""
        from s2s_daemon.tts.torch_qwen3.text_tokenizer import load_text_tokenizer

        try:
            return load_text_tokenizer(folder)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"text tokenizer in {folder} cannot be loaded: {exc}") from exc

    def _start_threads(self, device: torch.device) -> None:
        """The intra-op threads: ``tts.torch.threads`` (or ``extra['threads']``) fixes them; else,
        on the CPU, ``ThreadPolicy`` follows what the machine leaves free."""
        fixed = self._opts().threads or self.options.threads
        if device.type != "cpu":
            if fixed is not None and fixed > 0:
                torch.set_num_threads(fixed)  # process-wide: the intra-op pool is shared
            return
        fixed = fixed if fixed is not None and fixed > 0 else None
        self.threads = ThreadPolicy(fixed, torch.get_num_threads(), torch.set_num_threads)
        self.threads.start()

    def _native_reason(self) -> str | None:
        """Why the native kernels cannot run here (None: they can; loads the library)."""
        from s2s_daemon.tts.torch_qwen3 import native

        return None if self._native() is not None else native.unavailable_reason(self._isa()) or "unavailable"

    def _isa(self) -> str:
        return (self.options.isa or "auto").lower()

    def _native(self) -> Any:
        """The native kernels of ``tts.torch.isa``'s path, or None without the library; EngineError
        when the configured path cannot run (the library does not carry it)."""
        from s2s_daemon.tts.torch_qwen3 import native

        try:
            return native.load(self._isa())
        except ValueError as exc:
            raise EngineError(str(exc)) from exc

    def _kernel_options(self, device: torch.device) -> tuple[str, str]:
        """(quantization, kernels) from the options, checked before anything is read or built."""
        quantization = (self.options.quantization or "none").lower()
        if quantization not in ("auto", "int8", "int4", "none", ""):
            # The shared default (``6bit``) belongs to the MLX engine; torch knows none, int8 and int4.
            log.info("quantization_not_for_torch", quantization=quantization, used="none")
            quantization = "none"
        if quantization in ("int8", "int4") and device.type != "cpu":
            raise EngineError(f"{quantization} quantization is a CPU option; use bfloat16 on accelerators")
        kernels = (self.options.kernels or "auto").lower()
        if kernels not in ("auto", "native", "torch"):
            raise EngineError(f"kernels {kernels!r} is not one of auto, native, torch")
        return quantization, kernels

    def _weight_format(
        self, device: torch.device, dtype: torch.dtype, quantization: str, kernels: str
    ) -> tuple[torch.dtype, str, Any]:
        """(runtime dtype, talker weight format, native extension or None) from the checked options.

        On the CPU the native kernels (``tts.torch.kernels``) run every talker linear with float32
        activations and float32, bfloat16, int8 or int4 weights; without them int8 is torch's
        FBGEMM linear and other dtypes are plain torch.
        """
        quantized = quantization in ("int8", "int4")
        ext = None
        wanted = device.type == "cpu" and kernels != "torch" and (quantized or dtype != torch.float16)
        if wanted:
            from s2s_daemon.tts.torch_qwen3 import native

            ext = self._native()
            if ext is None:
                log.warning("native_kernels_unavailable", reason=native.unavailable_reason(self._isa()))
            if ext is None and (kernels == "native" or quantization == "int4"):
                need = "kernels: native" if kernels == "native" else "int4 quantization"
                raise EngineError(f"{need} needs the native CPU kernels: {native.unavailable_reason(self._isa())}")
        if quantization == "int4" and ext is None:
            raise EngineError("int4 quantization needs the native CPU kernels (tts.torch.kernels: auto or native)")
        if quantization == "int8" and ext is None:
            from s2s_daemon.tts.torch_qwen3.quant import int8_supported

            if not int8_supported():
                raise EngineError("this torch build has no quantized engine for int8 linears")
        if quantized:
            return torch.float32, quantization, ext
        fmt = str(dtype).removeprefix("torch.")
        # Native bfloat16 keeps float32 activations (and norms, embeddings) around bfloat16 weights.
        return (torch.float32 if ext is not None else dtype), fmt, ext

    def _load_codec(self, folder: Path, device: torch.device, dtype: torch.dtype, ext: Any = None) -> Any:
        try:
            from s2s_daemon.tts.torch_qwen3.codec import CodecDecoder
        except ImportError as exc:
            raise EngineError(f"the torch codec decoder is not available in this build: {exc}") from exc
        # The decoder runs in float32 on the CPU (its matrix weights in bfloat16 where codec.pick_codec_weights
        # says so, its upsampler's linears in int8 where codec.int8_upsampler does) and in the model dtype
        # (bf16) elsewhere.
        codec_dtype = torch.float32 if device.type == "cpu" else dtype
        weights = codec_dtype
        int8 = False
        if device.type == "cpu":
            from s2s_daemon.tts.torch_qwen3.codec import int8_upsampler, pick_codec_weights

            requested = self._opts().codec_dtype
            try:
                weights, why = pick_codec_weights(requested, ext)
            except ValueError as exc:
                raise EngineError(str(exc)) from exc
            int8 = int8_upsampler(requested, ext)
            log.info(
                "codec_weights_chosen", dtype=str(weights).removeprefix("torch."), reason=why, int8_upsampler=int8
            )  # fmt: skip
        codec = CodecDecoder.from_folder(folder / "speech_tokenizer", device, codec_dtype, weights)
        if ext is not None:
            codec.prepare_native(ext, int8)
            # Not codec.pack_onednn(): oneDNN lays a packed weight out for the threads in force when
            # it packs, and a push with another count (the codec's own thread beside the talker, one
            # thread on a busy machine) lays it out again on every call, slower than from the plain
            # layout (scripts/bench_codec.py --pack-threads; docs/internals.md).
        small_batch_linears(codec)
        return codec

    def _load_clone_encoders(self, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
        try:
            from s2s_daemon.tts.torch_qwen3.codec_encoder import SpeechEncoder
            from s2s_daemon.tts.torch_qwen3.speaker_encoder import SpeakerEncoder
        except ImportError as exc:
            log.warning("voice_clone_unavailable", reason=str(exc))
            return
        enc_dtype = torch.float32 if device.type == "cpu" else dtype
        self.speech_encoder = SpeechEncoder.from_folder(folder / "speech_tokenizer", device, enc_dtype)
        self.speaker_encoder = SpeakerEncoder.from_folder(folder, device, enc_dtype)
        self.clone_prompts = ClonePromptCache(
            self._clone_model_key(folder, device, enc_dtype), self._clone_folder(), device
        )

    @staticmethod
    def _clone_model_key(folder: Path, device: torch.device, dtype: torch.dtype) -> str:
        """The model (its folder and the encoders' weight files as they are now) and dtype of a clone prompt."""
        stamps = [str(folder.resolve()), device.type, str(dtype)]
        for weights in (folder / "model.safetensors", folder / "speech_tokenizer" / "model.safetensors"):
            st = weights.stat() if weights.is_file() else None
            stamps.append(f"{st.st_size}:{st.st_mtime_ns}" if st is not None else "-")
        return "|".join(stamps)

    def _clone_folder(self) -> Path | None:
        value = self._opts().voice_cache or os.environ.get("S2S_VOICE_CACHE")
        if value is None or value == "":
            return default_cache_dir()
        return None if value.lower() in ("off", "none", "false", "0") else Path(value)

    def _compute_clone_prompt(self, path: str, with_codes: bool) -> ClonePrompt:
        """Run the speaker encoder (and, for ICL, the codec encoder) on the recording at ``path``."""
        if self.speaker_encoder is None:
            raise EngineError("voice cloning needs the speaker encoder, which is not available in this build")
        if with_codes and self.speech_encoder is None:
            raise EngineError("ICL cloning needs the codec encoder, which is not available in this build")
        wav = torch.from_numpy(read_wav_24k(path)).to(self.device)
        speaker = self.speaker_encoder.embed(wav)
        codes = self.speech_encoder.encode(wav).to(torch.long) if with_codes else None
        return ClonePrompt(speaker, codes)

    def warmup_blocking(self) -> None:
        info = self._require()
        request = SynthesisRequest(
            text="Hello.",
            voice=info.voices[0] if info.voices else None,
            language="auto",
            instruct="warm" if info.mode == "voice_design" else None,
            chunk_frames=2,
            greedy=True,
        )
        for _ in self._synthesize(request, lambda: False, max_frames=2):
            pass

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[Samples]:
        self._require()
        return self._synthesize(request, should_stop, max_frames=None)

    def memory_blocking(self) -> DeviceMemory:
        if self.device.type == "cuda":
            mib = 1024.0 * 1024.0
            return DeviceMemory(
                "cuda",
                torch.cuda.memory_allocated(self.device) / mib,
                torch.cuda.max_memory_allocated(self.device) / mib,
            )
        if self.device.type == "mps":
            return DeviceMemory("mps", torch.mps.current_allocated_memory() / (1024.0 * 1024.0), 0.0)
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        if self.threads is not None:
            self.threads.stop()
        if self.codec_worker is not None:
            self.codec_worker.close()
            self.codec_worker = None
        self.runtime = None
        self.codec = None
        self.speech_encoder = None
        self.speaker_encoder = None
        self.clone_prompts = None
        self.ref_streams.clear()
        self.tokenizer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("torch_engine_closed", model=self.options.model)

    # -- synthesis ------------------------------------------------------------------------
    def _require(self) -> EngineInfo:
        if self.info is None or self.runtime is None:
            raise EngineError("engine is not loaded")
        return self.info

    def prepare(
        self, request: SynthesisRequest, text_streaming: bool | None = None
    ) -> tuple[PromptEmbeddings, PromptTokens, torch.Tensor | None, int]:
        """Validate and build the prompt: (embeddings, tokens, reference codes or None, frame budget).

        ``text_streaming`` overrides the per-mode default (see ``_text_streaming``).
        """
        cfg, gen, runtime = self.cfg, self.gen, self.runtime
        assert cfg is not None and gen is not None and runtime is not None
        speaker: int | torch.Tensor | None = None
        voice = request.voice
        instruct = request.instruct or None
        if cfg.mode == "custom_voice":
            if voice is None:
                voice = cfg.voices[0] if cfg.voices else None
            if voice is None or voice.strip().lower() not in cfg.talker.speaker_ids:
                raise UnknownVoiceError(f"voice {voice!r} is unknown; choose one of {', '.join(cfg.voices)}")
            speaker = cfg.talker.speaker_ids[voice.strip().lower()]
            if cfg.model_size == "0b6" and instruct:
                log.info("instruct_ignored", reason="0.6B CustomVoice models take no instruction")
                instruct = None
        elif voice:
            raise UnknownVoiceError(f"voice {voice!r}: this {cfg.mode} model has no preset voices")
        if cfg.mode == "base":
            instruct = None
        prefix = codec_prefix(cfg, request.language, voice if cfg.mode == "custom_voice" else None)
        ref_codes: torch.Tensor | None = None
        reference_text: str | None = None
        if cfg.mode == "base" and request.ref_audio:
            if self.clone_prompts is None:
                raise EngineError("voice cloning needs the speaker encoder, which is not available in this build")
            try:
                clone = self.clone_prompts.get(request.ref_audio, bool(request.ref_text), self._compute_clone_prompt)
            except OSError as exc:
                raise EngineError(f"cannot read reference audio {request.ref_audio!r}: {exc}") from exc
            speaker = clone.speaker
            if request.ref_text:
                ref_codes = clone.ref_codes
                reference_text = request.ref_text
        tokens = tokenize(self.tokenizer, request.text, instruct, reference_text)
        prompt = build_embeddings(
            runtime.talker,
            cfg,
            tokens,
            prefix,
            speaker,
            ref_codes.to(self.device) if ref_codes is not None else None,
            non_streaming=not (self._text_streaming(cfg.mode) if text_streaming is None else text_streaming),
        )
        budget = frame_budget(tokens.content_len, gen.max_new_tokens, self._opts().max_frames)
        return prompt, tokens, ref_codes, budget

    def codes_blocking(
        self, request: SynthesisRequest, max_frames: int | None = None, text_streaming: bool | None = None
    ) -> torch.Tensor:
        """All codec frames ``[T, G]`` (CPU, long) for a request; used by the parity tests and the benchmark."""
        self._require()
        assert self.runtime is not None and self.gen is not None
        self._share_cores()
        with torch.inference_mode():
            prompt, _, _, budget = self.prepare(request, text_streaming)
            if max_frames is not None:
                budget = max_frames
            options = DecodeOptions(max_frames=budget, greedy=request.greedy, seed=request.seed)
            rows = [row.clone() for row in self.runtime.frames(prompt, self.gen, options, lambda: False)]
        if not rows:
            return torch.zeros(0, self.runtime.groups, dtype=torch.long)
        return torch.stack(rows).cpu()

    def _synthesize(
        self, request: SynthesisRequest, should_stop: ShouldStop, max_frames: int | None
    ) -> Iterator[Samples]:
        synthesis = self._open(request, should_stop, max_frames, batched=False)
        while not synthesis.done:
            self.step_blocking([synthesis])
            yield from synthesis.take()

    # -- several requests together (tts/scheduler.py's batch) ------------------------------------
    @property
    def max_batch(self) -> int:
        """Requests the worker may decode together, a frame at a time (``open_blocking``,
        ``step_blocking``): 4 where the native kernels run the rows of a step in one pass of the
        weights; 1 elsewhere (CUDA graphs and torch's kernels gain nothing from it yet), where the
        worker interleaves requests instead. ``extra['max_batch']`` overrides it."""
        wanted = self._opts().max_batch
        if wanted is not None:
            return max(1, wanted)
        runtime = self.runtime
        if runtime is None or runtime.graphs is not None or runtime.talker.model.native is None:
            return 1
        return MAX_BATCH

    def open_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Synthesis:
        """Validate and prefill ``request`` for ``step_blocking`` (raises what ``synthesize_blocking`` would)."""
        self._require()
        return self._open(request, should_stop, None, batched=True)

    @torch.inference_mode()
    def step_blocking(self, batch: list[Synthesis]) -> None:
        """One frame of every unfinished synthesis in ``batch``, the batched ones in one step; each
        keeps the chunks it completed for ``Synthesis.take``."""
        runtime, gen = self.runtime, self.gen
        assert runtime is not None and gen is not None
        if self.threads is not None:
            self.threads.adjust()
        self._share_cores()
        for synthesis in batch:
            if synthesis.sequence is not None and not synthesis.done and synthesis.should_stop():
                synthesis.stop()
        together = [(s, s.sequence) for s in batch if s.sequence is not None and not s.done]
        if together:
            rows = runtime.step_batch([sequence for _, sequence in together], gen)
            for (synthesis, _), row in zip(together, rows, strict=True):
                synthesis.add(row)
        for synthesis in batch:
            if synthesis.rows is not None and not synthesis.done:
                synthesis.add(next(synthesis.rows, None))

    def _share_cores(self) -> None:
        """With the codec on its own thread: this thread's intra-op threads for its next step, the
        cores a running codec push leaves, or all of them."""
        if self.codec_worker is not None:
            set_threads(self.codec_worker.talker_threads(self._threads_now()))

    @torch.inference_mode()
    def _open(
        self, request: SynthesisRequest, should_stop: ShouldStop, max_frames: int | None, batched: bool
    ) -> Synthesis:
        runtime, gen = self.runtime, self.gen
        assert runtime is not None and gen is not None
        if self.threads is not None:
            self.threads.adjust()
        self._share_cores()
        prompt, _, ref_codes, budget = self.prepare(request)
        if max_frames is not None:
            budget = min(budget, max_frames)
        chunk = max(1, int(request.chunk_frames))
        # A one-frame first chunk gets the first sound out sooner; later chunks are full size.
        first = max(1, min(chunk, self._opts().first_chunk_frames or FIRST_CHUNK_FRAMES))
        stream = self._codec_stream(ref_codes)
        options = DecodeOptions(max_frames=budget, greedy=request.greedy, seed=request.seed)
        worker = self.codec_worker
        if worker is not None and self._overlap == "auto" and self._threads_now() < 2:
            worker = None  # one thread in force (a busy neighbour): a second would take from the talker
        synthesis = Synthesis(stream, first, chunk, budget, should_stop, worker)
        if batched:
            if not should_stop():
                synthesis.sequence = runtime.start(prompt, options)
            else:
                synthesis.stop()
        else:
            synthesis.rows = iter(runtime.frames(prompt, gen, options, should_stop))
        return synthesis

    def _codec_stream(self, ref_codes: torch.Tensor | None) -> Any:
        """A codec stream for a request: fresh, or one that decoded the reference's frames (the
        decoder's left context; that audio is not played), from ``ref_streams`` when kept."""
        if ref_codes is None or ref_codes.shape[0] == 0:
            return self.codec.stream()
        frames = ref_codes.to(device="cpu", dtype=torch.long).contiguous()
        digest = (tuple(frames.shape), hashlib.blake2b(frames.numpy().tobytes(), digest_size=16).digest())
        kept = self.ref_streams.get(digest)
        if kept is None:
            kept = self.codec.stream()
            kept.push(ref_codes.to(self.device))
            self.ref_streams[digest] = kept
            while len(self.ref_streams) > REF_STREAMS:
                self.ref_streams.popitem(last=False)
        else:
            self.ref_streams.move_to_end(digest)
        return kept.copy()


class Synthesis:
    """One request's frames in, its audio chunks out: ``first`` frames, then ``chunk`` at a time.

    Made by ``TorchQwen3Engine`` and advanced by its ``step_blocking``: in a batch (``sequence``,
    stepped with others by ``TalkerRuntime.step_batch``) or alone (``rows``, ``TalkerRuntime.frames``).
    Chunks are decoded in line, or on ``worker``'s thread while the next frames are made (``overlap.py``).
    """

    def __init__(
        self, stream: Any, first: int, chunk: int, budget: int, should_stop: ShouldStop,
        worker: CodecWorker | None = None,
    ) -> None:  # fmt: skip
        self.codec = stream
        self.chunks = ChunkQueue(_decode, stream, worker)
        self.first = first
        self.chunk = chunk
        self.budget = budget
        self.should_stop = should_stop
        self.sequence: Sequence | None = None
        self.rows: Iterator[torch.Tensor] | None = None
        self.done = False
        self._pending: list[torch.Tensor] = []
        self._made: list[Samples] = []
        self._frames = 0
        self._pushed = False
        """A chunk was pushed (later chunks are ``chunk`` frames)."""
        self._started = time.perf_counter()
        self._first_chunk_s: float | None = None

    def take(self) -> list[Samples]:
        """The chunks completed since the last call."""
        if not self.done:
            self._collect(self.chunks.ready())
        made, self._made = self._made, []
        return made

    def stop(self) -> None:
        """Asked to stop: no more frames, nothing more handed out."""
        self.done = True
        self._pending = []
        self.chunks.discard()

    def _collect(self, audio: list[Samples]) -> None:
        """Decoded chunks handed out in order, unless asked to stop meanwhile."""
        if not audio:
            return
        if self._first_chunk_s is None:
            self._first_chunk_s = time.perf_counter() - self._started
        if self.should_stop():
            self.stop()
            return
        self._made.extend(audio)

    def add(self, row: torch.Tensor | None) -> None:
        """One more frame (``[G]`` codes), or None: the end (end of speech, the budget or a stop)."""
        if self.done:
            return
        if row is None:
            self._end()
            return
        self._pending.append(row)
        self._frames += 1
        if len(self._pending) < (self.chunk if self._pushed else self.first):
            if self.sequence is not None and self.sequence.done:
                self._end()
            return
        self.chunks.push(self._pending, inline=not self._pushed)  # the first chunk as soon as it can be
        self._pushed = True
        self._pending = []
        self._collect(self.chunks.ready())
        if self.done:
            return
        if self.sequence is not None and self.sequence.done:
            self._end()

    def _end(self) -> None:
        if self.should_stop():
            self.stop()
            return
        if self._pending:
            self.chunks.push(self._pending)
            self._pending = []
        self._collect(self.chunks.drain())
        if self.done:  # stopped while the last chunks were decoded
            return
        self.done = True
        tail = self.codec.flush()
        if tail is not None and tail.numel() > 0:
            self._made.append(tail.detach().float().cpu().numpy().astype(np.float32, copy=False))
        elapsed = time.perf_counter() - self._started
        first = self._first_chunk_s
        log.info(
            "torch_synthesis_done",
            frames=self._frames,
            budget=self.budget,
            first_chunk_ms=round(1000 * first, 1) if first is not None else None,
            frames_per_s=round(self._frames / elapsed, 2) if elapsed > 0 else None,
        )


def _decode(stream: Any, rows: list[torch.Tensor]) -> Samples:
    audio = stream.push(torch.stack(rows))
    return np.ascontiguousarray(audio.detach().float().cpu().numpy(), dtype=np.float32)
