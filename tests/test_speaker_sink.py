"""The speaker sink on a real PulseAudio server, sink selection and device listing."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import numpy.typing as npt
import pytest
from structlog.testing import capture_logs

from s2s_daemon.audio import devices as devices_module
from s2s_daemon.audio import select as select_module
from s2s_daemon.audio.devices import DeviceInfo, add_parser, resolve_device
from s2s_daemon.audio.sink import AudioDeviceError, DiscardSink, WavSink
from s2s_daemon.audio.speaker import SpeakerSink
from s2s_daemon.config import AudioConfig
from s2s_daemon.pipeline.channel import Channel, Overflow
from s2s_daemon.pipeline.messages import PlaybackReport, SayRequest, Utterance
from tests.support.pulse import (
    SPEAKER_RATE_HZ,
    PulseServer,
    locate,
    pulse_server,  # noqa: F401  (fixture)
)
from tests.support.wait import until

ENGINE_RATE = 24_000
CHUNK = 960
"""40 ms at 24 kHz."""


def make_signal(seconds: float, seed: int = 0) -> npt.NDArray[np.float32]:
    """Band-limited noise with a slow envelope: unambiguous under cross-correlation."""
    rng = np.random.default_rng(seed)
    n = int(seconds * ENGINE_RATE)
    white = rng.standard_normal(n + 64)
    smooth = np.convolve(white, np.ones(8) / 8, mode="valid")[:n]
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 1.3 * np.arange(n) / ENGINE_RATE) ** 2
    return (0.25 * smooth * envelope).astype(np.float32)


def utterance(volume: float = 1.0, uid: str = "u1") -> Utterance:
    request = SayRequest(id=uid, text="x", voice=None, language="auto", site_id="test", volume=volume)
    return Utterance(request, ENGINE_RATE, Channel(16, Overflow.BLOCK, f"chunks.{uid}"))


async def feed(utt: Utterance, samples: npt.NDArray[np.float32], speed: float, chunk: int = CHUNK) -> list[float]:
    """Stream ``samples`` in chunks at ``speed`` x real time (0: as fast as the sink takes them)."""
    start = time.monotonic()
    arrivals = []
    for i in range(0, len(samples), chunk):
        if speed > 0:  # the pace of an engine: the behaviour under test
            due = start + (i / ENGINE_RATE) / speed
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        arrivals.append(time.monotonic())
        await utt.chunks.put(samples[i : i + chunk])
    utt.chunks.close()
    return arrivals


def reference(samples: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    import soxr

    return np.asarray(soxr.resample(samples, ENGINE_RATE, SPEAKER_RATE_HZ, quality="HQ"), np.float32)


def loud_s(recording: npt.NDArray[np.float32]) -> float:
    """Seconds of the recording above silence."""
    return int(np.count_nonzero(np.abs(recording) > 1e-3)) / SPEAKER_RATE_HZ


def rms(x: npt.NDArray[np.float32]) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if len(x) else 0.0


async def play_and_record(
    server: PulseServer, sink: SpeakerSink, samples: npt.NDArray[np.float32], speed: float, volume: float = 1.0
) -> tuple[PlaybackReport, list[float], npt.NDArray[np.float32], list[float]]:
    recorder = server.record("spk.monitor", SPEAKER_RATE_HZ)
    await until(lambda: recorder.seconds() >= 0.3, 10, "0.3 s recorded before")
    utt = utterance(volume)
    firsts: list[float] = []
    feeder = asyncio.create_task(feed(utt, samples, speed))
    report = await sink.play(utt, firsts.append)
    arrivals = await feeder
    end = recorder.seconds()
    await until(lambda: recorder.seconds() >= end + 0.3, 10, "0.3 s recorded after")
    recording = await asyncio.to_thread(recorder.stop)
    return report, firsts, recording, arrivals


@pytest.fixture
async def speaker(pulse_server: PulseServer) -> AsyncIterator[SpeakerSink]:  # noqa: F811  (fixture)
    sink = SpeakerSink(AudioConfig(sink="speaker", device="pulse", latency_ms=80))
    await sink.open()
    try:
        yield sink
    finally:
        await sink.close()


# --- real playback --------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(60)
async def test_streamed_utterance_plays_intact_without_underruns(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    speaker: SpeakerSink,
) -> None:
    samples = make_signal(2.0)
    report, firsts, recording, arrivals = await play_and_record(pulse_server, speaker, samples, speed=1.5)
    expected = reference(samples)
    offset, peak = locate(recording, expected)
    assert peak > 0.99, "the recording does not match what was sent"
    # Length: silence right before and right after the matched span, so nothing was added or cut.
    margin = int(0.05 * SPEAKER_RATE_HZ)
    assert offset >= margin
    assert rms(recording[offset - margin : offset]) < 1e-3
    assert rms(recording[offset + len(expected) : offset + len(expected) + margin]) < 1e-3
    played = recording[offset : offset + len(expected)]
    assert len(played) == len(expected)
    energy_db = 20 * np.log10(rms(played) / rms(expected))
    assert abs(energy_db) < 0.2
    # Reporting.
    assert report.underruns == 0
    assert report.audio_ms == pytest.approx(1000 * len(expected) / SPEAKER_RATE_HZ, abs=1)
    assert firsts == [report.first_sample_at]
    assert report.first_sample_at is not None and report.last_sample_at is not None
    span = report.last_sample_at - report.first_sample_at
    assert 2.0 <= span <= 2.0 + speaker.stats().output_latency_ms / 1000 + 0.1
    # Playback began once latency_ms (80 ms: two 40 ms chunks) was buffered, not before.
    assert report.first_sample_at >= arrivals[1]
    assert report.first_sample_at - arrivals[1] < 0.1
    stats = speaker.stats()
    assert stats.callback_p99_ms < stats.period_ms


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(60)
async def test_slow_engine_underruns_are_counted(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    speaker: SpeakerSink,
) -> None:
    samples = make_signal(1.0, seed=1)
    report, _, recording, _ = await play_and_record(pulse_server, speaker, samples, speed=0.5)
    assert report.underruns >= 5  # 40 ms of audio every 80 ms: the ring runs dry again and again
    # Once between two chunks at most (25 chunks of 40 ms), however many 20 ms periods it stays dry.
    assert report.underruns <= 25, report
    # The silence it played is the rest of the span: audio, silence and the device's latency.
    assert report.first_sample_at is not None and report.last_sample_at is not None
    span_ms = 1000.0 * (report.last_sample_at - report.first_sample_at)
    latency_ms = speaker.stats().output_latency_ms
    assert span_ms == pytest.approx(report.audio_ms + report.underrun_ms + latency_ms, abs=2 * speaker.period_ms)
    assert report.audio_ms == pytest.approx(1000 * len(reference(samples)) / SPEAKER_RATE_HZ, abs=1)
    # All of it still played, with gaps: as much energy as was sent.
    assert rms(recording) * np.sqrt(len(recording)) == pytest.approx(
        rms(reference(samples)) * np.sqrt(len(reference(samples))), rel=0.05
    )


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(60)
async def test_volume_scales_the_output(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    speaker: SpeakerSink,
) -> None:
    samples = make_signal(1.0, seed=2)
    _, _, recording, _ = await play_and_record(pulse_server, speaker, samples, speed=0, volume=0.5)
    expected = reference(samples)
    offset, peak = locate(recording, expected)
    assert peak > 0.99
    ratio = rms(recording[offset : offset + len(expected)]) / rms(expected)
    assert ratio == pytest.approx(0.5, rel=0.03)


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(60)
async def test_cancel_flushes_within_one_period_and_the_sink_plays_on(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    speaker: SpeakerSink,
) -> None:
    recorder = pulse_server.record("spk.monitor", SPEAKER_RATE_HZ)
    await until(lambda: recorder.seconds() >= 0.3, 10, "0.3 s recorded before")
    utt = utterance(uid="long")
    feeder = asyncio.create_task(feed(utt, make_signal(6.0, seed=3), speed=0))
    firsts: list[float] = []
    play = asyncio.create_task(speaker.play(utt, firsts.append))
    await until(lambda: firsts, 10, "playback started")
    # some of it heard (the recording lags the callback by the server's latency)
    await until(lambda: loud_s(recorder.samples()) >= 0.3, 10, "0.3 s heard", interval_s=0.05)
    cancelled_at = time.monotonic()
    play.cancel()
    with pytest.raises(asyncio.CancelledError):
        await play
    returned_at = time.monotonic()
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    period_s = speaker.period_ms / 1000
    # The callback dropped the buffer (about 4 s of audio) on its next period.
    assert speaker._flush_at > cancelled_at
    assert speaker._flush_at - cancelled_at <= period_s + 0.015
    assert returned_at - cancelled_at < 3 * period_s + 0.1
    end = recorder.seconds()
    await until(lambda: recorder.seconds() >= end + 0.5, 10, "0.5 s recorded after")
    recording = await asyncio.to_thread(recorder.stop)
    # Sound stopped well before the 6 s utterance would have ended: what was heard + latency.
    assert loud_s(recording) < 1.2
    # The sink is usable right away.
    report, firsts2, recording2, _ = await play_and_record(pulse_server, speaker, make_signal(0.5, seed=4), speed=0)
    assert firsts2 and report.audio_ms > 490
    _, peak = locate(recording2, reference(make_signal(0.5, seed=4)))
    assert peak > 0.99


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(60)
async def test_missing_device_is_an_audio_error_with_backoff(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
) -> None:
    sink = SpeakerSink(AudioConfig(sink="speaker", device="no-such-speaker-xyz"))
    with pytest.raises(AudioDeviceError, match="no output device named 'no-such-speaker-xyz'"):
        await sink.open()
    with pytest.raises(AudioDeviceError, match="no output device named"):
        await sink.play(utterance(), lambda at: None)
    with pytest.raises(AudioDeviceError, match="next reopen in"):  # backing off
        await sink.play(utterance(), lambda at: None)
    await sink.close()


@pytest.mark.integration
@pytest.mark.audio
@pytest.mark.timeout(90)
async def test_device_lost_mid_utterance_is_an_audio_error_then_reopens(
    pulse_server: PulseServer,  # noqa: F811  (fixture)
    tmp_path: Path,
) -> None:
    own = PulseServer(tmp_path / "own")
    own.start()
    try:
        with own.activated():
            sink = SpeakerSink(AudioConfig(sink="speaker", device="pulse"))
            await sink.open()
            utt = utterance(uid="lost")
            feeder = asyncio.create_task(feed(utt, make_signal(6.0, seed=5), speed=1.5))
            firsts: list[float] = []
            play = asyncio.create_task(sink.play(utt, firsts.append))
            await until(lambda: firsts, 10, "playback started")
            await asyncio.to_thread(own.stop)  # the sound server (the device) disappears
            lost_at = time.monotonic()
            with pytest.raises(AudioDeviceError):
                await play
            assert time.monotonic() - lost_at < 3.0
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
            own.start()
            await until(lambda: time.monotonic() >= sink._retry_at, 10, "the first backoff over")
            utt = utterance(uid="back")
            feeder = asyncio.create_task(feed(utt, make_signal(0.3, seed=6), speed=0))
            report = await sink.play(utt, lambda at: None)
            await feeder
            assert report.first_sample_at is not None and report.audio_ms > 290
            await sink.close()
    finally:
        own.stop()


# --- the callback alone, driven by hand -------------------------------------------


def driven_sink(channels: int) -> SpeakerSink:
    """A sink whose callback is called by the test, at 1 kHz for easy arithmetic; the test
    arms it (``_start_pos`` is where the prebuffer is full)."""
    sink = SpeakerSink(AudioConfig(sink="speaker"))
    sink.rate_hz = 1000
    sink.channels = channels
    sink._cap = 64
    sink._ring = np.zeros(64, np.float32)
    return sink


def call_back(sink: SpeakerSink, frames: int) -> npt.NDArray[np.float32]:
    out = bytearray(4 * frames * sink.channels)
    info = SimpleNamespace(outputBufferDacTime=0.0, currentTime=0.0)
    sink._callback(out, frames, info, SimpleNamespace(output_underflow=False))
    data = np.frombuffer(bytes(out), np.float32)
    return data.reshape(frames, sink.channels) if sink.channels > 1 else data


def push(sink: SpeakerSink, values: npt.NDArray[np.float32]) -> None:
    for v in values:  # the producer's side of the ring, one frame at a time
        sink._ring[sink._wpos % sink._cap] = v
        sink._wpos += 1


@pytest.mark.parametrize("channels", [1, 2])
def test_callback_prebuffers_counts_underruns_and_ends(channels: int) -> None:
    sink = driven_sink(channels)
    sink._start_pos = 30
    sink._seq = 1
    sink._armed = True
    push(sink, np.arange(1, 21, dtype=np.float32))
    assert not call_back(sink, 10).any()  # 20 < 30 buffered: silence, not an underrun
    assert sink._first_at == 0.0 and sink._underruns == 0
    push(sink, np.arange(21, 41, dtype=np.float32))
    out = call_back(sink, 16)
    assert sink._first_at > 0.0
    expected = np.arange(1, 17, dtype=np.float32)
    assert np.array_equal(out if channels == 1 else out[:, 1], expected)
    if channels == 2:
        assert np.array_equal(out[:, 0], out[:, 1])
    call_back(sink, 16)  # frames 17..32
    out = call_back(sink, 16)  # 33..40 then empty: an underrun (the utterance has not ended)
    assert sink._underruns == 1
    head = out if channels == 1 else out[:, 0]
    assert np.array_equal(head[:8], np.arange(33, 41, dtype=np.float32)) and not head[8:].any()
    push(sink, np.full(5, 0.5, np.float32))
    sink._end_pos = sink._wpos
    call_back(sink, 16)
    assert sink._done_seq == 1 and not sink._playing and sink._underruns == 1
    assert sink._last_at > 0.0
    assert not call_back(sink, 16).any()  # idle between utterances: silence, no underrun
    assert sink._underruns == 1


def test_a_run_of_starved_periods_is_one_underrun_and_its_silence_is_counted() -> None:
    """Issue 41 item 14: a slow engine that leaves the ring dry for 5 periods is one underrun of
    5 periods' silence, not 5 underruns; the next dry spell after audio came is a second one."""
    sink = driven_sink(1)
    sink._start_pos = 10
    sink._seq = 1
    sink._armed = True
    push(sink, np.ones(10, np.float32))
    call_back(sink, 10)  # plays the 10 buffered frames
    for _ in range(5):
        assert not call_back(sink, 10).any()  # dry: 50 frames (50 ms at 1 kHz) of silence
    assert sink._underruns == 1 and sink._underrun_frames == 50
    push(sink, np.ones(15, np.float32))
    call_back(sink, 10)  # audio again: the run is over
    call_back(sink, 10)  # 5 frames, then dry: a second underrun
    call_back(sink, 10)  # still the second
    assert sink._underruns == 2 and sink._underrun_frames == 50 + 5 + 10
    push(sink, np.ones(4, np.float32))
    sink._end_pos = sink._wpos
    call_back(sink, 10)  # the end: silence after the last sample is no underrun
    assert sink._underruns == 2 and sink._underrun_frames == 65 and sink._done_seq == 1
    stats = sink.stats()
    assert stats.underruns == 2 and stats.underrun_ms == pytest.approx(65.0)


