"""The voice library's edits and a reference recording's checks: what ``s2s-daemon voices add |
rename | remove`` and the web page's voice endpoints both do to ``tts.voices_dir``.

``read_audio`` reads what libsndfile reads (WAV, FLAC, OGG, MP3 with libsndfile >= 1.1), mixes to
mono and resamples to 24 kHz (soxr), never more than 60 s of it; ``check_audio`` refuses a recording
shorter than 3 s or longer than 30 s or a silent one (unless forced) and warns about clipping;
``add_voice`` writes a voice whole (staged, then renamed into place) with ``ref.wav`` as 16-bit PCM.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from s2s_daemon.errors import EXIT_DATAERR, EXIT_FAILURE, EXIT_NOINPUT, EXIT_USAGE, DaemonError
from s2s_daemon.pipeline.voices import INSTRUCT, META, REF_AUDIO, REF_TEXT, valid_name

RATE_HZ = 24000
MIN_S = 3.0
MAX_S = 30.0
CLIP_LEVEL = 0.999
CLIP_SHARE = 0.001
"""More than this share of samples at full scale: clipped."""
SILENCE_RMS = 0.003
"""Below this RMS (about -50 dBFS) the recording is taken for silence."""
MAX_READ_S = 60.0
"""The longest recording read at all, ``force`` or not: the rest is never decoded."""
MIN_RATE_HZ = 8000
MAX_RATE_HZ = 192_000
MAX_CHANNELS = 8
BLOCK_FRAMES = 65_536
"""Frames decoded at a time (mixed to mono before the next block)."""

RACED = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOENT, errno.ENOTDIR, errno.EISDIR})
"""What a voice's folder being added or removed by another edit at the same time raises."""

EXIT_OF_CODE = {
    "missing_audio": EXIT_NOINPUT,  # the recording's file is not there or cannot be opened
    "unreadable_audio": EXIT_DATAERR,  # it is there, but no recording libsndfile reads
    "unsupported_audio": EXIT_DATAERR,  # a sample rate or channel count out of bounds
    "reference_length": EXIT_DATAERR,
    "silent_reference": EXIT_DATAERR,
    "voice_not_found": EXIT_FAILURE,
}
"""The command line's exit status for a refused edit; any other code (a bad name, a voice that
exists, neither recording nor instruction) is a usage error, 64."""


