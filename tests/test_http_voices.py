"""The speech API's ``voice`` field and the daemon's own voices: an OpenAI name (``alloy``, ``nova``)
means the default voice, unless a preset speaker or a library voice has that name; then that voice
is spoken. The daemon in this process, a real mosquitto, the openai SDK as the client, and an
engine that records what it was asked to speak."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import openai
import pytest

from s2s_daemon.tts.engine import DeviceMemory, EngineInfo, EngineOptions, Samples, ShouldStop, SynthesisRequest
from s2s_daemon.tts.registry import register_engine
from tests.support.broker import Mosquitto
from tests.test_http_speech import speech_api

pytestmark = pytest.mark.integration

REF_WAV = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "golden" / "ref_espeak_24k.wav"
FRAME = 1920


class RecordingEngine:
    """Speaks one frame of silence per request and keeps the request. Options: ``mode`` (the
    model's kind: ``base``, ``voice_design``, ``custom_voice``), ``voices`` (comma-separated presets)."""

    heard: ClassVar[list[SynthesisRequest]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, options: EngineOptions) -> None:
        self.mode = options.extra.get("mode", "custom_voice")
        self.voices = tuple(v for v in options.extra.get("voices", "").split(",") if v)

    def load_blocking(self) -> EngineInfo:
        return EngineInfo(
            "recording", "rec", "cpu", 24000, voices=self.voices, languages=("auto", "english"), mode=self.mode
        )

    def warmup_blocking(self) -> None:
        return None

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[Samples]:
        with self.lock:
            self.heard.append(request)
        return iter([np.zeros(FRAME, np.float32)])

    def memory_blocking(self) -> DeviceMemory:
        return DeviceMemory("none")

    def close_blocking(self) -> None:
        return None


@pytest.fixture
def heard() -> Iterator[list[SynthesisRequest]]:
    register_engine("recording", RecordingEngine)
    RecordingEngine.heard.clear()
    yield RecordingEngine.heard
    RecordingEngine.heard.clear()


def _clone(root: Path, name: str) -> None:
    (root / name).mkdir(parents=True)
    shutil.copy(REF_WAV, root / name / "ref.wav")


async def _speak(client: openai.AsyncOpenAI, voice: Any) -> bytes:
    response = await client.audio.speech.with_raw_response.create(
        model="tts-1", voice=voice, input="Hello.", response_format="pcm"
    )
    return bytes(response.parse().content)


async def test_a_library_voice_named_like_an_openai_voice_wins(
    tmp_path: Path, mosquitto: Mosquitto, heard: list[SynthesisRequest]
) -> None:
    root = tmp_path / "voices"
    for name in ("Nova", "carol"):
        _clone(root, name)
    (root / "echo").mkdir()
    (root / "echo" / "instruct.txt").write_text("A designed voice: not for a Base model.", encoding="utf-8")
    tts = {"engine": "recording", "voice": "carol", "voices_dir": str(root), "options": {"mode": "base"}}
    async with speech_api(tmp_path, mosquitto, api_key=None, tts=tts) as api, api.client("any") as client:
        assert len(await _speak(client, "nova")) == 2 * FRAME  # the library's Nova, any case
        assert len(await _speak(client, "alloy")) == 2 * FRAME  # none of ours: the default (tts.voice)
        assert len(await _speak(client, "Carol")) == 2 * FRAME
        # A library voice of a kind this model cannot speak is still ours: refused, saying why.
        with pytest.raises(openai.BadRequestError) as refused:
            await _speak(client, "echo")
        assert refused.value.code == "unknown_voice" and "ref.wav" in refused.value.message
    spoken = [Path(r.ref_audio).parent.name if r.ref_audio else r.voice for r in heard]
    assert spoken == ["Nova", "carol", "carol"]


async def test_a_preset_named_like_an_openai_voice_wins_and_other_names_get_the_default(
    tmp_path: Path, mosquitto: Mosquitto, heard: list[SynthesisRequest]
) -> None:
    tts = {"engine": "recording", "voice": "Ryan", "options": {"mode": "custom_voice", "voices": "Ryan,Nova"}}
    async with speech_api(tmp_path, mosquitto, api_key=None, tts=tts) as api, api.client("any") as client:
        for voice in ("NOVA", "shimmer", "ryan"):
            assert len(await _speak(client, voice)) == 2 * FRAME
        with pytest.raises(openai.BadRequestError) as unknown:
            await _speak(client, "Nobody")
        assert unknown.value.code == "unknown_voice"
    assert [r.voice for r in heard] == ["Nova", "Ryan", "Ryan"]
