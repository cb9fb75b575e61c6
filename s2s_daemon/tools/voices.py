"""``s2s-daemon voices list | add NAME --ref-audio FILE [--ref-text T] [--instruct T] | remove NAME``.

``add`` reads what libsndfile reads (WAV, FLAC, OGG, MP3 with libsndfile >= 1.1), mixes to mono,
resamples to 24 kHz (soxr) and writes ``ref.wav`` as 16-bit PCM; it refuses a recording shorter
than 3 s or longer than 30 s (``--force`` takes it anyway) and warns about clipping and silence.
The running daemon reads a voice's folder on every request that names it: no reload needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from s2s_daemon.config import DaemonConfig, load_config
from s2s_daemon.errors import EXIT_FAILURE, EXIT_OK, ConfigError, DataError, NoInputError, UsageError
from s2s_daemon.pipeline.voices import INSTRUCT, META, REF_AUDIO, REF_TEXT, default_voices_dir, read_voice, valid_name

RATE_HZ = 24000
MIN_S = 3.0
MAX_S = 30.0
CLIP_LEVEL = 0.999
CLIP_SHARE = 0.001
"""More than this share of samples at full scale: clipped."""
SILENCE_RMS = 0.003
"""Below this RMS (about -50 dBFS) the recording is taken for silence."""


def _config(args: argparse.Namespace) -> DaemonConfig:
    raw = args.config or os.environ.get("S2S_CONFIG")
    return load_config(Path(raw) if raw else None, dict(os.environ))


def voices_dir(args: argparse.Namespace) -> Path:
    if args.dir is not None:
        return Path(args.dir)
    return _config(args).tts.voices_dir or default_voices_dir()


def read_audio(path: Path) -> npt.NDArray[np.float32]:
    """Any file libsndfile reads, as mono float32 at 24 kHz."""
    import soundfile

    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise NoInputError(f"--ref-audio {path}: {exc.strerror or exc}") from exc
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, OSError) as exc:
        why = getattr(exc, "error_string", None) or str(exc)
        raise DataError(f"--ref-audio {path}: not a recording this can read (WAV, FLAC, OGG, MP3): {why}") from exc
    mono = data.mean(axis=1).astype(np.float32)
    if rate != RATE_HZ:
        import soxr

        mono = soxr.resample(mono, rate, RATE_HZ).astype(np.float32)
    return np.ascontiguousarray(mono)


def check_audio(audio: npt.NDArray[np.float32], force: bool) -> list[str]:
    """Warnings about ``audio``; ``DataError`` for a length outside 3-30 s or a silent recording
    (nothing to clone) unless ``force``."""
    seconds = len(audio) / RATE_HZ
    if not MIN_S <= seconds <= MAX_S and not force:
        raise DataError(f"the recording is {seconds:.1f} s; a reference should be {MIN_S:g}-{MAX_S:g} s (--force)")
    warnings = []
    if len(audio) and float(np.mean(np.abs(audio) >= CLIP_LEVEL)) > CLIP_SHARE:
        warnings.append("the recording is clipped (samples at full scale): the clone copies the distortion")
    rms = float(np.sqrt(np.mean(np.square(audio, dtype=np.float64)))) if len(audio) else 0.0
    if rms < SILENCE_RMS:
        silent = f"the recording is (nearly) silent (RMS {rms:.4f}, below {SILENCE_RMS:g}): there is no voice to clone"
        if not force:
            raise DataError(f"{silent}; check the microphone and the file (--force takes it anyway)")
        warnings.append(silent)
    return warnings


def write_wav(path: Path, audio: npt.NDArray[np.float32]) -> None:
    import soundfile

    soundfile.write(str(path), np.clip(audio, -1.0, 1.0), RATE_HZ, subtype="PCM_16", format="WAV")


def cmd_add(args: argparse.Namespace) -> int:
    name: str = args.name
    if not valid_name(name):
        raise UsageError(f"voice name {name!r}: use letters, digits, '-' and '_' only (at most 64)")
    if args.ref_audio is None and not args.instruct:
        raise UsageError("a voice needs --ref-audio (Base models) or --instruct (VoiceDesign models)")
    root = voices_dir(args)
    target = root / name
    if target.exists() and not args.force:
        raise UsageError(f"voice {name!r} exists in {root} (--force replaces it)")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    try:
        if args.ref_audio is not None:
            audio = read_audio(Path(args.ref_audio))
            for warning in check_audio(audio, args.force):
                print(f"warning: {warning}", file=sys.stderr)
            write_wav(staging / REF_AUDIO, audio)
        for file, text in ((REF_TEXT, args.ref_text), (INSTRUCT, args.instruct)):
            if text:
                (staging / file).write_text(text.strip() + "\n", encoding="utf-8")
        if args.language or args.description:
            import yaml

            meta = {k: v for k, v in (("language", args.language), ("description", args.description)) if v}
            (staging / META).write_text(yaml.safe_dump(meta, allow_unicode=True), encoding="utf-8")
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(f"added {name} ({_describe(root, name)}) in {root}")
    if (hint := _model_hint(args, "design" if args.ref_audio is None else "clone")) is not None:
        print(f"note: {hint}", file=sys.stderr)
    return EXIT_OK


MODE_OF_ID = re.compile(r"-(Base|CustomVoice|VoiceDesign)(?:-[\w.]+)?$", re.IGNORECASE)
"""The kind of a hub model from its id (``Qwen/Qwen3-TTS-12Hz-0.6B-Base``, mlx-community's ``...-Base-6bit``)."""
MODE_NAMES = {"base": "base", "customvoice": "custom_voice", "voicedesign": "voice_design"}
SPEAKS = {
    "clone": ("base", "a Base model (tts.model: Qwen/Qwen3-TTS-12Hz-0.6B-Base)"),
    "design": (
        "voice_design",
        "a VoiceDesign model (tts.model: Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign)",
    ),
}


def model_mode(model: str) -> str | None:
    """``base``, ``custom_voice`` or ``voice_design`` for a local checkpoint or an official hub id;
    None when it cannot be told without loading it."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        try:
            raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        mode = raw.get("tts_model_type") if isinstance(raw, dict) else None
        return str(mode) if mode else "custom_voice"
    match = MODE_OF_ID.search(model)
    return MODE_NAMES[match.group(1).lower()] if match else None


def _model_hint(args: argparse.Namespace, kind: str) -> str | None:
    """What to change when the configured model cannot speak a voice of ``kind``."""
    try:
        config = _config(args)
    except ConfigError:
        return None
    mode = model_mode(config.tts.model)
    needed, which = SPEAKS[kind]
    if mode is None or mode == needed:
        return None
    return f"the configured model ({config.tts.model}) is a {mode} model: it cannot speak a {kind} voice; {which} can"


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
    name: str = args.name
    root = voices_dir(args)
    target = root / name
    if not valid_name(name) or not (target.exists() or target.is_symlink()):
        print(f"s2s-daemon: no voice {name!r} in {root}", file=sys.stderr)
        return EXIT_FAILURE
    if target.is_symlink() or not target.is_dir():
        target.unlink()  # a link is removed, never what it points to
    else:
        shutil.rmtree(target)
    print(f"removed {name} from {root}")
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
