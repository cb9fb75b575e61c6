"""Audio encoders for the speech API's ``response_format``s, fed one chunk at a time.

``pcm`` and ``wav`` are cheap and run on the event loop; ``mp3`` (lameenc), ``opus`` (Ogg Opus
through libsndfile) and ``flac`` (libsndfile) cost milliseconds per chunk and run on a worker
thread (``blocking``). Every format streams as it is made except ``flac``: libsndfile cannot read
back a FLAC stream of unknown length, so FLAC is sent whole, with a header that carries it.
``aac`` has no encoder here (that needs FFmpeg) and is refused.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import Any, Protocol

from s2s_daemon.pipeline.output import pcm16
from s2s_daemon.pipeline.vocabulary import Samples

FORMATS = ("mp3", "opus", "flac", "wav", "pcm")
"""``response_format``s answered; OpenAI's ``aac`` is refused."""
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
MP3_BITRATE_KBPS = 64
"""Mono speech at 24 kHz (MPEG-2 Layer III keeps the rate at 64 kbps; lower rates resample)."""
OPUS_PAGE_LATENCY_MS = 20.0
"""libsndfile holds Ogg pages for 1 s by default: a page per chunk streams instead."""
SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302
"""sndfile.h; soundfile has no wrapper for it."""
WAV_UNKNOWN_SIZE = 0xFFFFFFFF
"""RIFF and data sizes of a WAV stream whose length is unknown (read to the end of the stream)."""


class AudioEncoder(Protocol):
    blocking: bool
    """True when encoding costs enough to run off the event loop."""

    def header(self) -> bytes: ...

    def encode(self, samples: Samples) -> bytes:
        """The bytes ready after ``samples`` (maybe none yet)."""
        ...

    def finish(self) -> bytes:
        """What remains; the encoder is closed afterwards."""
        ...

    def close(self) -> None:
        """Release the encoder without finishing (the client went away); idempotent."""
        ...


class PcmEncoder:
    """OpenAI's ``pcm``: raw signed 16-bit little-endian mono samples at the engine's rate."""

    blocking = False

    def header(self) -> bytes:
        return b""

    def encode(self, samples: Samples) -> bytes:
        return pcm16(samples)

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        return None


class WavEncoder(PcmEncoder):
    """16-bit PCM WAV. Streamed, its header is sent before the audio is made and says 'unknown
    length' (0xFFFFFFFF), as streamed WAV does; given the number of samples (a response sent whole),
    it says the real length."""

    def __init__(self, sample_rate: int, samples: int | None = None) -> None:
        self.sample_rate = sample_rate
        self.samples = samples

    def header(self) -> bytes:
        rate = self.sample_rate
        fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)  # PCM, mono, rate, bytes/s, align, bits
        data = WAV_UNKNOWN_SIZE if self.samples is None else 2 * self.samples
        riff = WAV_UNKNOWN_SIZE if self.samples is None else 4 + 8 + len(fmt) + 8 + data
        return (
            b"RIFF"
            + struct.pack("<I", riff)
            + b"WAVEfmt "
            + struct.pack("<I", len(fmt))
            + fmt
            + (b"data" + struct.pack("<I", data))
        )


class Mp3Encoder:
    """MPEG Layer III through LAME, bytes as soon as LAME has whole frames."""

    blocking = True

    def __init__(self, sample_rate: int) -> None:
        import lameenc

        self._lame: Any = lameenc.Encoder()
        self._lame.set_bit_rate(MP3_BITRATE_KBPS)
        self._lame.set_in_sample_rate(sample_rate)
        self._lame.set_channels(1)
        self._lame.set_quality(2)  # 2: high quality, still about 1 ms per 320 ms chunk

    def header(self) -> bytes:
        return b""

    def encode(self, samples: Samples) -> bytes:
        return bytes(self._lame.encode(pcm16(samples)))

    def finish(self) -> bytes:
        return bytes(self._lame.flush())

    def close(self) -> None:
        return None


class AppendOnlySink:
    """A file for libsndfile that hands on what it appends; rewrites of sent bytes are dropped.

    libsndfile seeks back at close to patch headers; what was sent is gone, so those patches are
    ignored (Ogg needs none).
    """

    def __init__(self) -> None:
        self._sent = 0
        self._pos = 0
        self._pending = bytearray()

    def write(self, data: bytes) -> int:
        start = self._pos - self._sent  # where in ``_pending``; negative: over bytes already sent
        part = bytes(data)[max(-start, 0) :]
        offset = max(start, 0)
        if offset > len(self._pending):
            self._pending += bytes(offset - len(self._pending))
        self._pending[offset : offset + len(part)] = part
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._sent + len(self._pending)
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: end}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""

    def take(self) -> bytes:
        """The bytes appended since the last call."""
        out = bytes(self._pending)
        self._sent += len(out)
        self._pending.clear()
        return out


class SoundFileEncoder:
    """libsndfile: Ogg Opus streamed page by page, or FLAC whole (``streaming=False``)."""

    blocking = True

    def __init__(self, sample_rate: int, container: str, subtype: str, streaming: bool) -> None:
        import soundfile

        self._streaming = streaming
        self._sink: AppendOnlySink | io.BytesIO = AppendOnlySink() if streaming else io.BytesIO()
        self._file: Any = soundfile.SoundFile(
            self._sink, "w", samplerate=sample_rate, channels=1, format=container, subtype=subtype
        )
        if container == "OGG":
            self._set_page_latency(soundfile)

    def _set_page_latency(self, soundfile: Any) -> None:
        snd, ffi = getattr(soundfile, "_snd", None), getattr(soundfile, "_ffi", None)
        if snd is None or ffi is None:  # a soundfile without its cffi handles: 1 s pages
            return
        latency = ffi.new("double*", OPUS_PAGE_LATENCY_MS)
        snd.sf_command(self._file._file, SFC_SET_OGG_PAGE_LATENCY_MS, latency, ffi.sizeof("double"))

    def header(self) -> bytes:
        return b""

    def encode(self, samples: Samples) -> bytes:
        self._file.write(samples)
        return self._sink.take() if isinstance(self._sink, AppendOnlySink) else b""

    def finish(self) -> bytes:
        self._file.close()
        if isinstance(self._sink, AppendOnlySink):
            return self._sink.take()
        return self._sink.getvalue()

    def close(self) -> None:
        self._file.close()


def encoder_factory(response_format: str) -> Callable[[int], AudioEncoder]:
    """The encoder maker for a format in ``FORMATS`` (called with the sample rate in Hz)."""
    makers: dict[str, Callable[[int], AudioEncoder]] = {
        "pcm": lambda rate: PcmEncoder(),
        "wav": WavEncoder,
        "mp3": Mp3Encoder,
        "opus": lambda rate: SoundFileEncoder(rate, "OGG", "OPUS", streaming=True),
        "flac": lambda rate: SoundFileEncoder(rate, "FLAC", "PCM_16", streaming=False),
    }
    return makers[response_format]
