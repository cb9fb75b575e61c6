"""The VAD: detector state machine, capture ring, and the stage on a real PulseAudio microphone."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import numpy.typing as npt
import pytest
from structlog.testing import capture_logs

from s2s_daemon.config import VadConfig
from s2s_daemon.errors import UnavailableError
from s2s_daemon.vad.capture import MicrophoneCapture
from s2s_daemon.vad.detector import SpeechDetector, VadEvent
from s2s_daemon.vad.stage import VadStage
from tests.support.pulse import (
    MIC_RATE_HZ,
    PulseServer,
    espeak_speech,
    locate,
    pulse_server,  # noqa: F401  (fixture)
    speech_bounds,
    write_wav_int16,
)
from tests.support.wait import until

RATE = MIC_RATE_HZ
TOLERANCE_S = 0.100
SENTENCE = "Hello there, this is a test of voice activity detection."
NOISE_RMS = 0.01
"""Steady white noise, about 19 dB below the speech's RMS."""


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> npt.NDArray[np.float32]:
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.skip("espeak-ng and sox are needed for real speech (apt-get install espeak-ng sox)")
    return espeak_speech(tmp_path_factory.mktemp("speech") / "speech.wav", SENTENCE)


def scenario(
    speech: npt.NDArray[np.float32], lead_s: float, gap_s: float, tail_s: float, noise_rms: float, seed: int = 0
) -> tuple[npt.NDArray[np.float32], list[tuple[float, float]]]:
    """Speech twice, at known offsets, in silence or steady noise; the truth as (start, stop) seconds."""
    start, stop = speech_bounds(speech, RATE)
    parts = [np.zeros(int(lead_s * RATE), np.float32), speech, np.zeros(int(gap_s * RATE), np.float32), speech]
    parts.append(np.zeros(int(tail_s * RATE), np.float32))
    signal = np.concatenate(parts)
    if noise_rms:
        signal = signal + noise_rms * np.random.default_rng(seed).standard_normal(len(signal)).astype(np.float32)
    first = lead_s
    second = lead_s + len(speech) / RATE + gap_s
    return signal.astype(np.float32), [(first + start, first + stop), (second + start, second + stop)]


def detect(signal: npt.NDArray[np.float32], detector: SpeechDetector) -> list[VadEvent]:
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    size = RATE * detector.frame_ms // 1000
    events = []
    for i in range(0, len(pcm) - size + 1, size):
        event = detector.feed(pcm[i : i + size].tobytes(), i / RATE)
        if event is not None:
            events.append(event)
    return events


def assert_matches(events: list[VadEvent], truth: list[tuple[float, float]], tolerance_s: float = TOLERANCE_S) -> None:
    assert [e.speaking for e in events] == [True, False] * len(truth), events
    for (start, stop), (on, off) in zip(truth, zip(events[::2], events[1::2], strict=True), strict=True):
        assert abs(on.at - start) <= tolerance_s, (on, start)
        assert abs(off.at - stop) <= tolerance_s, (off, stop)


# --- the detector on real speech, offline -------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(("aggressiveness", "frame_ms"), [(2, 20), (3, 10), (3, 30), (1, 20)])
@pytest.mark.parametrize("noise_rms", [0.0, NOISE_RMS])
def test_detector_finds_speech_in_silence_and_noise(
    speech: npt.NDArray[np.float32], aggressiveness: int, frame_ms: int, noise_rms: float
) -> None:
    signal, truth = scenario(speech, lead_s=1.0, gap_s=1.5, tail_s=1.0, noise_rms=noise_rms)
    events = detect(signal, SpeechDetector(aggressiveness, frame_ms, start_ms=60, stop_ms=400))
    assert_matches(events, truth)
    started = events[0]
    assert started.signal_ms >= 60


