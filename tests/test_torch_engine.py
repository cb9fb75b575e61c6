"""The torch engine behind the TtsEngine protocol, on the committed tiny checkpoints.

Loading errors, voices and languages, streaming chunk layout, cancellation, seeds, the frame
budget and end-of-speech, int8 and bfloat16 formats, and the static-shape decode step that the
CUDA graphs capture (run here on the CPU against the eager step).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from s2s_daemon.tts.engine import (  # noqa: E402
    CheckpointError,
    EngineError,
    EngineOptions,
    ModelUnavailableError,
    SynthesisRequest,
    TtsEngine,
    UnknownVoiceError,
    UnsupportedLanguageError,
)
from s2s_daemon.tts.registry import create_engine  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine  # noqa: E402
from s2s_daemon.tts.torch_qwen3.engine import FRAMES_BASE, FRAMES_PER_TOKEN, frame_budget  # noqa: E402
from s2s_daemon.tts.torch_qwen3.layers import KVCache  # noqa: E402
from s2s_daemon.tts.torch_qwen3.runtime import MIN_NEW_TOKENS, DecodeOptions  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("torch_one_thread")]

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
CV = FIXTURES / "custom_voice"
VD = FIXTURES / "voice_design"
SAMPLES_PER_FRAME = 1920
TEXT = "Hello there, this is a test."


def _engine(path: Path, **extra: str) -> TorchQwen3Engine:
    # The float32 decoder, exact in any chunking (the bfloat16 one: tests/test_codec_precision.py).
    extra = {"codec_dtype": "float32", **extra}
    engine = TorchQwen3Engine(EngineOptions(model=str(path), device="cpu", dtype="float32", extra=extra))
    engine.load_blocking()
    return engine


@pytest.fixture(scope="module")
def cv() -> Iterator[TorchQwen3Engine]:
    engine = _engine(CV, max_frames="10", first_chunk_frames="50")  # every chunk chunk_frames long
    yield engine
    engine.close_blocking()


def _request(**kw: Any) -> SynthesisRequest:
    base: dict[str, Any] = {"text": TEXT, "voice": "Ryan", "language": "english", "chunk_frames": 4}
    base.update(kw)
    return SynthesisRequest(**base)


# -- loading ------------------------------------------------------------------------------


def _copy(tmp_path: Path, src: Path = CV) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _load_error(path: Path | str) -> str:
    engine = TorchQwen3Engine(EngineOptions(model=str(path), device="cpu"))
    with pytest.raises(CheckpointError) as info:
        engine.load_blocking()
    return str(info.value)


def test_constructor_does_no_io() -> None:
    engine = TorchQwen3Engine(EngineOptions(model="/nonexistent/folder"))
    assert isinstance(engine, TtsEngine)


def test_registry_builds_the_torch_engine() -> None:
    engine = create_engine("torch", EngineOptions(model=str(CV)))
    assert isinstance(engine, TorchQwen3Engine)


def test_missing_folder(tmp_path: Path) -> None:
    assert "does not exist" in _load_error(tmp_path / "absent")


def test_missing_config(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "config.json").unlink()
    assert "config.json" in _load_error(path)


def test_missing_speech_tokenizer(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    shutil.rmtree(path / "speech_tokenizer")
    assert "speech_tokenizer" in _load_error(path)


def test_missing_weights(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "model.safetensors").unlink()
    assert "model.safetensors" in _load_error(path)


def test_truncated_safetensors(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "truncated" in _load_error(path)


def test_corrupt_safetensors_header(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"#" * 32
    weights.write_bytes(bytes(data))
    assert "header" in _load_error(path)


def test_missing_and_unexpected_tensors(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("talker.codec_head.weight")
    tensors["talker.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    message = _load_error(path)
    assert "talker.codec_head.weight" in message
    assert "talker.extra.weight" in message


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["talker.codec_head.weight"] = tensors["talker.codec_head.weight"][:-1].clone()
    save_file(tensors, str(path / "model.safetensors"))
    assert "talker.codec_head.weight" in _load_error(path)


def test_wrong_model_type(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "qwen2"
    (path / "config.json").write_text(json.dumps(config))
    assert "model_type" in _load_error(path)


def test_hub_id_offline_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    engine = TorchQwen3Engine(EngineOptions(model="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", device="cpu"))
    with pytest.raises(ModelUnavailableError) as info:  # not a CheckpointError: it can work later
        engine.load_blocking()
    assert info.value.offline and info.value.cache == str(tmp_path / "hub")
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in str(info.value)


def test_hub_id_offline_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id resolves through the hub cache (refs/main -> snapshot) without the network."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--Qwen--Qwen3-TTS-12Hz-0.6B-CustomVoice"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(CV, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    engine = TorchQwen3Engine(EngineOptions(model="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", device="cpu"))
    info = engine.load_blocking()
    assert info.model == "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
    assert engine.folder == repo / "snapshots" / commit
    engine.close_blocking()


# -- what the model offers -------------------------------------------------------------------


def test_info_lists_voices_and_languages(cv: TorchQwen3Engine) -> None:
    info = cv.info
    assert info is not None
    assert info.engine == "torch" and info.device == "cpu" and info.dtype == "float32"
    assert info.sample_rate == 24000 and info.mode == "custom_voice"
    assert "Ryan" in info.voices and "Uncle_Fu" in info.voices and len(info.voices) == 9
    assert info.languages[0] == "auto"
    assert {"english", "chinese", "german"} <= set(info.languages)
    assert not any("dialect" in lang for lang in info.languages)


def test_voice_design_has_no_voices() -> None:
    engine = _engine(VD, max_frames="2")
    try:
        assert engine.info is not None and engine.info.voices == () and engine.info.mode == "voice_design"
        with pytest.raises(UnknownVoiceError):
            next(iter(engine.synthesize_blocking(_request(voice="Ryan", instruct="calm"), lambda: False)))
        chunks = list(engine.synthesize_blocking(_request(voice=None, instruct="A calm voice."), lambda: False))
        assert sum(len(c) for c in chunks) == 2 * SAMPLES_PER_FRAME
    finally:
        engine.close_blocking()


def test_unknown_voice(cv: TorchQwen3Engine) -> None:
    with pytest.raises(UnknownVoiceError):
        next(iter(cv.synthesize_blocking(_request(voice="Nobody"), lambda: False)))


@pytest.mark.parametrize("language", ["klingon", "sichuan_dialect", "en"])
def test_unsupported_language(cv: TorchQwen3Engine, language: str) -> None:
    """Canonical names only (aliases such as ``en`` are mapped upstream); dialects are voice-bound."""
    with pytest.raises(UnsupportedLanguageError):
        next(iter(cv.synthesize_blocking(_request(language=language), lambda: False)))


def test_voice_and_language_case_insensitive(cv: TorchQwen3Engine) -> None:
    a = cv.codes_blocking(_request(voice="ryan", language="English", greedy=True), max_frames=3)
    b = cv.codes_blocking(_request(voice="Ryan", language="english", greedy=True), max_frames=3)
    assert torch.equal(a, b)


def test_voice_changes_the_output(cv: TorchQwen3Engine) -> None:
    a = cv.codes_blocking(_request(voice="Ryan", greedy=True), max_frames=4)
    b = cv.codes_blocking(_request(voice="Vivian", greedy=True), max_frames=4)
    assert not torch.equal(a, b)


# -- streaming -----------------------------------------------------------------------------


def test_streaming_chunks(cv: TorchQwen3Engine) -> None:
    """10 frames in chunks of 3: 3 + 3 + 3 + 1 frames, float32 mono, 1920 samples per frame."""
    chunks = list(cv.synthesize_blocking(_request(chunk_frames=3, seed=1), lambda: False))
    assert [len(c) for c in chunks] == [3 * SAMPLES_PER_FRAME] * 3 + [SAMPLES_PER_FRAME]
    for chunk in chunks:
        assert chunk.dtype == np.float32 and chunk.ndim == 1
        assert np.all(np.isfinite(chunk)) and float(np.abs(chunk).max()) <= 1.0
    assert float(np.abs(np.concatenate(chunks)).max()) > 0.0


def test_smaller_first_chunk() -> None:
    """By default one frame first (sooner first audio), then full chunks; same audio."""
    engine = _engine(CV, max_frames="10")
    request = _request(chunk_frames=4, greedy=True)
    chunks = list(engine.synthesize_blocking(request, lambda: False))
    assert [len(c) for c in chunks] == [
        SAMPLES_PER_FRAME,
        4 * SAMPLES_PER_FRAME,
        4 * SAMPLES_PER_FRAME,
        SAMPLES_PER_FRAME,
    ]
    one_shot = engine.codec.decode(engine.codes_blocking(request)).float().numpy()
    assert float(np.abs(np.concatenate(chunks) - one_shot).max()) < 1e-4
    engine.close_blocking()


def test_streaming_equals_one_shot_decode(cv: TorchQwen3Engine) -> None:
    request = _request(chunk_frames=4, greedy=True)
    streamed = np.concatenate(list(cv.synthesize_blocking(request, lambda: False)))
    codes = cv.codes_blocking(request)
    one_shot = cv.codec.decode(codes).float().numpy()
    assert streamed.shape == one_shot.shape == (10 * SAMPLES_PER_FRAME,)
    assert float(np.abs(streamed - one_shot).max()) < 1e-4


def test_stop_before_start_yields_nothing(cv: TorchQwen3Engine) -> None:
    assert list(cv.synthesize_blocking(_request(), lambda: True)) == []


def test_cancellation_between_frames(cv: TorchQwen3Engine) -> None:
    """should_stop is polled per frame: flipping it after the first chunk ends the stream."""
    polls = 0
    stop = False

    def should_stop() -> bool:
        nonlocal polls
        polls += 1
        return stop

    stream = cv.synthesize_blocking(_request(chunk_frames=2, seed=3), should_stop)
    first = next(stream)
    assert len(first) == 2 * SAMPLES_PER_FRAME
    stop = True
    assert list(stream) == []
    assert polls >= 3  # before the prefill, and between frames


# -- decoding ------------------------------------------------------------------------------


def test_seed_determinism(cv: TorchQwen3Engine) -> None:
    a = cv.codes_blocking(_request(seed=7), max_frames=6)
    b = cv.codes_blocking(_request(seed=7), max_frames=6)
    c = cv.codes_blocking(_request(seed=8), max_frames=6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.shape == (6, 16)


def test_greedy_ignores_seed(cv: TorchQwen3Engine) -> None:
    a = cv.codes_blocking(_request(greedy=True, seed=1), max_frames=4)
    b = cv.codes_blocking(_request(greedy=True, seed=2), max_frames=4)
    assert torch.equal(a, b)


def test_codes_stay_in_codebook_range(cv: TorchQwen3Engine) -> None:
    codes = cv.codes_blocking(_request(seed=5), max_frames=8)
    assert int(codes.min()) >= 0 and int(codes.max()) < 128  # tiny codebook size


def test_frame_budget_formula() -> None:
    assert frame_budget(10, 8192) == FRAMES_BASE + 10 * FRAMES_PER_TOKEN
    assert frame_budget(10_000, 8192) == 8192
    assert frame_budget(10, 8192, cap=5) == 5
    assert frame_budget(0, 8192) == FRAMES_BASE


@pytest.mark.slow
def test_budget_ends_a_runaway() -> None:
    """A model that never says end-of-speech (EOS suppressed at every step, as before the
    official min_new_tokens: the tiny random checkpoint's draws reach it now and then) is stopped
    by the text-length budget."""
    engine = _engine(CV)
    try:
        assert engine.runtime is not None and engine.cfg is not None
        engine.runtime.suppress[:, engine.cfg.talker.codec_eos_id] = True
        request = _request(text="Hi.", seed=0)
        _, tokens, _, budget = engine.prepare(request)
        assert budget == frame_budget(tokens.content_len, 8192)
        assert budget < 80
        codes = engine.codes_blocking(request)
        assert codes.shape[0] == budget
    finally:
        engine.close_blocking()


def test_end_of_speech_stops_after_min_frames() -> None:
    """Make EOS the argmax: the official min_new_tokens=2 still forces two frames, then it stops."""
    engine = _engine(CV)
    try:
        assert engine.runtime is not None and engine.cfg is not None
        head = engine.runtime.talker.codec_head.weight
        eos = engine.cfg.talker.codec_eos_id
        with torch.no_grad():
            head[eos] = head[eos] * 0 + 10.0 * torch.sign(torch.ones_like(head[eos]))
        frames = list(engine.synthesize_blocking(_request(chunk_frames=1, greedy=True), lambda: False))
        assert len(frames) == MIN_NEW_TOKENS
        codes = engine.codes_blocking(_request(greedy=True))
        assert codes.shape[0] == MIN_NEW_TOKENS and int(codes[:, 0].max()) < eos
    finally:
        engine.close_blocking()


def test_warmup_and_memory(cv: TorchQwen3Engine) -> None:
    cv.warmup_blocking()
    memory = cv.memory_blocking()
    assert memory.kind == "none"


# -- formats -------------------------------------------------------------------------------


def _first_logits(engine: TorchQwen3Engine) -> torch.Tensor:
    assert engine.runtime is not None
    with torch.inference_mode():
        prompt, *_ = engine.prepare(_request(greedy=True))
        engine.runtime.ensure_capacity(prompt.prefill.shape[1] + 2)
        logits, _ = engine.runtime.prefill(prompt.prefill)
    return logits.float()


def _native_or_skip(kernels: str) -> None:
    from s2s_daemon.tts.torch_qwen3 import native

    if kernels == "native" and native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")


@pytest.mark.parametrize(
    ("quantization", "kernels", "max_rms_error", "min_corr"),
    [("int8", "torch", 0.25, 0.98), ("int8", "native", 0.05, 0.998), ("int4", "native", 0.25, 0.98)],
)
def test_quantized_engine(
    cv: TorchQwen3Engine, quantization: str, kernels: str, max_rms_error: float, min_corr: float
) -> None:
    _native_or_skip(kernels)
    engine = TorchQwen3Engine(
        EngineOptions(
            model=str(CV), device="cpu", quantization=quantization, kernels=kernels, extra={"max_frames": "4"}
        )
    )
    info = engine.load_blocking()
    try:
        assert info.dtype == quantization
        reference = _first_logits(cv)
        quantized = _first_logits(engine)
        # The prompt's logits on this tiny model (64 channels), measured: int8 with torch's FBGEMM
        # (activations quantized too) correlation 0.995, RMS error 10% of the logits' RMS; native
        # int8 (float activations in a prefill) 0.9999 and 1%; native int4 (groups of 64) 0.992 and
        # 13%. A wrong scale or layout gives a correlation near 0.
        rms = float(reference.pow(2).mean().sqrt())
        assert float((quantized - reference).pow(2).mean().sqrt()) < max_rms_error * rms
        assert torch.corrcoef(torch.stack([quantized[0], reference[0]]))[0, 1] > min_corr
        chunks = list(engine.synthesize_blocking(_request(seed=1), lambda: False))
        assert sum(len(c) for c in chunks) == 4 * SAMPLES_PER_FRAME
    finally:
        engine.close_blocking()


def test_native_kernels_give_the_torch_kernels_codes(cv: TorchQwen3Engine) -> None:
    """float32 through the native linears and fused stacks: the same greedy codes as plain torch."""
    _native_or_skip("native")
    plain = TorchQwen3Engine(
        EngineOptions(model=str(CV), device="cpu", dtype="float32", kernels="torch", extra={"max_frames": "10"})
    )
    plain.load_blocking()
    fused = TorchQwen3Engine(
        EngineOptions(model=str(CV), device="cpu", dtype="float32", kernels="native", extra={"max_frames": "10"})
    )
    fused.load_blocking()
    try:
        assert fused.runtime is not None and fused.runtime.talker.model.native is not None
        assert plain.runtime is not None and plain.runtime.talker.model.native is None
        assert fused.runtime.kernels is not None and plain.runtime.kernels is None  # the sampled draws' one call
        request = _request(greedy=True)
        assert torch.equal(fused.codes_blocking(request, max_frames=10), plain.codes_blocking(request, max_frames=10))
    finally:
        plain.close_blocking()
        fused.close_blocking()


def test_int4_needs_the_native_kernels() -> None:
    engine = TorchQwen3Engine(EngineOptions(model=str(CV), device="cpu", quantization="int4", kernels="torch"))
    with pytest.raises(EngineError, match="int4 quantization needs the native CPU kernels"):
        engine.load_blocking()


def test_bfloat16_engine(cv: TorchQwen3Engine) -> None:
    engine = TorchQwen3Engine(EngineOptions(model=str(CV), device="cpu", dtype="bf16", extra={"max_frames": "3"}))
    info = engine.load_blocking()
    try:
        assert info.dtype == "bfloat16"
        reference = _first_logits(cv)
        got = _first_logits(engine)
        assert float((got - reference).abs().max()) < 0.05 * float(reference.abs().max()) + 0.02
        chunks = list(engine.synthesize_blocking(_request(seed=1), lambda: False))
        assert sum(len(c) for c in chunks) == 3 * SAMPLES_PER_FRAME
        assert all(c.dtype == np.float32 for c in chunks)
    finally:
        engine.close_blocking()


def test_bad_options() -> None:
    with pytest.raises(EngineError):
        TorchQwen3Engine(EngineOptions(model=str(CV), device="cpu", dtype="float8")).load_blocking()
    with pytest.raises(EngineError, match="kernels"):
        TorchQwen3Engine(EngineOptions(model=str(CV), device="cpu", kernels="fast")).load_blocking()
    with pytest.raises(EngineError):
        TorchQwen3Engine(
            EngineOptions(model=str(CV), device="cuda:0" if not torch.cuda.is_available() else "nope")
        ).load_blocking()


def test_static_shape_step_matches_eager(cv: TorchQwen3Engine) -> None:
    """The masked full-cache step that CUDA graphs capture gives the eager step's logits (on the CPU)."""
    rt = cv.runtime
    assert rt is not None
    with torch.inference_mode():
        prompt, *_ = cv.prepare(_request(greedy=True))
        n = prompt.prefill.shape[1]
        rt.ensure_capacity(n + 4)
        assert rt.talker_cache is not None
        rt.talker_cache.k.zero_()  # as a CUDA cache is made (a CPU one is left unwritten: KVCache)
        rt.talker_cache.v.zero_()
        rt.prefill(prompt.prefill)
        saved_k, saved_v = rt.talker_cache.k.clone(), rt.talker_cache.v.clone()
        x = prompt.trailing[:1].unsqueeze(0).clone() + prompt.pad
        eager_logits, eager_hidden = rt.talker_step(x, n)
        eager_logits, eager_hidden = eager_logits.clone(), eager_hidden.clone()
        rt.talker_cache.k.copy_(saved_k)
        rt.talker_cache.v.copy_(saved_v)
        cache: KVCache = rt.talker_cache
        pos = torch.tensor([n])
        mask = torch.full((1, 1, 1, cache.max_len), float("-inf"))
        mask[..., : n + 1] = 0.0
        cos, sin = rt._cos.index_select(0, pos), rt._sin.index_select(0, pos)
        h = rt.talker.model.run(x, cos, sin, cache, 0, mask=mask, positions=pos)
        static_logits = rt.talker.codec_head(h)[:, 0].float()
    assert torch.allclose(static_logits, eager_logits, atol=1e-5)
    assert torch.allclose(h, eager_hidden, atol=1e-5)


def test_decode_options_budget_zero(cv: TorchQwen3Engine) -> None:
    assert cv.runtime is not None and cv.gen is not None
    with torch.inference_mode():
        prompt, *_ = cv.prepare(_request())
        rows = list(
            cv.runtime.frames(prompt, cv.gen, DecodeOptions(max_frames=0, greedy=True, seed=None), lambda: False)
        )
    assert rows == []


@pytest.mark.parametrize("size", ["tiny", "0.6b", "1.7b"])
@pytest.mark.parametrize("kind", ["custom_voice", "voice_design", "base"])
def test_model_builds_every_released_shape(tmp_path: Path, size: str, kind: str) -> None:
    """Our modules, built from config.json alone, have exactly the checkpoint's tensor names and shapes.

    The layout module mirrors the official classes (checked by the generator against qwen-tts), so
    this covers 0.6B (no small_to_mtp projection) and 1.7B (with it) without writing gigabytes.
    """
    from s2s_daemon.tools.checkpoint_layout import model_config, model_param_shapes
    from s2s_daemon.tts.torch_qwen3.config import load_model_config
    from s2s_daemon.tts.torch_qwen3.talker import Qwen3TtsWeights

    (tmp_path / "config.json").write_text(json.dumps(model_config(size, kind)))
    cfg = load_model_config(tmp_path)
    assert cfg.mode == kind
    with torch.device("meta"):
        weights = Qwen3TtsWeights(cfg.talker)
    ours = {name: tuple(t.shape) for name, t in weights.state_dict().items()}
    theirs = {n: tuple(s) for n, s in model_param_shapes(size, kind).items() if not n.startswith("speaker_encoder.")}
    assert ours == theirs


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (0, 1e-6)])
def test_sampling_filters_collapse_to_greedy(cv: TorchQwen3Engine, top_k: int, top_p: float) -> None:
    """top_k=1 or a vanishing top_p leave one candidate: sampling must then equal greedy decoding."""
    from dataclasses import replace

    gen = cv.gen
    assert gen is not None
    narrow = replace(gen.talker, do_sample=True, top_k=top_k, top_p=top_p, temperature=0.7)
    cv.gen = replace(gen, talker=narrow, predictor=replace(narrow))
    try:
        sampled = cv.codes_blocking(_request(seed=3), max_frames=5)
    finally:
        cv.gen = gen
    greedy = cv.codes_blocking(_request(greedy=True), max_frames=5)
    assert torch.equal(sampled, greedy)


def test_repetition_penalty_semantics() -> None:
    """HF semantics: a seen id's positive logit is divided, a negative one multiplied."""
    from s2s_daemon.tts.torch_qwen3.sampling import apply_repetition_penalty

    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_graph_step_dispatch_falls_back_to_eager(cv: TorchQwen3Engine) -> None:
    """The runtime's CUDA-graph dispatch, with capture disabled (as after a failed capture), decodes
    exactly like the plain eager loop; the captured replay itself needs a GPU and is not run here."""
    from s2s_daemon.tts.torch_qwen3.graphs import CudaGraphSteps

    rt = cv.runtime
    assert rt is not None
    expected = cv.codes_blocking(_request(greedy=True), max_frames=4)
    steps = CudaGraphSteps()
    steps.disabled = True
    rt.graphs = steps
    try:
        got = cv.codes_blocking(_request(greedy=True), max_frames=4)
    finally:
        rt.graphs = None
    assert torch.equal(got, expected)