class VoiceEditError(DaemonError):
    """A library edit refused; ``code`` says why in one word (the HTTP API's error code) and chooses
    the command line's exit status (``EXIT_OF_CODE``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.exit_code = EXIT_OF_CODE.get(code, EXIT_USAGE)


@dataclass(frozen=True, slots=True)
class ReferenceStats:
    """What ``check_audio`` looks at in a reference recording."""

    seconds: float
    rms: float
    """Root mean square of the samples (full scale 1.0)."""
    clipped_share: float
    """Share of the samples at full scale."""


def read_audio(source: Path | BinaryIO, label: str | None = None) -> npt.NDArray[np.float32]:
    """Any file libsndfile reads (a path or an open binary file), as mono float32 at 24 kHz.

    Its header is checked before anything is decoded (a 25 KB WAV declaring 1 Hz would decode and
    resample to gigabytes): a sample rate outside ``MIN_RATE_HZ``-``MAX_RATE_HZ`` or more than
    ``MAX_CHANNELS`` channels is ``unsupported_audio``; a recording longer than ``MAX_READ_S`` is
    ``reference_length``, from its header or once that much is decoded (block by block, mixed to
    mono as it comes), whichever says so first.
    """
    import soundfile

    label = label or str(source)
    if isinstance(source, Path):
        try:
            with source.open("rb") as f:
                f.read(1)
        except OSError as exc:
            raise VoiceEditError("missing_audio", f"{label}: {exc.strerror or exc}") from exc
    blocks: list[npt.NDArray[np.float32]] = []
    try:
        with soundfile.SoundFile(str(source) if isinstance(source, Path) else source) as sound:
            rate = int(sound.samplerate)
            limit = _check_format(sound.samplerate, sound.channels, sound.frames, label)
            read = 0
            for block in sound.blocks(BLOCK_FRAMES, dtype="float32", always_2d=True):
                read += len(block)
                if read > limit:
                    raise _too_long(f"more than {MAX_READ_S:g} s", label)
                blocks.append(block.mean(axis=1, dtype=np.float32))
    except (soundfile.LibsndfileError, RuntimeError, OSError) as exc:
        why = getattr(exc, "error_string", None) or str(exc)
        message = f"{label}: not a recording this can read (WAV, FLAC, OGG, MP3): {why}"
        raise VoiceEditError("unreadable_audio", message) from exc
    mono = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
    if rate != RATE_HZ:
        import soxr

        mono = soxr.resample(mono, rate, RATE_HZ).astype(np.float32)
    return np.ascontiguousarray(mono)


def _check_format(rate: int, channels: int, frames: int, label: str) -> int:
    """The most frames of this recording that are read; VoiceEditError for a format out of bounds."""
    if not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:
        raise VoiceEditError(
            "unsupported_audio",
            f"{label}: its sample rate is {rate} Hz; a recording should be {MIN_RATE_HZ}-{MAX_RATE_HZ} Hz",
        )
    if not 1 <= channels <= MAX_CHANNELS:
        raise VoiceEditError(
            "unsupported_audio", f"{label}: it has {channels} channels; a recording should have 1-{MAX_CHANNELS}"
        )
    limit = round(MAX_READ_S * rate)
    if frames > limit:
        raise _too_long(f"{frames / rate:.1f} s", label)
    return limit


def _too_long(length: str, label: str) -> VoiceEditError:
    return VoiceEditError(
        "reference_length",
        f"{label}: the recording is {length}; at most {MAX_READ_S:g} s is read, even forced"
        f" (a reference should be {MIN_S:g}-{MAX_S:g} s)",
    )


def measure(audio: npt.NDArray[np.float32]) -> ReferenceStats:
    if not len(audio):
        return ReferenceStats(0.0, 0.0, 0.0)
    rms = float(np.sqrt(np.mean(np.square(audio, dtype=np.float64))))
    return ReferenceStats(len(audio) / RATE_HZ, rms, float(np.mean(np.abs(audio) >= CLIP_LEVEL)))


def check_audio(audio: npt.NDArray[np.float32], force: bool) -> list[str]:
    """Warnings about ``audio``; VoiceEditError for a length outside 3-30 s or a silent recording
    (nothing to clone) unless ``force``."""
    stats = measure(audio)
    seconds = stats.seconds
    if not MIN_S <= seconds <= MAX_S and not force:
        raise VoiceEditError(
            "reference_length", f"the recording is {seconds:.1f} s; a reference should be {MIN_S:g}-{MAX_S:g} s"
        )
    warnings = []
    if stats.clipped_share > CLIP_SHARE:
        warnings.append("the recording is clipped (samples at full scale): the clone copies the distortion")
    if stats.rms < SILENCE_RMS:
        silent = f"the recording is (nearly) silent (RMS {stats.rms:.4f}, below {SILENCE_RMS:g}): there is no voice"
        if not force:
            raise VoiceEditError("silent_reference", f"{silent} to clone; check the microphone and the file")
        warnings.append(f"{silent} to clone")
    return warnings


def write_wav(path: Path, audio: npt.NDArray[np.float32]) -> None:
    import soundfile

    soundfile.write(str(path), np.clip(audio, -1.0, 1.0), RATE_HZ, subtype="PCM_16", format="WAV")


def _clash(root: Path, name: str) -> str | None:
    """The folder under ``root`` called ``name`` in another spelling (``Bob`` for ``bob``), if any:
    requests match names in any case, so two such voices could not be told apart."""
    try:
        entries = os.listdir(root)
    except OSError:
        return None
    return next((e for e in entries if e.lower() == name.lower() and e != name), None)


def check_name(name: str) -> None:
    if not valid_name(name):
        raise VoiceEditError(
            "bad_voice_name", f"voice name {name!r}: use letters, digits, '-' and '_' only (at most 64)"
        )


def add_voice(
    root: Path,
    name: str,
    *,
    audio: npt.NDArray[np.float32] | None = None,
    ref_text: str | None = None,
    instruct: str | None = None,
    language: str | None = None,
    description: str | None = None,
    replace: bool = False,
) -> None:
    """Write the voice ``name`` under ``root`` whole (staged, then renamed into place): ``audio`` (mono,
    24 kHz, checked by the caller) as ``ref.wav``, the texts beside it. VoiceEditError when the name is
    bad, the voice has neither audio nor instruction, or it exists (in any spelling) and not ``replace``."""
    check_name(name)
    if audio is None and not (instruct and instruct.strip()):
        raise VoiceEditError(
            "bad_voice", "a voice needs a reference recording (Base models) or an instruction (VoiceDesign models)"
        )
    target = root / name
    other = _clash(root, name)
    if other is not None:
        raise VoiceEditError("name_taken", f"voice {name!r} exists in {root} as {other!r}")
    if (target.exists() or target.is_symlink()) and not replace:
        raise VoiceEditError("voice_exists", f"voice {name!r} exists in {root}")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    try:
        if audio is not None:
            write_wav(staging / REF_AUDIO, audio)
        for file, text in ((REF_TEXT, ref_text), (INSTRUCT, instruct)):
            if text and text.strip():
                (staging / file).write_text(text.strip() + "\n", encoding="utf-8")
        if language or description:
            import yaml

            meta = {k: v for k, v in (("language", language), ("description", description)) if v}
            (staging / META).write_text(yaml.safe_dump(meta, allow_unicode=True), encoding="utf-8")
        try:
            if replace and (target.is_symlink() or target.is_file()):
                target.unlink()
            elif replace and target.exists():
                shutil.rmtree(target)
            staging.rename(target)  # without replace, a voice made since the check stays: this fails
        except OSError as exc:
            if exc.errno not in RACED:
                raise
            # Another edit (the web page and the command line at once) made or removed the voice
            # between the check above and here.
            raise VoiceEditError(
                "voice_exists", f"voice {name!r} in {root} was changed by another edit at the same time; try again"
            ) from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def remove_voice(root: Path, name: str) -> None:
    """Remove the voice folder ``name`` (a link is removed, never what it points to)."""
    target = root / name
    if not valid_name(name) or not (target.exists() or target.is_symlink()):
        raise VoiceEditError("voice_not_found", f"no voice {name!r} in {root}")
    if target.is_symlink() or not target.is_dir():
        target.unlink()
    else:
        shutil.rmtree(target)


def rename_voice(root: Path, name: str, new_name: str) -> None:
    """Rename the voice folder ``name`` to ``new_name``; VoiceEditError when ``name`` is missing or
    ``new_name`` is bad or taken (in any spelling other than ``name``'s own)."""
    check_name(new_name)
    source = root / name
    if not valid_name(name) or not (source.exists() or source.is_symlink()):
        raise VoiceEditError("voice_not_found", f"no voice {name!r} in {root}")
    if new_name == name:
        return
    taken = next((e for e in os.listdir(root) if e.lower() == new_name.lower() and e != name), None)
    if taken is not None:
        raise VoiceEditError("name_taken", f"voice {new_name!r} exists in {root} as {taken!r}")
    os.rename(source, root / new_name)
