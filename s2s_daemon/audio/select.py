"""Choose the sink from ``audio.sink``: auto, speaker, wav or discard."""

from __future__ import annotations

import structlog

from s2s_daemon.audio.devices import resolve_device
from s2s_daemon.audio.sink import AudioDeviceError, AudioSink, DiscardSink, WavSink
from s2s_daemon.config import AudioConfig

log = structlog.get_logger(__name__)


def make_sink(config: AudioConfig) -> AudioSink:
    """The sink ``config.sink`` asks for; ``auto`` probes for an output device (no stream is opened).

    ``auto`` picks the speaker when PortAudio finds the configured (or default) output
    device, else WAV files when ``audio.wav_dir`` is set, else discard; the log line
    ``audio_sink_selected`` says which and why.
    """
    if config.sink == "discard":
        log.info("audio_sink_selected", sink="discard", reason="audio.sink is discard: audio is dropped")
        return DiscardSink()
    if config.sink == "wav":
        assert config.wav_dir is not None  # the config validator requires it
        log.info("audio_sink_selected", sink="wav", reason="audio.sink is wav", wav_dir=str(config.wav_dir))
        return WavSink(config.wav_dir)
    from s2s_daemon.audio.speaker import SpeakerSink

    if config.sink == "speaker":
        log.info("audio_sink_selected", sink="speaker", reason="audio.sink is speaker", device=config.device)
        return SpeakerSink(config)
    try:
        device = resolve_device(config.device, "output")
    except AudioDeviceError as exc:
        if config.wav_dir is not None:
            log.warning(
                "audio_sink_selected",
                sink="wav",
                reason=f"audio.sink is auto and no output device is usable ({exc})",
                wav_dir=str(config.wav_dir),
            )
            return WavSink(config.wav_dir)
        log.warning(
            "audio_sink_selected",
            sink="discard",
            reason=f"audio.sink is auto and no output device is usable ({exc}); audio will NOT be heard",
        )
        return DiscardSink()
    log.info(
        "audio_sink_selected",
        sink="speaker",
        reason="audio.sink is auto and an output device was found",
        device=device.name,
        index=device.index,
        rate_hz=device.default_rate_hz,
    )
    return SpeakerSink(config)
