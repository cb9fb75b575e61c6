"""A Base model clones voices and has none of its own: without ``tts.voice`` naming a library voice,
a request that names no voice (MQTT without ``voice``, HTTP ``alloy``) is refused ``unknown_voice``
saying how to make one, and the start says so; with it, that voice is the default everywhere."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog

from s2s_daemon.config import load_config
from s2s_daemon.errors import ConfigError
from s2s_daemon.wiring import load_engine
from tests.support.broker import Mosquitto, free_port
from tests.support.daemon import daemon_in_process, write_config
from tests.support.mqtt import recorder

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.timeout(300)]

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tiny"
BASE = FIXTURES / "base"
REF_WAV = FIXTURES / "golden" / "ref_espeak_24k.wav"
SAY = "s2s/kitchen/tts/say"


def base_config(tmp_path: Path, broker: Mosquitto, http_port: int, library: bool = True, **tts: Any) -> Path:
    voices = tmp_path / "voices"
    voices.mkdir()
    if library:
        (voices / "grandma").mkdir()
        shutil.copy(REF_WAV, voices / "grandma" / "ref.wav")
    return write_config(
        tmp_path / "d.yaml",
        broker.port,
        tts={
            "engine": "torch",
            "model": str(BASE),
            "voices_dir": str(voices),
            "warmup": False,
            "chunk_frames": 2,
            "options": {"max_frames": "2", "voice_cache": str(tmp_path / "cache")},
            **tts,
        },
        http={"enabled": True, "port": http_port},
    )


async def answers(tmp_path: Path, config: Path, http_port: int) -> tuple[dict[str, Any], int, Any, list[Any]]:
    """MQTT's answer to a say without a voice, HTTP's status and body for ``alloy``, the voices list."""
    with structlog.testing.capture_logs() as logs:
        async with recorder(load_config(config, environ={}).mqtt.port) as rec, daemon_in_process(config):
            await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 240)
            await rec.say(SAY, {"id": "plain", "text": "Hello."})
            fin = (await rec.wait_finished(["plain"], timeout_s=120))["plain"]
            async with aiohttp.ClientSession(f"http://127.0.0.1:{http_port}") as http:
                body = {"model": "tts-1", "input": "Hello.", "voice": "alloy", "response_format": "pcm"}
                async with http.post("/v1/audio/speech", json=body) as r:
                    status, data = r.status, (await r.json() if r.status != 200 else await r.read())
                async with http.get("/v1/audio/voices") as r:
                    voices = await r.json()
    return fin, status, (data, voices), logs


async def test_without_a_library_voice_a_request_must_name_one(tmp_path: Path, mosquitto: Mosquitto) -> None:
    port = free_port()
    config = base_config(tmp_path, mosquitto, port, library=False)
    fin, status, (data, voices), logs = await answers(tmp_path, config, port)
    assert fin["status"] == "rejected" and fin["error"]["code"] == "unknown_voice", fin
    assert "no default voice" in fin["error"]["message"] and "voices add NAME --ref-audio" in fin["error"]["message"]
    assert status == 400 and data["error"]["code"] == "unknown_voice" and "tts.voice" in data["error"]["message"]
    assert voices["default"] is None
    said = [e for e in logs if e["event"] == "no_default_voice"]
    assert said and "tts.voice" in said[0]["requests_without_a_voice"]


async def test_tts_voice_auto_takes_the_librarys_voice(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """The shipped default (``tts.voice: auto``) follows the model: a Base model speaks the first
    clone voice of the library (issue 41, item 5: ``voice: Ryan`` stopped its start with exit 78)."""
    port = free_port()
    fin, status, (data, voices), logs = await answers(tmp_path, base_config(tmp_path, mosquitto, port), port)
    assert fin["status"] == "completed", fin
    assert status == 200 and len(data) > 0
    assert voices["default"] == "grandma"
    assert [e["voice"] for e in logs if e["event"] == "default_voice"] == ["grandma"]


async def test_tts_voice_naming_a_library_voice_is_the_default(tmp_path: Path, mosquitto: Mosquitto) -> None:
    port = free_port()
    config = base_config(tmp_path, mosquitto, port, voice="grandma")
    fin, status, (data, voices), logs = await answers(tmp_path, config, port)
    assert fin["status"] == "completed", fin
    assert status == 200 and len(data) > 0
    assert voices["default"] == "grandma"
    assert [e["voice"] for e in logs if e["event"] == "default_voice"] == ["grandma"]


async def test_tts_voice_that_is_no_library_voice_stops_the_start(tmp_path: Path, mosquitto: Mosquitto) -> None:
    config = load_config(base_config(tmp_path, mosquitto, free_port(), voice="nobody"), environ={})
    with pytest.raises(ConfigError, match=r"tts\.voice: voice 'nobody' is not in the voice library .*grandma"):
        await load_engine(config)
