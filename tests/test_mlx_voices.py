"""Library voices on the MLX engine (mlx-audio): clone prompts cached in memory and on disk, the
same greedy audio with and without the cache, a designed voice, and a library voice spoken
through the daemon (its HTTP intake, the openai SDK) with a broken voice beside it.

The committed tiny random checkpoints, on the CPU; every engine is capped at a few frames
(``max_frames``): MLX's CPU backend decodes about a frame a second on this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from s2s_daemon.pipeline.voices import VoiceLibrary
from s2s_daemon.tts.bridge import EngineThread
from s2s_daemon.tts.engine import EngineError, EngineOptions, SynthesisRequest

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
BASE = FIXTURES / "base"
VD = FIXTURES / "voice_design"
REF_WAV = FIXTURES / "golden" / "ref_espeak_24k.wav"
REF_TEXT = "Good morning. This is a reference recording for voice cloning."
TEXT = "Hello there."
FRAMES = 3
SAMPLES_PER_FRAME = 1920


def _voice(root: Path, name: str, ref_text: str | None = REF_TEXT, instruct: str | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if instruct is not None:
        (folder / "instruct.txt").write_text(instruct, encoding="utf-8")
        return folder
    shutil.copy(REF_WAV, folder / "ref.wav")
    if ref_text is not None:
        (folder / "ref.txt").write_text(ref_text, encoding="utf-8")
    return folder


_MLX_THREAD = EngineThread("test.mlx")
"""This module's MLX work runs here, as the daemon runs its engine: on a thread of its own that is
never ended. MLX keeps a compile cache per thread; the main thread's is destroyed after the
interpreter is gone, and destroying entries that hold Python functions then crashed the test
process (exit 139, after every test passed)."""


def on_mlx_thread(fn: Callable[[], None]) -> None:
    _MLX_THREAD.submit(fn).result(timeout=230)


def _engine(model: Path, cache: Path | str, quantization: str = "8bit") -> Any:
    from s2s_daemon.tts.mlx_qwen3 import MlxQwen3Engine

    extra = {"max_frames": str(FRAMES), "voice_cache": str(cache)}
    engine = MlxQwen3Engine(EngineOptions(model=str(model), quantization=quantization, extra=extra))
    engine.load_blocking()
    return engine


def _audio(engine: Any, request: SynthesisRequest) -> np.ndarray:
    return np.concatenate(list(engine.synthesize_blocking(request, lambda: False)))


def _mlx_audio_own(engine: Any, request: SynthesisRequest) -> np.ndarray:
    """The same call through mlx-audio's own clone path: the recording's path, no cached prompt."""
    import mlx.core as mx

    loaded = engine._require()
    kwargs = engine._generate_kwargs(loaded, dataclasses.replace(request, ref_audio=None), FRAMES)
    assert kwargs.pop("entry") == "generate" and kwargs.pop("clone_prompt") is None
    kwargs.update(ref_audio=request.ref_audio, ref_text=request.ref_text)
    model = engine.mlx_model
    model._icl_cache.clear()
    assert loaded.hook.pending is None  # the hook passes every call through to mlx-audio
    chunks = [np.array(r.audio.astype(mx.float32)) for r in model.generate(**kwargs)]
    model._icl_cache.clear()
    return np.concatenate(chunks)


@pytest.fixture
def encoder_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every run of mlx-audio's speaker encoder and codec encoder, on any thread."""
    pytest.importorskip("mlx_audio")
    from mlx_audio.tts.models.qwen3_tts.speaker_encoder import Qwen3TTSSpeakerEncoder
    from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import Qwen3TTSSpeechTokenizerEncoder

    calls: list[str] = []
    for cls, method, name in (
        (Qwen3TTSSpeakerEncoder, "__call__", "speaker"),
        (Qwen3TTSSpeechTokenizerEncoder, "encode", "codec"),
    ):
        real = getattr(cls, method)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, counted)
    return calls


# -- the cache alone (mlx arrays, no model) ------------------------------------------------


