"""``s2s-daemon voices list | add NAME --ref-audio FILE [--ref-text T] [--instruct T] | rename NAME NEW
| remove NAME``: the library edits of ``pipeline.voice_edits`` (the web page's voice endpoints call the same).

``add`` reads what libsndfile reads (WAV, FLAC, OGG, MP3 with libsndfile >= 1.1), mixes to mono,
resamples to 24 kHz (soxr) and writes ``ref.wav`` as 16-bit PCM; it refuses a recording shorter
than 3 s or longer than 30 s (``--force`` takes it anyway) and warns about clipping and silence.
The running daemon reads a voice's folder on every request that names it: no reload needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from s2s_daemon.config import load_config
from s2s_daemon.errors import EXIT_FAILURE, EXIT_OK, ConfigError
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

FORCE_HINTS = {"reference_length": "--force takes it anyway", "voice_exists": "--force replaces it"}


def voices_dir(args: argparse.Namespace) -> Path:
    if args.dir is not None:
        return Path(args.dir)
    raw = args.config or os.environ.get("S2S_CONFIG")
    config = load_config(Path(raw) if raw else None, dict(os.environ))
    return config.tts.voices_dir or default_voices_dir()


def cmd_add(args: argparse.Namespace) -> int:
    name: str = args.name
    check_name(name)
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
