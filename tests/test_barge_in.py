"""Barge-in end to end: the daemon (a subprocess) speaks on a real PulseAudio sink while its
VAD listens to a real PulseAudio microphone; speech played into that microphone stops the
utterance with status ``interrupted``."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from tests.support.broker import Mosquitto
from tests.support.daemon import DaemonProcess, write_config
from tests.support.mqtt import recorder
from tests.support.pulse import (
    SPEAKER_RATE_HZ,
    PulseServer,
    espeak_speech,
    pulse_server,  # noqa: F401  (fixture)
)
from tests.support.wait import until

pytestmark = pytest.mark.integration

SITE = "kitchen"
SAY = f"s2s/{SITE}/tts/say"
MS_PER_CHAR = 40.0


def loud(recording: npt.NDArray[np.float32]) -> float:
    """Seconds of the speaker's recording that are loud (the tone, not the silence around it)."""
    return int(np.count_nonzero(np.abs(recording) > 0.05)) / SPEAKER_RATE_HZ


"""The tone engine's audio per character."""


@pytest.mark.audio
@pytest.mark.timeout(120)
async def test_speech_on_the_microphone_interrupts_the_daemon(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    mosquitto: Mosquitto,
    tmp_path: Path,
) -> None:
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.skip("espeak-ng and sox are needed for real speech (apt-get install espeak-ng sox)")
    speech = tmp_path / "interrupt.wav"
    espeak_speech(speech, "Stop, please stop talking now.")
    config = write_config(
        tmp_path / "daemon.yaml",
        mosquitto.port,
        tts={"engine": "tone", "options": {"speed": "1", "ms_per_char": str(MS_PER_CHAR)}},
        audio={"sink": "speaker", "device": "pulse", "latency_ms": 80},
        vad={"enabled": True, "device": "pulse", "policy": "interrupt", "aggressiveness": 2, "frame_ms": 20},
    )
    daemon = DaemonProcess(config, env=pulse_server.env())
    monitor = None
    try:
        async with recorder(mosquitto.port) as rec:
            daemon.start()
            await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 30)
            # Without speech, an utterance plays to the end.
            await rec.say(SAY, {"id": "calm", "text": "x" * 25})  # 1 s of tone
            done = await rec.wait_finished(["calm"], 15)
            assert done["calm"]["status"] == "completed"
            assert rec.payloads("/vad/speech_started") == []

            monitor = pulse_server.record("spk.monitor", SPEAKER_RATE_HZ)
            text = "y" * 200  # 8 s of tone
            await rec.say(SAY, {"id": "long", "text": text})
            await rec.wait_for(lambda: [p for p in rec.payloads("/tts/started") if p["id"] == "long"], 15)
            await until(lambda: loud(monitor.samples()) >= 0.6, 15, "0.6 s of it heard", interval_s=0.05)
            player = pulse_server.play_into_mic(speech)
            done = await rec.wait_finished(["long"], 10)
            await asyncio.to_thread(player.wait, 30)
            finished = done["long"]
            assert finished["status"] == "interrupted"
            started = rec.payloads("/vad/speech_started")
            assert started, "the VAD did not report the speech"
            assert started[0]["siteId"] == SITE and started[0]["signalMs"] >= 60
            # Stopped at the barge-in, within about one engine chunk (320 ms) plus the device latency.
            assert 0 <= finished["ts"] - started[0]["ts"] < 700
            assert finished["audioMs"] < len(text) * MS_PER_CHAR * 0.5
            await rec.wait_for(lambda: rec.payloads("/vad/speech_stopped"), 10)
            end = monitor.seconds()
            await until(lambda: monitor.seconds() >= end + 0.5, 10, "0.5 s more recorded")
            recording = await asyncio.to_thread(monitor.stop)
            monitor = None
            # What reached the speaker: the tone stopped long before its 8 s.
            loud_s = loud(recording)
            assert 0.5 < loud_s < 4.0
            daemon.signal(__import__("signal").SIGTERM)
            assert await daemon.wait(30) == 0
    finally:
        if monitor is not None:
            monitor.stop()
        daemon.cleanup()
        print(daemon.log()[-3000:])