@pytest.mark.mlx
def test_the_cache_keeps_prompts_in_memory_and_on_disk(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mx = pytest.importorskip("mlx.core")
    from s2s_daemon.tts.mlx_qwen3 import MlxClonePrompt, MlxClonePromptCache

    recording = tmp_path / "ref.wav"
    recording.write_bytes(b"one recording")
    computed: list[tuple[str, bool]] = []

    def compute(path: str, codes: bool) -> MlxClonePrompt:
        computed.append((path, codes))
        ref_codes = mx.arange(6, dtype=mx.int32).reshape(1, 2, 3) if codes else None
        return MlxClonePrompt(mx.full((1, 4), float(len(computed))), ref_codes, mx.zeros(8))

    def load_audio(path: str) -> Any:
        return mx.ones(8)

    cache = MlxClonePromptCache("model-a", tmp_path / "cache")
    first = cache.get(str(recording), True, compute, load_audio)
    assert cache.get(str(recording), True, compute, load_audio) is first  # memory
    assert len(computed) == 1 and len(list((tmp_path / "cache").glob("mlx-*.safetensors"))) == 1
    cache.get(str(recording), False, compute, load_audio)  # x-vector only: its own prompt
    assert len(computed) == 2

    restarted = MlxClonePromptCache("model-a", tmp_path / "cache")
    again = restarted.get(str(recording), True, compute, load_audio)
    assert len(computed) == 2 and restarted.loaded == 1 and restarted.computed == 0
    assert np.array_equal(np.array(again.speaker), np.array(first.speaker))
    assert np.array_equal(np.array(again.ref_codes), np.array(first.ref_codes))
    assert again.ref_codes is not None and again.ref_codes.dtype == mx.int32
    assert np.array_equal(np.array(again.audio), np.ones(8))

    # Another model, or a changed recording, is another key; a corrupt file is computed again.
    MlxClonePromptCache("model-b", tmp_path / "cache").get(str(recording), True, compute, load_audio)
    assert len(computed) == 3
    recording.write_bytes(b"two recording")
    os.utime(recording, ns=(1, 1))
    restarted.get(str(recording), True, compute, load_audio)
    assert len(computed) == 4
    for stored in (tmp_path / "cache").glob("mlx-*.safetensors"):
        stored.write_bytes(b"garbage")
    fresh = MlxClonePromptCache("model-a", tmp_path / "cache")
    fresh.get(str(recording), True, compute, load_audio)
    assert len(computed) == 5 and fresh.loaded == 0

    # No folder (voice_cache: off): memory only, nothing written.
    memory_only = MlxClonePromptCache("model-a", None)
    memory_only.get(str(recording), True, compute, load_audio)
    memory_only.get(str(recording), True, compute, load_audio)
    assert len(computed) == 6 and not list(tmp_path.glob("mlx-*"))


# -- the engine ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(240)
def test_cached_prompts_give_mlx_audios_own_greedy_output(tmp_path: Path, encoder_calls: list[str]) -> None:
    on_mlx_thread(lambda: _cached_prompts(tmp_path, encoder_calls))


def _cached_prompts(tmp_path: Path, encoder_calls: list[str]) -> None:
    folder = _voice(tmp_path / "voices", "alice")
    cache = tmp_path / "cache"
    icl = SynthesisRequest(
        text=TEXT,
        voice=None,
        language="english",
        chunk_frames=2,
        greedy=True,
        ref_audio=str(folder / "ref.wav"),
        ref_text=REF_TEXT,
    )
    xvec = dataclasses.replace(icl, ref_text=None)
    engine = _engine(BASE, cache)
    expected = {"icl": _mlx_audio_own(engine, icl), "xvec": _mlx_audio_own(engine, xvec)}
    assert sorted(encoder_calls) == ["codec", "speaker", "speaker"]  # mlx-audio's own path runs the encoders
    assert not np.array_equal(expected["icl"], expected["xvec"])
    encoder_calls.clear()

    for _ in range(2):  # computed once, then from memory
        assert np.array_equal(_audio(engine, icl), expected["icl"])
        assert np.array_equal(_audio(engine, xvec), expected["xvec"])
    assert sorted(encoder_calls) == ["codec", "speaker", "speaker"]
    assert engine._require().clones.computed == 2
    assert len(list(cache.glob("mlx-*.safetensors"))) == 2
    assert len(expected["icl"]) == FRAMES * SAMPLES_PER_FRAME
    engine.close_blocking()

    encoder_calls.clear()
    restarted = _engine(BASE, cache)
    assert np.array_equal(_audio(restarted, icl), expected["icl"])  # from disk
    assert np.array_equal(_audio(restarted, xvec), expected["xvec"])
    assert encoder_calls == [] and restarted._require().clones.loaded == 2
    # A changed recording (same name, same size) is noticed by its hash.
    audio = np.frombuffer((folder / "ref.wav").read_bytes()[44:], dtype="<i2").copy()
    (folder / "ref.wav").write_bytes((folder / "ref.wav").read_bytes()[:44] + (audio // 2).astype("<i2").tobytes())
    os.utime(folder / "ref.wav", ns=(1, 1))
    _audio(restarted, xvec)
    assert encoder_calls == ["speaker"] and len(list(cache.glob("mlx-*.safetensors"))) == 3
    restarted.close_blocking()


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(240)
def test_a_corrupt_recording_is_an_engine_error_and_the_next_voice_speaks(
    tmp_path: Path, encoder_calls: list[str]
) -> None:
    on_mlx_thread(lambda: _corrupt_recording(tmp_path, encoder_calls))


def _corrupt_recording(tmp_path: Path, encoder_calls: list[str]) -> None:
    good = _voice(tmp_path, "alice")
    broken = _voice(tmp_path, "broken")
    (broken / "ref.wav").write_bytes(b"RIFF not really a wav file")
    engine = _engine(BASE, "off")
    request = SynthesisRequest(text=TEXT, voice=None, language="auto", chunk_frames=2, greedy=True)
    with pytest.raises(EngineError, match="reference audio") as failed:
        engine.synthesize_blocking(
            dataclasses.replace(request, ref_audio=str(broken / "ref.wav"), ref_text=REF_TEXT), lambda: False
        )
    assert failed.value.code == "engine_error" and "broken" in str(failed.value)
    assert encoder_calls == []
    spoken = _audio(engine, dataclasses.replace(request, ref_audio=str(good / "ref.wav"), ref_text=REF_TEXT))
    assert len(spoken) == FRAMES * SAMPLES_PER_FRAME and np.isfinite(spoken).all()
    assert encoder_calls == ["speaker", "codec"]
    engine.close_blocking()


@pytest.mark.slow
@pytest.mark.mlx
@pytest.mark.timeout(240)
def test_a_designed_voice_speaks_its_instruction_on_mlx(tmp_path: Path) -> None:
    on_mlx_thread(lambda: _designed_voice(tmp_path))


def _designed_voice(tmp_path: Path) -> None:
    from s2s_daemon.pipeline.channel import Channel, Overflow
    from s2s_daemon.pipeline.jobs import Ledger
    from s2s_daemon.pipeline.queue import RequestQueue
    from s2s_daemon.say import LogEvents
    from s2s_daemon.tts.stage import TtsStage
    from s2s_daemon.tts.worker import EngineWorker

    _voice(tmp_path / "voices", "narrator", instruct="A deep, calm voice.")
    engine = _engine(VD, "off", quantization="4bit")
    info = engine._require().info
    requests = RequestQueue(4)
    library = VoiceLibrary(tmp_path / "voices", info.mode)
    stage = TtsStage(
        EngineWorker(engine),
        info,
        requests,
        Channel(1, Overflow.BLOCK, "u"),
        Ledger(requests, LogEvents(), 16),
        4,
        library=library,
    )
    plain = SynthesisRequest(text=TEXT, voice="narrator", language="english", chunk_frames=FRAMES, greedy=True)
    pins = contextlib.ExitStack()  # a designed voice pins no recording
    synth = stage._with_library_voice(plain, "narrator", pins)
    assert synth.voice is None and synth.instruct == "A deep, calm voice."
    direct = dataclasses.replace(plain, voice=None, instruct="A deep, calm voice.")
    spoken = _audio(engine, synth)
    assert np.array_equal(spoken, _audio(engine, direct))
    assert not np.array_equal(spoken, _audio(engine, dataclasses.replace(direct, instruct=None)))
    engine.close_blocking()


# -- the daemon: a library voice over HTTP on the mlx engine --------------------------------


@pytest.mark.integration
@pytest.mark.mlx
@pytest.mark.timeout(300)
async def test_http_speaks_a_library_voice_on_mlx_and_a_broken_one_is_named(
    tmp_path: Path, mosquitto: Any, encoder_calls: list[str]
) -> None:
    openai = pytest.importorskip("openai")
    from tests.support.broker import free_port
    from tests.support.daemon import daemon_in_process, write_config
    from tests.test_http_speech import wait_ready

    root = tmp_path / "voices"
    _voice(root, "alice")
    broken = _voice(root, "broken")
    (broken / "ref.wav").write_bytes(b"RIFF not really a wav file")
    port = free_port()
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={
            "engine": "mlx",
            "mlx": {"quantization": "8bit"},
            "model": str(BASE),
            "voices_dir": str(root),
            "warmup": False,
            "chunk_frames": 2,
            "options": {"max_frames": str(FRAMES), "voice_cache": str(tmp_path / "cache")},
        },
        http={"enabled": True, "port": port},
    )
    async with daemon_in_process(config):
        await wait_ready(port, timeout_s=120)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        async with client:
            sizes = []
            for voice in ("Alice", "broken", "alice"):
                if voice == "broken":
                    with pytest.raises(openai.InternalServerError) as failed:
                        await client.audio.speech.create(model="tts-1", voice=voice, input=TEXT, response_format="pcm")
                    assert "'broken'" in failed.value.message and "reference audio" in failed.value.message
                    continue
                raw = await client.audio.speech.with_raw_response.create(
                    model="tts-1", voice=voice, input=TEXT, response_format="pcm"
                )
                sizes.append(len(raw.parse().content))
    # Sampled (no seed over HTTP): random weights may say end-of-speech early, so 1 to 3 frames.
    assert all(size in {2 * SAMPLES_PER_FRAME * n for n in range(1, FRAMES + 1)} for size in sizes), sizes
    assert encoder_calls == ["speaker", "codec"]  # alice's prompt computed once, for both requests
    assert len(list((tmp_path / "cache").glob("mlx-*.safetensors"))) == 1