def test_callback_flushes_on_request() -> None:
    sink = driven_sink(1)
    sink._start_pos = 1
    sink._armed = True
    push(sink, np.ones(50, np.float32))
    assert call_back(sink, 10).all()
    sink._request_flush()
    assert not call_back(sink, 10).any()
    assert sink._flush_ack == sink._flush_req and sink._rpos == sink._wpos


# --- selection, no sound server needed ----------------------------------------------


def test_constructors_do_no_io() -> None:
    sink = SpeakerSink(AudioConfig(sink="speaker", device="no-such-device"))
    assert sink.device is None and sink._stream is None
    with capture_logs() as logs:
        chosen = select_module.make_sink(AudioConfig(sink="speaker", device="no-such-device"))
    assert isinstance(chosen, SpeakerSink)
    assert logs[0]["event"] == "audio_sink_selected" and logs[0]["sink"] == "speaker"


def test_make_sink_explicit_choices(tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert isinstance(select_module.make_sink(AudioConfig(sink="discard")), DiscardSink)
        wav = select_module.make_sink(AudioConfig(sink="wav", wav_dir=tmp_path))
    assert isinstance(wav, WavSink) and wav.folder == tmp_path
    assert [(e["sink"], e["reason"]) for e in logs] == [
        ("discard", "audio.sink is discard: audio is dropped"),
        ("wav", "audio.sink is wav"),
    ]


def test_auto_picks_the_speaker_when_a_device_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    device = DeviceInfo(3, "USB Speaker", "ALSA", 0, 2, 48000.0, default_output=True)
    monkeypatch.setattr(select_module, "resolve_device", lambda spec, direction: device)
    with capture_logs() as logs:
        sink = select_module.make_sink(AudioConfig())
    assert isinstance(sink, SpeakerSink)
    assert logs[0]["sink"] == "speaker" and logs[0]["device"] == "USB Speaker"


@pytest.mark.parametrize("with_wav_dir", [False, True])
def test_auto_falls_back_and_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, with_wav_dir: bool) -> None:
    def missing(spec: object, direction: str) -> DeviceInfo:
        raise AudioDeviceError("no sound output device found")

    monkeypatch.setattr(select_module, "resolve_device", missing)
    with capture_logs() as logs:
        sink = select_module.make_sink(AudioConfig(wav_dir=tmp_path if with_wav_dir else None))
    assert isinstance(sink, WavSink if with_wav_dir else DiscardSink)
    assert logs[0]["log_level"] == "warning"
    assert "no sound output device found" in logs[0]["reason"]
    if not with_wav_dir:
        assert "NOT be heard" in logs[0]["reason"]