@pytest.mark.parametrize(("aggressiveness", "frame_ms"), [(2, 20), (3, 10), (0, 30)])
def test_detector_is_quiet_on_silence_and_steady_noise(aggressiveness: int, frame_ms: int) -> None:
    rng = np.random.default_rng(1)
    silence = np.zeros(3 * RATE, np.float32)
    noise = (NOISE_RMS * rng.standard_normal(6 * RATE)).astype(np.float32)
    hum = (0.02 * np.sin(2 * np.pi * 50 * np.arange(4 * RATE) / RATE)).astype(np.float32)
    for signal in (silence, noise, np.concatenate([silence, noise]), hum):
        assert detect(signal, SpeechDetector(aggressiveness, frame_ms, start_ms=60, stop_ms=400)) == []


class ScriptedVad:
    """Stands in for webrtcvad with a fixed sequence of decisions."""

    def __init__(self, flags: str) -> None:
        self.flags = iter(flags)

    def is_speech(self, frame: bytes, rate: int) -> bool:
        return next(self.flags) == "1"


def run_script(flags: str, start_ms: float = 60, stop_ms: float = 100, quiet: str = "") -> list[tuple[bool, float]]:
    """Feed scripted webrtcvad decisions; frames are loud where voiced, quiet (30 dB lower)
    where not, and at the quiet level wherever ``quiet`` has a 1."""
    detector = SpeechDetector(2, 20, start_ms=start_ms, stop_ms=stop_ms)
    detector._vad = ScriptedVad(flags)
    detector._since_start = 100  # settled
    loud, soft = np.full(320, 1000, "<i2").tobytes(), np.full(320, 30, "<i2").tobytes()
    quiet = quiet.ljust(len(flags), "0")
    out = []
    for i, flag in enumerate(flags):
        frame = loud if flag == "1" and quiet[i] != "1" else soft
        event = detector.feed(frame, i * 0.02)
        if event is not None:
            out.append((event.speaking, round(event.at, 3)))
    return out


def test_hysteresis_counts_frames() -> None:
    # start_ms 60 = 3 voiced frames in a row; stop_ms 100 = 5 silent frames in a row.
    assert run_script("0110111100001111100000") == [(True, 0.08), (False, 0.34)]
    assert run_script("1101101101") == []  # never 3 voiced in a row
    assert run_script("111" + "0000" + "1" + "00000") == [(True, 0.0), (False, 0.16)]


def test_stop_moves_back_over_the_hangover() -> None:
    # Frames 5-7 are flagged voiced but are as quiet as the silence after them (webrtcvad's
    # hangover): speech stopped at frame 5. At most the hangover (5 frames at 20 ms) moves.
    assert run_script("11111111" + "00000", quiet="00000111") == [(True, 0.0), (False, 0.1)]
    assert run_script("1" * 14 + "00000", quiet="0" * 4 + "1" * 10) == [(True, 0.0), (False, 0.18)]


def test_settling_frames_extend_but_do_not_start_speech() -> None:
    detector = SpeechDetector(2, 20, start_ms=60, stop_ms=100)
    detector._vad = ScriptedVad("1111" + "0" * 10 + "1111111")
    frame = np.full(320, 1000, "<i2").tobytes()
    events = [e for i in range(21) if (e := detector.feed(frame, i * 0.02)) is not None]
    # The first 4 voiced frames fall in the 150 ms settling window: no start.
    assert [(e.speaking, round(e.at, 2)) for e in events] == [(True, 0.28)]


def test_digital_silence_restarts_webrtcvad() -> None:
    detector = SpeechDetector(2, 20, start_ms=60, stop_ms=400)
    first = detector._vad
    silent = bytes(640)
    for i in range(10):
        detector.feed(silent, i * 0.02)
    assert detector._vad is not first
    assert detector._since_start == 0


def test_detector_rejects_bad_frames() -> None:
    with pytest.raises(ValueError, match="frame_ms"):
        SpeechDetector(2, 25, 60, 400)
    with pytest.raises(ValueError, match="bytes"):
        SpeechDetector(2, 20, 60, 400).feed(bytes(100), 0.0)


# --- the capture ring, driven by hand ----------------------------------------------


