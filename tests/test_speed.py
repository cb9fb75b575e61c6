"""The speech API's ``speed``: the audio time-stretched chunk by chunk (Rubber Band), its pitch
kept, its duration ``1 / speed``, still streamed; asked for with the official openai SDK."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile

from s2s_daemon.intake.http.api import ApiError, parse_speech
from s2s_daemon.pipeline.stretch import TimeStretcher
from tests.support.broker import Mosquitto
from tests.test_http_speech import speech_api, tone_samples

RATE = 24_000
CHUNK = 7680
"""320 ms: what the engine hands on at chunk_frames 4."""


def harmonic_tone(seconds: float, freq: float) -> np.ndarray[Any, Any]:
    t = np.arange(round(seconds * RATE)) / RATE
    wave = 0.3 * np.sin(2 * np.pi * freq * t) + 0.1 * np.sin(4 * np.pi * freq * t)
    return wave.astype(np.float32)


def dominant_hz(samples: np.ndarray[Any, Any]) -> float:
    """The strongest frequency of the middle half (the ends carry the stretcher's ramps)."""
    middle = samples[len(samples) // 4 : 3 * len(samples) // 4].astype(np.float64)
    spectrum = np.abs(np.fft.rfft(middle * np.hanning(len(middle))))
    return float(np.fft.rfftfreq(len(middle), 1 / RATE)[np.argmax(spectrum)])


def stretch_in_chunks(samples: np.ndarray[Any, Any], speed: float, chunk: int = CHUNK) -> list[np.ndarray[Any, Any]]:
    stretcher = TimeStretcher(speed, RATE)
    out = [stretcher.process(samples[i : i + chunk]) for i in range(0, len(samples), chunk)]
    return [*out, stretcher.finish()]


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 4.0])
def test_the_stretcher_scales_the_duration_and_keeps_the_pitch(speed: float) -> None:
    tone = harmonic_tone(4.0, 220.0)
    pieces = stretch_in_chunks(tone, speed)
    out = np.concatenate(pieces)
    assert len(out) == round(len(tone) / speed)
    resolution = RATE / (len(out) // 2)
    assert abs(dominant_hz(out) - 220.0) <= resolution  # a resampler would give 220 * speed
    # no fade at either end, no hole: every 50 ms of it carries the tone
    windows = out[: len(out) // 1200 * 1200].reshape(-1, 1200)
    assert np.sqrt((windows**2).mean(axis=1)).min() > 0.1
    # streamed: output comes with the first chunks, not at the end
    assert sum(len(p) for p in pieces[:2]) > 0.5 * 2 * CHUNK / speed


def test_chunk_boundaries_leave_no_trace() -> None:
    """The same signal stretched in 1-frame chunks and in one piece: the same sound (a stretcher
    restarted per chunk clicks at every boundary and leaves a residual near the signal's level)."""
    tone = harmonic_tone(3.0, 220.0)
    small = np.concatenate(stretch_in_chunks(tone, 1.5, chunk=1920))
    whole = np.concatenate(stretch_in_chunks(tone, 1.5, chunk=len(tone)))
    assert len(small) == len(whole)
    t = np.arange(len(small)) / RATE
    basis = np.stack([f(2 * np.pi * k * 220.0 * t) for k in (1, 2) for f in (np.sin, np.cos)], axis=1)
    middle = slice(len(small) // 4, 3 * len(small) // 4)
    for out in (small, whole):
        fit, *_ = np.linalg.lstsq(basis[middle], out[middle], rcond=None)
        residual = out[middle] - basis[middle] @ fit
        assert 10 * np.log10((residual**2).mean() / (out[middle] ** 2).mean()) < -25  # dB below the tone


def test_out_of_range_or_without_the_extra_is_a_400_that_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    for speed in (0.1, 4.5, 0):
        with pytest.raises(ApiError) as bad:
            parse_speech(f'{{"input": "hi", "speed": {speed}}}'.encode())
        assert bad.value.status == 400 and bad.value.param == "speed" and bad.value.code == "bad_payload"
        assert "between 0.25 and 4" in bad.value.message
    assert parse_speech(b'{"input": "hi", "speed": 0.25}').speed == 0.25
    monkeypatch.setattr("s2s_daemon.pipeline.stretch.stretch_available", lambda: False)
    with pytest.raises(ApiError) as missing:
        parse_speech(b'{"input": "hi", "speed": 1.5}')
    assert missing.value.code == "unsupported_speed" and "s2s-daemon[speed]" in missing.value.message
    assert parse_speech(b'{"input": "hi", "speed": 1.0}').speed == 1.0  # the model's pace needs nothing


@pytest.mark.integration
async def test_the_sdk_gets_faster_and_slower_speech_at_the_same_pitch(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = "The kettle has boiled, come and get your tea."  # 1.76 s of a 440 Hz tone
    async with speech_api(tmp_path, mosquitto) as api, api.client() as client:
        for speed in (1.5, 0.5):
            raw = await client.audio.speech.with_raw_response.create(
                model="tts-1", voice="alloy", input=text, response_format="wav", speed=speed
            )
            audio, rate = soundfile.read(io.BytesIO(raw.parse().content), dtype="float32")
            assert rate == RATE
            assert len(audio) == round(tone_samples(text) / speed)
            assert abs(dominant_hz(audio) - 440.0) <= RATE / (len(audio) // 2)
            request_id = raw.headers["x-request-id"]
            finished = (await api.rec.wait_finished([request_id]))[request_id]
            assert finished["status"] == "completed"
            assert finished["audioMs"] == pytest.approx(tone_samples(text) / speed / 24.0, abs=1.0)  # what was sent


@pytest.mark.integration
async def test_a_stretched_response_still_streams(tmp_path: Path, mosquitto: Mosquitto) -> None:
    text = "x" * 100  # 4 s of audio, made in 1 s at the tone engine's speed 4; 8 s once slowed down
    fast = {"tts": {"options": {"speed": "4"}}}
    async with speech_api(tmp_path, mosquitto, **fast) as api, api.client() as client:
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=text, response_format="pcm", speed=0.5
        ) as response:
            request_id = response.headers["x-request-id"]
            data = b""
            finished_at_first_bytes = None
            first_at = 0.0
            async for piece in response.iter_bytes():
                if finished_at_first_bytes is None:
                    finished_at_first_bytes = request_id in api.rec.finished()
                    first_at = time.monotonic()
                data += piece
            spread_s = time.monotonic() - first_at
    assert finished_at_first_bytes is False  # the first bytes came while it was still synthesizing
    assert spread_s > 0.5  # and the rest as it was made (1 s), not all at once at the end
    assert len(data) == 2 * round(tone_samples(text) / 0.5)


@pytest.mark.integration
async def test_speed_is_refused_clearly_through_the_sdk(tmp_path: Path, mosquitto: Mosquitto) -> None:
    async with speech_api(tmp_path, mosquitto) as api, api.client() as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.audio.speech.create(model="tts-1", voice="alloy", input="too fast", speed=8.0)
        assert bad.value.code == "bad_payload" and "speed 8 is out of range" in str(bad.value)