FAKE_DEVICES = [
    DeviceInfo(0, "HDA Intel PCH: ALC892 Analog (hw:0,0)", "ALSA", 2, 2, 44100.0),
    DeviceInfo(1, "USB Audio Device: - (hw:1,0)", "ALSA", 1, 2, 48000.0),
    DeviceInfo(2, "pulse", "ALSA", 32, 32, 44100.0, default_input=True),
    DeviceInfo(3, "default", "ALSA", 32, 32, 44100.0, default_output=True),
    DeviceInfo(4, "Webcam mic", "ALSA", 1, 0, 16000.0),
]


def test_resolve_device_by_default_index_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices_module, "list_devices", lambda: FAKE_DEVICES)
    assert resolve_device(None, "output").index == 3
    assert resolve_device(None, "input").index == 2
    assert resolve_device(1, "output").index == 1
    assert resolve_device("1", "output").index == 1
    assert resolve_device("pulse", "output").index == 2
    assert resolve_device("usb audio", "output").index == 1
    assert resolve_device("webcam", "input").index == 4
    with pytest.raises(AudioDeviceError, match="no output device named 'webcam'"):
        resolve_device("webcam", "output")  # input only
    with pytest.raises(AudioDeviceError, match="no output device with index 4"):
        resolve_device(4, "output")
    with pytest.raises(AudioDeviceError, match="ambiguous"):
        resolve_device("hw:", "output")


def test_devices_subcommand(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(devices_module, "list_devices", lambda: FAKE_DEVICES)
    parser = argparse.ArgumentParser(prog="s2s-daemon")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["devices"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "USB Audio Device" in out and "Webcam mic" in out and "out" in out
    args = parser.parse_args(["devices", "--json"])
    assert args.func(args) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in listed] == [d.name for d in FAKE_DEVICES]

    def broken() -> list[DeviceInfo]:
        raise AudioDeviceError("PortAudio is not available")

    monkeypatch.setattr(devices_module, "list_devices", broken)
    assert args.func(args) == 69


@pytest.mark.integration
@pytest.mark.audio
def test_devices_lists_the_pulse_device(pulse_server: PulseServer) -> None:  # noqa: F811  (fixture)
    names = [d.name for d in devices_module.list_devices()]
    assert "pulse" in names