def fake_callback(capture: MicrophoneCapture, samples: npt.NDArray[np.int16]) -> None:
    info = SimpleNamespace(inputBufferAdcTime=0.0, currentTime=0.0)
    status = SimpleNamespace(input_overflow=False)
    capture._callback(samples.tobytes(), len(samples), info, status)


def test_capture_ring_drops_oldest_and_counts() -> None:
    capture = MicrophoneCapture(None, 20, queue_frames=8)
    for i in range(20):
        fake_callback(capture, np.full(320, i, np.int16))
    frames = capture.drain()
    assert capture.dropped == 13  # 20 frames, 7 kept (one slot is always being filled)
    assert [np.frombuffer(f, np.int16)[0] for f, _ in frames] == list(range(13, 20))
    stamps = [at for _, at in frames]
    assert stamps == sorted(stamps)
    assert capture.drain() == []


def test_capture_reassembles_frames_from_odd_buffers() -> None:
    capture = MicrophoneCapture(None, 10, queue_frames=16)
    data = np.arange(1000, dtype=np.int16)
    for chunk in np.array_split(data, 7):
        fake_callback(capture, chunk)
    frames = capture.drain()
    assert len(frames) == 6  # 1000 samples = 6 full 160-sample frames (+40 pending)
    assert np.array_equal(np.frombuffer(b"".join(f for f, _ in frames), np.int16), data[:960])
    assert capture.dropped == 0


async def test_stage_without_input_device_is_unavailable() -> None:
    stage = VadStage(VadConfig(enabled=True, device="no-such-microphone-xyz"), lambda e: None)
    with pytest.raises(UnavailableError, match="microphone"):
        await stage.open()
    assert UnavailableError.exit_code == 69


# --- the stage on a real microphone (PulseAudio) ------------------------------------


