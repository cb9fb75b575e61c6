"""The daemon end to end with each real engine on the committed tiny checkpoint."""

from __future__ import annotations

import wave
from pathlib import Path

import pytest

from tests.support.broker import Mosquitto
from tests.support.daemon import daemon_in_process, write_config
from tests.support.mqtt import recorder

pytestmark = pytest.mark.integration

TINY = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
SAY = "s2s/kitchen/tts/say"


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param({"engine": "torch"}, marks=pytest.mark.torch, id="torch"),
        pytest.param({"engine": "mlx", "mlx": {"quantization": "8bit"}}, marks=pytest.mark.mlx, id="mlx"),
    ],
)
@pytest.mark.timeout(300)
async def test_say_through_mosquitto_with_a_real_engine(
    tmp_path: Path, mosquitto: Mosquitto, engine: dict[str, object]
) -> None:
    frames = 3
    config = write_config(
        tmp_path / "d.yaml",
        mosquitto.port,
        tts={**engine, "model": str(TINY), "chunk_frames": 2, "warmup": True, "options": {"max_frames": str(frames)}},
        audio={"sink": "wav", "wav_dir": str(tmp_path / "wav")},
    )
    async with recorder(mosquitto.port) as rec, daemon_in_process(config):
        await rec.wait_for(lambda: rec.on("/info") and any(m.payload == b"online" for m in rec.on("/status")), 240)
        info = rec.payloads("/info")[-1]
        assert info["engine"] == engine["engine"] and "Ryan" in info["voices"] and info["sampleRate"] == 24000
        await rec.say(SAY, {"id": "real", "text": "Hello from the kitchen.", "voice": "ryan", "language": "en"})
        await rec.say(SAY, {"id": "nobody", "text": "Hello", "voice": "Nobody"})
        fin = await rec.wait_finished(["real", "nobody"], timeout_s=120)
        assert fin["nobody"]["error"]["code"] == "unknown_voice"
        assert fin["real"]["status"] == "completed", fin["real"]
        lat = await rec.wait_for(lambda: next((p for p in rec.payloads("/metrics/latency") if p["id"] == "real"), None))
        # The daemon samples (no seed): random weights may say end-of-speech early (torch
        # blocks it for 2 frames, mlx-audio does not), so 1 to 3 frames, in chunks of 2; torch's
        # first chunk is one frame (FIRST_CHUNK_FRAMES), so 2 frames are 2 chunks there.
        assert lat["engine"] == engine["engine"]
        played = round(lat["audioMs"] / 80.0)
        assert played in (1, 2, 3) and lat["audioMs"] == pytest.approx(played * 80.0, abs=0.5)
        assert lat["chunks"] == (1 + played // 2 if engine["engine"] == "torch" else (played + 1) // 2)
    with wave.open(str(tmp_path / "wav" / "real.wav")) as wav:
        assert wav.getframerate() == 24000 and wav.getnframes() == played * 1920
        pcm = wav.readframes(wav.getnframes())
    assert any(pcm[i] for i in range(0, len(pcm), 2))  # not silence
