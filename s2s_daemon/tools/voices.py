"""``s2s-daemon voices list | add NAME --ref-audio FILE [--ref-text T] [--instruct T] | rename NAME NEW
| remove NAME``, and the library edits behind them (the web page's voice endpoints call the same).

``add`` reads what libsndfile reads (WAV, FLAC, OGG, MP3 with libsndfile >= 1.1), mixes to mono,
resamples to 24 kHz (soxr) and writes ``ref.wav`` as 16-bit PCM; it refuses a recording shorter
than 3 s or longer than 30 s (``--force`` takes it anyway) and warns about clipping and silence.
The running daemon reads a voice's folder on every request that names it: no reload needed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from s2s_daemon.config import load_config
from s2s_daemon.errors import EXIT_FAILURE, EXIT_OK, ConfigError
from s2s_daemon.pipeline.voices import INSTRUCT, META, REF_AUDIO, REF_TEXT, default_voices_dir, read_voice, valid_name

RATE_HZ = 24000
MIN_S = 3.0
MAX_S = 30.0
CLIP_LEVEL = 0.999
CLIP_SHARE = 0.001
"""More than this share of samples at full scale: clipped."""
SILENCE_RMS = 0.003
"""Below this RMS (about -50 dBFS) the recording is taken for silence."""
FORCE_HINTS = {"reference_length": "--force takes it anyway", "voice_exists": "--force replaces it"}


def voices_dir(args: argparse.Namespace) -> Path:
    if args.dir is not None:
        return Path(args.dir)
    raw = args.config or os.environ.get("S2S_CONFIG")
    config = load_config(Path(raw) if raw else None, dict(os.environ))
    return config.tts.voices_dir or default_voices_dir()


class VoiceEditError(ConfigError):
    """A library edit refused; ``code`` says why in one word (the HTTP API's error code)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ReferenceStats:
    """What ``check_audio`` looks at in a reference recording."""

    seconds: float
    rms: float
    """Root mean square of the samples (full scale 1.0)."""
    clipped_share: float
    """Share of the samples at full scale."""


def read_audio(source: Path | BinaryIO, label: str | None = None) -> npt.NDArray[np.float32]:
    """Any file libsndfile reads (a path or an open binary file), as mono float32 at 24 kHz."""
    import soundfile

    try:
        data, rate = soundfile.read(
            str(source) if isinstance(source, Path) else source, dtype="float32", always_2d=True
        )
    except (soundfile.LibsndfileError, RuntimeError, OSError) as exc:
        raise VoiceEditError("unreadable_audio", f"cannot read {label or source}: {exc}") from exc
    mono = data.mean(axis=1).astype(np.float32)
    if rate != RATE_HZ:
        import soxr

        mono = soxr.resample(mono, rate, RATE_HZ).astype(np.float32)
    return np.ascontiguousarray(mono)


def measure(audio: npt.NDArray[np.float32]) -> ReferenceStats:
    if not len(audio):
        return ReferenceStats(0.0, 0.0, 0.0)
    rms = float(np.sqrt(np.mean(np.square(audio, dtype=np.float64))))
    return ReferenceStats(len(audio) / RATE_HZ, rms, float(np.mean(np.abs(audio) >= CLIP_LEVEL)))


def check_audio(audio: npt.NDArray[np.float32], force: bool) -> list[str]:
    """Warnings about ``audio``; VoiceEditError (a ConfigError) for a length outside 3-30 s unless ``force``."""
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
        warnings.append(f"the recording is (nearly) silent (RMS {stats.rms:.4f})")
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


def _check_name(name: str) -> None:
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
    _check_name(name)
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
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        staging.rename(target)
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
    _check_name(new_name)
    source = root / name
    if not valid_name(name) or not (source.exists() or source.is_symlink()):
        raise VoiceEditError("voice_not_found", f"no voice {name!r} in {root}")
    if new_name == name:
        return
    taken = next((e for e in os.listdir(root) if e.lower() == new_name.lower() and e != name), None)
    if taken is not None:
        raise VoiceEditError("name_taken", f"voice {new_name!r} exists in {root} as {taken!r}")
    os.rename(source, root / new_name)


def cmd_add(args: argparse.Namespace) -> int:
    name: str = args.name
    _check_name(name)
    if args.ref_audio is None and not args.instruct:
        raise ConfigError("a voice needs --ref-audio (Base models) or --instruct (VoiceDesign models)")
    root = voices_dir(args)
    audio = None
    try:
        if args.ref_audio is not None:
            audio = read_audio(Path(args.ref_audio))
            for warning in check_audio(audio, args.force):
                print(f"warning: {warning}", file=sys.stderr)
        add_voice(
            root,
            name,
            audio=audio,
            ref_text=args.ref_text,
            instruct=args.instruct,
            language=args.language,
            description=args.description,
            replace=args.force,
        )
    except VoiceEditError as exc:
        hint = FORCE_HINTS.get(exc.code)
        if hint is None:
            raise
        raise ConfigError(f"{exc} ({hint})") from exc
    print(f"added {name} ({_describe(root, name)}) in {root}")
    return EXIT_OK


def _describe(root: Path, name: str) -> str:
    voice = read_voice(root, name)
    if voice is None:
        return "unreadable"
    parts = [str(k) for k in voice.kinds]
    if voice.ref_audio is not None:
        import soundfile

        try:
            parts.append(f"{soundfile.info(str(voice.ref_audio)).duration:.1f} s")
        except (soundfile.LibsndfileError, RuntimeError, OSError):
            parts.append("ref.wav unreadable")
        parts.append("with transcript" if voice.ref_text else "no transcript: speaker embedding only")
    if voice.language:
        parts.append(voice.language)
    return ", ".join(parts)


def cmd_list(args: argparse.Namespace) -> int:
    root = voices_dir(args)
    names = sorted(e.name for e in root.iterdir() if e.is_dir() and valid_name(e.name)) if root.is_dir() else []
    if not names:
        print(f"no voices in {root}")
        return EXIT_OK
    for name in names:
        print(f"{name}\t{_describe(root, name)}")
    return EXIT_OK


def cmd_remove(args: argparse.Namespace) -> int:
    root = voices_dir(args)
    try:
        remove_voice(root, args.name)
    except VoiceEditError as exc:
        print(f"s2s-daemon: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"removed {args.name} from {root}")
    return EXIT_OK


def cmd_rename(args: argparse.Namespace) -> int:
    root = voices_dir(args)
    try:
        rename_voice(root, args.name, args.new_name)
    except VoiceEditError as exc:
        print(f"s2s-daemon: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"renamed {args.name} to {args.new_name} in {root}")
    return EXIT_OK


def add_parser(subparsers: Any) -> None:
    """Register ``s2s-daemon voices`` on an argparse subparsers object."""
    parser = subparsers.add_parser("voices", help="the library of cloned and designed voices (tts.voices_dir)")
    actions = parser.add_subparsers(dest="voices_action", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-c", "--config", help="YAML configuration file (its tts.voices_dir)")
        p.add_argument("--dir", help="the voices folder (default: tts.voices_dir)")

    listing = actions.add_parser("list", help="the voices and their kind")
    common(listing)
    listing.set_defaults(func=cmd_list)
    add = actions.add_parser("add", help="add (or with --force replace) a voice")
    add.add_argument("name")
    add.add_argument("--ref-audio", help="reference recording, 3-30 s (WAV, FLAC, OGG, MP3): a cloned voice")
    add.add_argument("--ref-text", help="transcript of the recording (better clones)")
    add.add_argument("--instruct", help="voice description: a designed voice (VoiceDesign models)")
    add.add_argument("--language", help="language spoken when a request says auto")
    add.add_argument("--description", help="a note for people")
    add.add_argument("--force", action="store_true", help="replace an existing voice; accept any length")
    common(add)
    add.set_defaults(func=cmd_add)
    remove = actions.add_parser("remove", help="remove a voice")
    remove.add_argument("name")
    common(remove)
    remove.set_defaults(func=cmd_remove)
    rename = actions.add_parser("rename", help="rename a voice")
    rename.add_argument("name")
    rename.add_argument("new_name", metavar="NEW")
    common(rename)
    rename.set_defaults(func=cmd_rename)