async def run_stage_while_playing(
    server: PulseServer, wav: Path | None, listen_s: float, config: VadConfig, open_after_s: float | None = None
) -> tuple[list[VadEvent], npt.NDArray[np.float32], npt.NDArray[np.float64], int]:
    """Run the VAD stage on the ``pulse`` microphone while ``wav`` plays into it.

    ``open_after_s``: start playing first and open the microphone that much later, as
    one that has been listening to a noisy room for a while (a null sink is digitally
    silent while nothing plays, which a real microphone never is).
    Returns the events, the audio the stage received, each sample's capture time and the
    frames dropped."""
    events: list[VadEvent] = []
    stage = VadStage(config, events.append)
    received: list[tuple[bytes, float]] = []
    drain = stage.capture.drain

    def tapped() -> list[tuple[bytes, float]]:
        frames = drain()
        received.extend(frames)
        return frames

    stage.capture.drain = tapped  # type: ignore[method-assign]
    frame_s = config.frame_ms / 1000

    async def hear(seconds: float, what: str) -> None:
        """Until the stage has fed ``seconds`` more of the microphone's audio to the detector."""
        until_frames = stage.frames + round(seconds / frame_s)
        await until(lambda: stage.frames >= until_frames, seconds + 30, what)

    player = None
    if open_after_s is not None and wav is not None:
        player = server.play_into_mic(wav)
        await asyncio.sleep(open_after_s)  # the scenario: the file is playing when the microphone opens
    await stage.open()
    task = asyncio.create_task(stage.run(), name="s2s.vad")
    try:
        if player is None:
            await hear(0.3, "silence before the file")
            player = server.play_into_mic(wav) if wav is not None else None
        await hear(listen_s, "the file")
        if player is not None:
            assert await asyncio.to_thread(player.wait, 30) == 0
        await hear(0.6, "the silence after it")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stage.close()
    audio = np.frombuffer(b"".join(f for f, _ in received), "<i2").astype(np.float32) / 32768.0
    size = len(received[0][0]) // 2 if received else 1
    times = np.concatenate([at + np.arange(size) / RATE for _, at in received]) if received else np.zeros(0)
    return events, audio, times, stage.dropped


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("noise_rms", [0.0, NOISE_RMS], ids=["silence", "noise"])
async def test_stage_detects_real_speech_on_the_microphone(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    speech: npt.NDArray[np.float32],
    tmp_path: Path,
    noise_rms: float,
) -> None:
    # In noise the microphone opens 1 s into the file, which then holds 2 s of noise before the speech.
    lead_s = 2.0 if noise_rms else 1.0
    signal, truth = scenario(speech, lead_s=lead_s, gap_s=1.5, tail_s=0.8, noise_rms=noise_rms, seed=3)
    wav = tmp_path / "scenario.wav"
    write_wav_int16(wav, signal, RATE)
    config = VadConfig(enabled=True, device="pulse", aggressiveness=2, frame_ms=20)
    t0 = time.monotonic()
    events, audio, times, dropped = await run_stage_while_playing(
        pulse_server, wav, len(signal) / RATE, config, open_after_s=1.0 if noise_rms else None
    )
    assert dropped == 0
    # Where each sentence landed in what the microphone heard gives the truth on the monotonic
    # clock: first the whole file roughly, then each sentence within half a second of that
    # (the two sentences are identical, and a late sample or two must not shift the truth).
    rough, _ = locate(audio, signal)
    truth_mono = []
    for start, stop in truth:
        lo, hi = int((start - 0.3) * RATE), int((stop + 0.3) * RATE)
        window_lo = max(0, rough + lo - RATE // 2)
        found, peak = locate(audio[window_lo : rough + hi + RATE // 2], signal[lo:hi])
        assert peak > 0.98, "the microphone did not hear the sentence intact"
        at = window_lo + found - lo  # where the file's sample 0 sits in the heard audio
        truth_mono.append((float(times[at + int(start * RATE)]), float(times[at + int(stop * RATE)])))
    assert all(t0 < a for a, _ in truth_mono)
    assert_matches(events, truth_mono)


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(60)
async def test_stage_is_quiet_on_real_silence_and_steady_noise(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    tmp_path: Path,
) -> None:
    noise = (NOISE_RMS * np.random.default_rng(5).standard_normal(4 * RATE)).astype(np.float32)
    wav = tmp_path / "noise.wav"
    write_wav_int16(wav, noise, RATE)
    config = VadConfig(enabled=True, device="pulse")
    events, audio, _, _ = await run_stage_while_playing(pulse_server, None, 1.5, config)
    assert events == [] and len(audio) > RATE  # it listened, to silence
    events, audio, _, _ = await run_stage_while_playing(pulse_server, wav, 3.0, config, open_after_s=0.5)
    heard = audio[np.abs(audio) > 0]
    assert len(heard) > 2 * RATE  # the noise was heard...
    assert abs(float(np.sqrt(np.mean(heard**2))) - NOISE_RMS) < 0.2 * NOISE_RMS  # ...at its level
    assert events == []


async def wait_frames(stage: VadStage, count: int, timeout_s: float) -> None:
    """Poll (the stage has no event for this) until it has fed ``count`` frames."""
    await until(lambda: stage.frames >= count, timeout_s, f"{count} frames fed")


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(90)
async def test_stage_survives_losing_the_microphone(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    tmp_path: Path,
) -> None:
    own = PulseServer(tmp_path / "own")
    own.start()
    try:
        with own.activated():
            events: list[VadEvent] = []
            stage = VadStage(VadConfig(enabled=True, device="pulse"), events.append)
            await stage.open()
            task = asyncio.create_task(stage.run(), name="s2s.vad")
            try:
                await wait_frames(stage, 25, timeout_s=10)
                before = stage.frames
                assert before >= 25
                with capture_logs() as logs:
                    await asyncio.to_thread(own.stop)  # the sound server (the microphone) disappears
                    # it notices, and a reopen fails while the server is gone
                    await until(lambda: [e for e in logs if e["event"] == "microphone_reopen_failed"], 30)
                assert not task.done(), "the stage must not crash when the microphone goes"
                assert "microphone_lost" in [e["event"] for e in logs]
                own.start()
                await wait_frames(stage, before + 26, timeout_s=15)
                assert stage.frames > before + 25, "the stage did not reopen the microphone"
            finally:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await stage.close()
    finally:
        own.stop()
