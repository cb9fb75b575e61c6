"""The MLX engine (mlx-audio's Qwen3-TTS) on the committed tiny random checkpoints, on the CPU.

The pure-python parts (source mapping, chunk mapping, option checks) need no weights;
everything that loads weights is marked ``mlx``. Random weights almost never produce
the end-of-speech code, so every engine here is capped with ``extra['max_frames']``.
On this CPU the tiny codec decoder costs about a second per frame (MLX's CPU backend
runs dilated and strided transposed convolutions slowly), so the tests speak few frames.

The cross-checks against the torch engine (marked ``torch`` as well) compare, on the
same checkpoint with its codec stored in float32 (as in the released checkpoints):
decoder waveforms for the same codes, the talker prompt and its logits, and greedy
codes over the first ``GREEDY_FRAMES_AGREE`` frames.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from s2s_daemon.errors import ConfigError
from s2s_daemon.tts.engine import (
    CheckpointError,
    EngineError,
    EngineOptions,
    ModelUnavailableError,
    SynthesisRequest,
    TtsEngine,
    UnknownVoiceError,
    UnsupportedLanguageError,
)
from s2s_daemon.tts.mlx_qwen3 import (
    FRAME_RATE_HZ,
    MlxQwen3Engine,
    chunk_interval_s,
    display_voice,
    resolve_source,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "fixtures" / "qwen3_tiny"
REF_WAV = TINY / "golden" / "ref_espeak_24k.wav"
MAX_FRAMES = 3
"""Codec frames per test utterance (0.24 s of audio)."""
SAMPLES_PER_FRAME = 1920
"""24 kHz / 12.5 Hz."""
GREEDY_FRAMES_AGREE = 8
"""Greedy frames (16 codes each) the two engines must agree on; see the cross-check test."""
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


# --- pure python: no weights ---


def test_qwen_ids_map_to_the_mlx_community_repo_of_the_quantization() -> None:
    for quant in ("4bit", "6bit", "8bit", "bf16"):
        source = resolve_source("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", quant)
        assert source.location == f"mlx-community/Qwen3-TTS-12Hz-0.6B-CustomVoice-{quant}"
        assert not source.local
        assert source.as_stored
    assert resolve_source("Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign", "6bit").location == (
        "mlx-community/Qwen3-TTS-12Hz-1.7B-VoiceDesign-6bit"
    )
    # An mlx-community id, or any other repo, is taken as written.
    named = "mlx-community/Qwen3-TTS-12Hz-0.6B-Base-8bit"
    assert resolve_source(named, "4bit") == resolve_source(named, "bf16")
    assert resolve_source(named, "4bit").location == named
    assert resolve_source(named, "4bit").as_stored
    # Any other repo is expected in the official layout and is quantized at load.
    other = resolve_source("someone/qwen3-tts-finetune", "4bit")
    assert other.location == "someone/qwen3-tts-finetune"
    assert not other.as_stored


def test_a_local_folder_loads_as_it_is_and_a_missing_one_is_a_checkpoint_error(tmp_path: Path) -> None:
    source = resolve_source(str(tmp_path), "4bit")
    assert source.local
    assert not source.as_stored
    assert source.location == str(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_source(str(tmp_path / "missing"), "4bit")
    with pytest.raises(CheckpointError):
        resolve_source("./no/such/folder", "4bit")


@pytest.mark.parametrize("frames", range(1, 41))
def test_chunk_frames_map_exactly_onto_mlx_audio_streaming_interval(frames: int) -> None:
    # mlx-audio: streaming_chunk_size = max(1, int(streaming_interval * 12.5))
    assert max(1, int(chunk_interval_s(frames) * FRAME_RATE_HZ)) == frames


def test_voice_keys_are_shown_as_users_write_them() -> None:
    assert display_voice("ryan") == "Ryan"
    assert display_voice("uncle_fu") == "Uncle_Fu"
    assert display_voice("ono_anna") == "Ono_Anna"


def test_constructor_checks_quantization_and_does_no_io(tmp_path: Path) -> None:
    engine = MlxQwen3Engine(EngineOptions(model=str(tmp_path / "not-there"), quantization="4bit"))
    assert isinstance(engine, TtsEngine)
    with pytest.raises(ConfigError, match="quantization"):
        MlxQwen3Engine(EngineOptions(model="x", quantization="3bit"))
    with pytest.raises(ConfigError, match="max_frames"):
        MlxQwen3Engine(EngineOptions(model="x", extra={"max_frames": "many"}))
    # The extra-only float32 mode is for the cross-checks with the torch engine.
    MlxQwen3Engine(EngineOptions(model="x", extra={"mlx_quantization": "float32"}))


def test_the_registry_builds_the_mlx_engine(tmp_path: Path) -> None:
    from s2s_daemon.tts.registry import create_engine

    engine = create_engine("mlx", EngineOptions(model=str(tmp_path), quantization="8bit"))
    assert isinstance(engine, MlxQwen3Engine)


# --- with weights ---


def _engine(
    model: Path | str, quantization: str = "8bit", max_frames: int = MAX_FRAMES, **extra: str
) -> MlxQwen3Engine:
    options = EngineOptions(model=str(model), quantization=quantization, extra={"max_frames": str(max_frames), **extra})
    return MlxQwen3Engine(options)


def _request(**fields: Any) -> SynthesisRequest:
    base: dict[str, Any] = {"text": "Hello there.", "voice": None, "language": "auto", "chunk_frames": 2, "seed": 1}
    base.update(fields)
    return SynthesisRequest(**base)


def _speak(engine: MlxQwen3Engine, request: SynthesisRequest) -> list[np.ndarray]:
    return list(engine.synthesize_blocking(request, lambda: False))


def _audio(engine: MlxQwen3Engine, request: SynthesisRequest) -> np.ndarray:
    return np.concatenate(_speak(engine, request))


@pytest.fixture(scope="module")
def cv_engine() -> Iterator[MlxQwen3Engine]:
    """One loaded 8-bit CustomVoice engine shared by the module (loaded on the test thread)."""
    engine = _engine(TINY / "custom_voice", "8bit")
    engine.load_blocking()
    yield engine
    engine.close_blocking()


@pytest.mark.slow
@pytest.mark.mlx
def test_custom_voice_streams_chunks_of_chunk_frames(cv_engine: MlxQwen3Engine) -> None:
    info = cv_engine.load_blocking()
    assert (info.engine, info.mode, info.device, info.sample_rate, info.dtype) == (
        "mlx",
        "custom_voice",
        "cpu",
        24_000,
        "8bit",
    )
    assert "Ryan" in info.voices
    assert "Uncle_Fu" in info.voices
    assert info.languages[0] == "auto"
    assert "english" in info.languages
    assert not any("dialect" in lang for lang in info.languages)
    chunks = _speak(cv_engine, _request(voice="Ryan", chunk_frames=2))
    assert [len(c) for c in chunks] == [2 * SAMPLES_PER_FRAME, 1 * SAMPLES_PER_FRAME]
    for chunk in chunks:
        assert chunk.dtype == np.float32
        assert np.isfinite(chunk).all()
        assert np.abs(chunk).max() <= 1.0
    assert float(np.sqrt(np.mean(np.concatenate(chunks) ** 2))) > 0.01


@pytest.mark.slow
@pytest.mark.mlx
def test_the_same_seed_gives_the_same_audio_and_greedy_ignores_the_seed(cv_engine: MlxQwen3Engine) -> None:
    first = _audio(cv_engine, _request(voice="Ryan", seed=7, chunk_frames=MAX_FRAMES))
    again = _audio(cv_engine, _request(voice="Ryan", seed=7, chunk_frames=MAX_FRAMES))
    other = _audio(cv_engine, _request(voice="Ryan", seed=8, chunk_frames=MAX_FRAMES))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    greedy_a = _audio(cv_engine, _request(voice="Ryan", seed=1, greedy=True, chunk_frames=MAX_FRAMES))
    greedy_b = _audio(cv_engine, _request(voice="Ryan", seed=2, greedy=True, chunk_frames=MAX_FRAMES))
    np.testing.assert_array_equal(greedy_a, greedy_b)


@pytest.mark.slow
@pytest.mark.mlx
def test_a_stop_between_chunks_ends_the_stream_and_the_next_utterance_is_whole(cv_engine: MlxQwen3Engine) -> None:
    request = _request(voice="Ryan", seed=3, chunk_frames=1)
    before = _speak(cv_engine, request)
    assert len(before) == MAX_FRAMES
    stop = threading.Event()
    got = []
    for chunk in cv_engine.synthesize_blocking(request, stop.is_set):
        got.append(chunk)
        stop.set()
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], before[0])
    # The decoder's streaming state was reset: the next utterance equals the one before the stop.
    np.testing.assert_array_equal(np.concatenate(_speak(cv_engine, request)), np.concatenate(before))


@pytest.mark.slow
@pytest.mark.mlx
def test_a_consumer_that_closes_the_stream_releases_it(cv_engine: MlxQwen3Engine) -> None:
    stream = cv_engine.synthesize_blocking(_request(voice="Ryan", chunk_frames=1), lambda: False)
    assert len(next(stream)) == SAMPLES_PER_FRAME
    stream.close()  # type: ignore[attr-defined]  # a generator, as EngineWorker expects
    assert len(_speak(cv_engine, _request(voice="Ryan", chunk_frames=MAX_FRAMES))) == 1


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(180)
async def test_the_engine_worker_drives_it_on_its_one_thread_and_a_stop_token_stops_it() -> None:
    from s2s_daemon.tts.worker import EngineWorker

    engine = _engine(TINY / "custom_voice", "4bit")
    worker = EngineWorker(engine)
    info = await worker.load()
    assert info.dtype == "4bit"
    await worker.warmup()
    token = {"stop": False}  # a job's stop token, as the ledger sets it on stop, barge-in and shutdown
    stopped = []
    async for chunk in worker.stream(_request(voice="Ryan", chunk_frames=1), lambda: token["stop"]):
        stopped.append(chunk)
        token["stop"] = True
    assert len(stopped) == 1
    whole = [chunk async for chunk in worker.stream(_request(voice="Ryan", chunk_frames=1), lambda: False)]
    assert [len(c) for c in whole] == [SAMPLES_PER_FRAME] * MAX_FRAMES
    np.testing.assert_array_equal(whole[0], stopped[0])
    memory = await worker.memory()
    assert memory.kind == "mlx"
    assert memory.allocated_mib > 0
    with pytest.raises(EngineError, match="engine thread"):
        engine.memory_blocking()  # this test's thread is not the worker's
    await worker.close()


@pytest.mark.slow
@pytest.mark.mlx
def test_voice_and_language_are_validated_with_the_protocol_error_codes(cv_engine: MlxQwen3Engine) -> None:
    with pytest.raises(UnknownVoiceError) as unknown:
        cv_engine.synthesize_blocking(_request(voice="nobody"), lambda: False)
    assert unknown.value.code == "unknown_voice"
    with pytest.raises(UnsupportedLanguageError) as language:
        cv_engine.synthesize_blocking(_request(voice="Ryan", language="klingon"), lambda: False)
    assert language.value.code == "unsupported_language"
    with pytest.raises(UnsupportedLanguageError):
        cv_engine.synthesize_blocking(_request(voice="Ryan", language="beijing_dialect"), lambda: False)
    with pytest.raises(UnknownVoiceError, match="Base model"):
        cv_engine.synthesize_blocking(_request(voice="Ryan", ref_audio=str(REF_WAV)), lambda: False)
    # Case-insensitive voices and language aliases are accepted; no voice means the first preset.
    upper = _audio(cv_engine, _request(voice="RYAN", language="en", chunk_frames=MAX_FRAMES))
    canonical = _audio(cv_engine, _request(voice="Ryan", language="english", chunk_frames=MAX_FRAMES))
    np.testing.assert_array_equal(upper, canonical)
    first_voice = cv_engine.load_blocking().voices[0]
    default = _audio(cv_engine, _request(voice=None, chunk_frames=MAX_FRAMES))
    np.testing.assert_array_equal(default, _audio(cv_engine, _request(voice=first_voice, chunk_frames=MAX_FRAMES)))


@pytest.mark.slow
@pytest.mark.mlx
def test_mlx_work_stays_on_the_loading_thread(cv_engine: MlxQwen3Engine) -> None:
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            cv_engine.synthesize_blocking(_request(voice="Ryan"), lambda: False)
        except EngineError as exc:
            errors.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "engine thread" in str(errors[0])


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(240)
def test_memory_reports_mlx_counters_and_stays_flat_over_utterances() -> None:
    import psutil

    engine = _engine(TINY / "custom_voice", "4bit", max_frames=1)
    engine.load_blocking()
    request = _request(voice="Ryan", chunk_frames=1)
    for _ in range(3):  # settle caches and allocator pools
        _speak(engine, request)
    memory = engine.memory_blocking()
    assert memory.kind == "mlx"
    assert memory.allocated_mib > 0
    assert memory.peak_mib > memory.allocated_mib  # decoding needs scratch that is released after
    active_before = memory.allocated_mib
    rss_before = psutil.Process().memory_info().rss / 2**20
    for _ in range(20):
        _speak(engine, request)
        # Nothing an utterance allocates outlives it.
        assert engine.memory_blocking().allocated_mib == pytest.approx(active_before, abs=0.01)
    rss_after = psutil.Process().memory_info().rss / 2**20
    assert rss_after - rss_before < 16, (rss_before, rss_after)
    engine.close_blocking()


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(300)
def test_each_quantization_loads_and_speaks_and_4bit_holds_less_than_bf16() -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    held: dict[str, float] = {}
    talker: dict[str, int] = {}
    for quant in ("bf16", "8bit", "6bit", "4bit"):
        base = mx.get_active_memory()
        engine = _engine(TINY / "custom_voice", quant)
        info = engine.load_blocking()
        held[quant] = (mx.get_active_memory() - base) / 2**20
        params = tree_flatten(engine.mlx_model.talker.parameters())
        talker[quant] = sum(v.nbytes for _, v in params)
        quantized = sum(1 for k, _ in params if k.endswith(".scales"))
        assert info.dtype == ("bfloat16" if quant == "bf16" else quant)
        assert quantized == (0 if quant == "bf16" else 18), quantized  # every linear whose width divides 64
        chunks = _speak(engine, _request(voice="Ryan", chunk_frames=MAX_FRAMES))
        assert len(chunks) == 1
        assert np.isfinite(chunks[0]).all()
        assert float(np.sqrt(np.mean(chunks[0] ** 2))) > 0.01
        engine.close_blocking()
    # MLX's own count of what the loaded engine holds (codec and embeddings included)...
    assert held["4bit"] < held["bf16"], held
    # ...and the talker's weights alone, strictly ordered by bit width.
    assert talker["4bit"] < talker["6bit"] < talker["8bit"] < talker["bf16"], talker


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(240)
def test_voice_design_speaks_with_and_without_an_instruct() -> None:
    engine = _engine(TINY / "voice_design", "4bit")
    info = engine.load_blocking()
    assert info.mode == "voice_design"
    assert info.voices == ()
    with pytest.raises(UnknownVoiceError, match="no preset voices"):
        engine.synthesize_blocking(_request(voice="Ryan", instruct="calm"), lambda: False)
    described = _speak(engine, _request(instruct="A calm, low voice."))
    assert [len(c) for c in described] == [2 * SAMPLES_PER_FRAME, SAMPLES_PER_FRAME]
    plain = _audio(engine, _request(chunk_frames=MAX_FRAMES))
    assert not np.array_equal(np.concatenate(described), plain)  # the instruct is part of the prompt
    engine.close_blocking()


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(300)
def test_base_model_speaks_plain_with_an_x_vector_and_in_context(tmp_path: Path) -> None:
    engine = _engine(TINY / "base", "4bit")
    info = engine.load_blocking()
    assert info.mode == "base"
    assert info.voices == ()
    plain = _audio(engine, _request(chunk_frames=MAX_FRAMES))
    x_vector = _audio(engine, _request(ref_audio=str(REF_WAV), chunk_frames=MAX_FRAMES))
    in_context = _audio(engine, _request(ref_audio=str(REF_WAV), ref_text="Hello world.", chunk_frames=MAX_FRAMES))
    for audio in (plain, x_vector, in_context):
        assert len(audio) == MAX_FRAMES * SAMPLES_PER_FRAME
        assert np.isfinite(audio).all()
    # The speaker embedding and the reference codes change the prompt.
    assert not np.array_equal(plain, x_vector)
    assert not np.array_equal(x_vector, in_context)
    with pytest.raises(EngineError, match="reference audio") as missing:
        engine.synthesize_blocking(_request(ref_audio=str(tmp_path / "none.wav")), lambda: False)
    assert missing.value.code == "engine_error"
    engine.close_blocking()


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(240)
def test_a_prequantized_mlx_community_folder_loads_as_stored(tmp_path: Path) -> None:
    """The layout of the mlx-community repos: quantized weights and a ``quantization`` config entry.

    mlx-audio's own ``convert`` cannot convert Qwen3-TTS (its load compiles the codec decoder,
    which the converter's ``load_weights`` then cannot walk), so the folder is written from an
    engine that quantized at load: the same tensors ``convert`` would save.
    """
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    source = _engine(TINY / "custom_voice", "4bit")
    source.load_blocking()
    out = tmp_path / "Qwen3-TTS-12Hz-tiny-CustomVoice-4bit"
    shutil.copytree(TINY / "custom_voice", out)
    weights = {f"talker.{k}": v for k, v in tree_flatten(source.mlx_model.talker.parameters())}
    assert any(k.endswith(".scales") for k in weights)
    (out / "model.safetensors").unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    expected = np.concatenate(_speak(source, _request(voice="Ryan", chunk_frames=MAX_FRAMES)))
    source.close_blocking()
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["quantization"] = {"group_size": 64, "bits": 4}
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    # The configured quantization does not re-quantize a quantized checkpoint.
    engine = _engine(out, "8bit")
    info = engine.load_blocking()
    assert info.dtype == "4bit"
    np.testing.assert_array_equal(_audio(engine, _request(voice="Ryan", chunk_frames=MAX_FRAMES)), expected)
    engine.close_blocking()


@pytest.mark.mlx
def test_a_partial_or_foreign_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(TINY / "custom_voice", broken)
    shutil.rmtree(broken / "speech_tokenizer")
    with pytest.raises(CheckpointError, match="speech_tokenizer"):
        _engine(broken).load_blocking()
    foreign = tmp_path / "foreign"
    shutil.copytree(TINY / "custom_voice", foreign)
    (foreign / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    with pytest.raises(CheckpointError, match="not qwen3_tts"):
        _engine(foreign).load_blocking()


@pytest.mark.integration
@pytest.mark.mlx
@pytest.mark.timeout(240)
def test_say_cli_writes_a_wav_with_the_mlx_engine(tmp_path: Path) -> None:
    out = tmp_path / "x.wav"
    env = dict(os.environ, S2S_TTS__OPTIONS__MAX_FRAMES='"2"')
    if Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    cmd = [sys.executable, "-m", "s2s_daemon", "say", "--engine", "mlx", "--model", str(TINY / "custom_voice")]
    # A fixed seed: unseeded sampling on the tiny random model sometimes ends the utterance after
    # one frame (seed 0 does, every time); seed 1 runs to the two-frame cap.
    cmd += ["--quantization", "4bit", "--seed", "1", "--out", str(out), "Hello."]
    done = subprocess.run(cmd, cwd=REPO, env=env, timeout=200, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24_000
        assert wav.getnchannels() == 1
        assert wav.getnframes() == 2 * SAMPLES_PER_FRAME


# --- cross-checks with the torch engine ---


def _torch_engine_or_skip() -> Any:
    pytest.importorskip("torch")
    try:
        from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine
    except ImportError as exc:
        pytest.skip(f"s2s_daemon.tts.torch_qwen3 cannot synthesize in this build: {exc}")
    return TorchQwen3Engine


@pytest.fixture(scope="module")
def float32_codec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CustomVoice checkpoint with its codec stored in float32, as released ones are.

    The tiny fixture stores the codec in bfloat16; mlx-audio derives the codebooks from it
    in bfloat16 (embedding_sum / usage), which alone moves the waveform by ~0.2 % RMS.
    """
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny_cv_f32codec") / "custom_voice"
    shutil.copytree(TINY / "custom_voice", out)
    path = out / "speech_tokenizer" / "model.safetensors"
    state = {k: (v.to(torch.float32) if v.is_floating_point() else v) for k, v in load_file(path).items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def engines(float32_codec_dir: Path) -> Iterator[tuple[Any, MlxQwen3Engine]]:
    """(torch engine, MLX engine) on the same checkpoint, both in float32 on the CPU."""
    torch_cls = _torch_engine_or_skip()
    # the float32 decoder on the torch side too (codec_dtype auto takes bfloat16 on some CPUs)
    torch_engine = torch_cls(
        EngineOptions(model=str(float32_codec_dir), dtype="float32", extra={"codec_dtype": "float32"})
    )
    torch_engine.load_blocking()
    mlx_engine = _engine(float32_codec_dir, max_frames=GREEDY_FRAMES_AGREE, mlx_quantization="float32")
    assert mlx_engine.load_blocking().dtype == "float32"
    yield torch_engine, mlx_engine
    mlx_engine.close_blocking()
    torch_engine.close_blocking()


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_both_decoders_give_the_same_waveform_for_the_same_codes(engines: tuple[Any, MlxQwen3Engine]) -> None:
    import mlx.core as mx
    import torch

    torch_engine, mlx_engine = engines
    assert torch_engine.load_blocking().voices == mlx_engine.load_blocking().voices
    assert torch_engine.load_blocking().languages == mlx_engine.load_blocking().languages
    codes = np.random.default_rng(0).integers(0, 128, size=(4, 16))
    reference = torch_engine.codec.forward_full(torch.from_numpy(codes)).numpy()
    decoder = mlx_engine.mlx_model.speech_tokenizer.decoder
    mlx_full = np.array(decoder(mx.array(codes.T[None].astype(np.int32)))[0, 0])
    # mlx-audio's streaming path, two frames at a time, as the engine runs it.
    decoder.reset_streaming_state()
    steps = [decoder.streaming_step(mx.array(codes[i : i + 2].T[None].astype(np.int32))) for i in (0, 2)]
    mlx_streamed = np.concatenate([np.array(s[0, 0]) for s in steps])
    decoder.reset_streaming_state()
    assert reference.shape == mlx_full.shape == mlx_streamed.shape == (4 * SAMPLES_PER_FRAME,)
    rms = float(np.sqrt(np.mean(reference**2)))
    assert rms > 0.05
    # float32 on both sides; observed max |diff| 2.6e-6 (full) on this CPU.
    np.testing.assert_allclose(mlx_full, reference, atol=1e-4, rtol=0)
    np.testing.assert_allclose(mlx_streamed, reference, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.torch
def test_both_talkers_build_the_same_prompt_and_logits(engines: tuple[Any, MlxQwen3Engine]) -> None:
    torch_engine, mlx_engine = engines
    model = mlx_engine.mlx_model
    for voice, language, instruct in (("Ryan", "english", None), ("Dylan", "auto", None), ("Vivian", "chinese", None)):
        request = SynthesisRequest(text="Hello there, friend.", voice=voice, language=language, instruct=instruct)
        prompt, _, _, _ = torch_engine.prepare(request)
        torch_engine.runtime.ensure_capacity(prompt.prefill.shape[1] + 1)
        torch_logits, _ = torch_engine.runtime.prefill(prompt.prefill)
        embeds, _, _ = model._prepare_generation_inputs(request.text, language=language, speaker=voice.lower())
        mlx_logits, _ = model.talker(embeds, cache=model.talker.make_cache())
        # Same layout (non-streaming text, as mlx-audio always prefills the whole text).
        assert tuple(prompt.prefill.shape) == tuple(embeds.shape)
        np.testing.assert_allclose(np.array(embeds), prompt.prefill.numpy(), atol=1e-6, rtol=0)
        # Observed max |diff| 1.5e-7 against logits of magnitude ~0.5.
        np.testing.assert_allclose(np.array(mlx_logits[:, -1]), torch_logits.numpy(), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.torch
def test_greedy_codes_agree_on_the_first_frames(
    engines: tuple[Any, MlxQwen3Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy frames agree for GREEDY_FRAMES_AGREE frames (8 frames = 128 argmax choices).

    Not more, as a rule: the two stacks sum in different orders (MLX vs torch/oneDNN
    kernels), so logits differ by ~1e-7; whenever two candidates are closer than that,
    the argmax may flip, and from the first differing code on the autoregressive
    streams diverge for good. On this checkpoint all 30 frames tried agreed, but a
    near-tie is a matter of chance that grows with the frame count and the BLAS.
    """
    import mlx.core as mx
    from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import Qwen3TTSSpeechTokenizerDecoder

    torch_engine, mlx_engine = engines
    request = SynthesisRequest(text="Hello there.", voice="Ryan", language="english", greedy=True, chunk_frames=1)
    torch_codes = torch_engine.codes_blocking(request, max_frames=GREEDY_FRAMES_AGREE).numpy()
    recorded: list[np.ndarray] = []

    def record(self: Any, codes: Any) -> Any:  # the codes mlx-audio hands its decoder; skip decoding
        recorded.append(np.array(codes)[0].T)
        return mx.zeros((1, 1, codes.shape[-1] * SAMPLES_PER_FRAME))

    monkeypatch.setattr(Qwen3TTSSpeechTokenizerDecoder, "streaming_step", record)
    chunks = _speak(mlx_engine, request)
    assert len(chunks) == GREEDY_FRAMES_AGREE
    mlx_codes = np.concatenate(recorded)
    assert torch_codes.shape == mlx_codes.shape == (GREEDY_FRAMES_AGREE, 16)
    np.testing.assert_array_equal(mlx_codes, torch_codes)
    assert len({tuple(row) for row in mlx_codes}) > 1  # not a constant stream


def test_frame_budget_matches_the_rule(tmp_path: Path) -> None:
    class _Tokenizer:
        def encode(self, text: str) -> list[int]:
            return list(range(len(text.split())))

    class _Model:
        def __init__(self) -> None:
            self.tokenizer = _Tokenizer()
            self.generate_config = {"max_new_tokens": 100}

    assert MlxQwen3Engine._budget(_Model(), "a b c", None) == 30 + 8 * 3
    assert MlxQwen3Engine._budget(_Model(), " ".join("x" * 20), None) == 100
    assert MlxQwen3Engine._budget(_Model(), "a b c", 5) == 5
    assert math.isclose(chunk_interval_s(4) * FRAME_RATE_HZ, 4.5)


@pytest.mark.slow
@pytest.mark.mlx
def test_a_qwen_id_is_fetched_as_the_mlx_community_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline and with an empty cache the fetch fails, and says which repo it looked for."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    engine = _engine("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "4bit")
    with pytest.raises(ModelUnavailableError, match=re.escape("mlx-community/Qwen3-TTS-12Hz-0.6B-CustomVoice-4bit")):
        engine.load_blocking()
