"""``s2s-daemon voices list | add NAME --ref-audio FILE [--ref-text T] [--instruct T] | rename NAME NEW
| remove NAME``: the library edits of ``pipeline.voice_edits`` (the web page's voice endpoints call the same).

``add`` reads what libsndfile reads (WAV, FLAC, OGG, MP3 with libsndfile >= 1.1), mixes to mono,
resamples to 24 kHz (soxr) and writes ``ref.wav`` as 16-bit PCM; it refuses a recording shorter
than 3 s or longer than 30 s, or a silent one (``--force`` takes it anyway), and warns about clipping.
Exit status: 66 for a file that is not there, 65 for one that is no usable recording, 64 for a bad
name or a voice that exists, 1 for a voice that is not there; a hint when the configured model
cannot speak the voice added.
The running daemon reads a voice's folder on every request that names it: no reload needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from s2s_daemon.config import DaemonConfig, load_config
from s2s_daemon.errors import EXIT_FAILURE, EXIT_OK, ConfigError, UsageError
from s2s_daemon.pipeline.voice_edits import (
    VoiceEditError,
    add_voice,
    check_audio,
    check_name,
    read_audio,
    remove_voice,
    rename_voice,
)
from s2s_daemon.pipeline.voices import default_voices_dir, read_voice, valid_name

FORCE_HINTS = {
    "reference_length": "--force takes it anyway",
    "silent_reference": "--force takes it anyway",
    "voice_exists": "--force replaces it",
}


def _config(args: argparse.Namespace) -> DaemonConfig:
    raw = args.config or os.environ.get("S2S_CONFIG")
    return load_config(Path(raw) if raw else None, dict(os.environ))


def voices_dir(args: argparse.Namespace) -> Path:
    if args.dir is not None:
        return Path(args.dir)
    return _config(args).tts.voices_dir or default_voices_dir()


def cmd_add(args: argparse.Namespace) -> int:
    name: str = args.name
    check_name(name)
    if args.ref_audio is None and not args.instruct:
        raise UsageError("a voice needs --ref-audio (Base models) or --instruct (VoiceDesign models)")
    root = voices_dir(args)
    audio = None
    try:
        if args.ref_audio is not None:
            audio = read_audio(Path(args.ref_audio), label=f"--ref-audio {args.ref_audio}")
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
        raise VoiceEditError(exc.code, f"{exc} ({hint})") from exc
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
