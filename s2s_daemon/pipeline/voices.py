"""The voice library: named cloned and designed voices, one folder each under ``tts.voices_dir``.

```
<voices_dir>/<name>/ref.wav       reference recording (Base models: a cloned voice)
                    ref.txt       its transcript (without it: speaker-embedding-only cloning)
                    instruct.txt  a voice description (VoiceDesign models: a designed voice)
                    voice.yaml    optional: {language, description}
```

A request names a voice; it never carries a path. Names are ``[A-Za-z0-9_-]+`` and matched
without regard to case; a voice whose folder or files resolve (through symlinks) outside
``voices_dir`` is refused as if it did not exist. Every lookup reads the voice's folder afresh, so
voices added, changed or removed while the daemon runs are seen by the next request.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import structlog
import yaml

from s2s_daemon.pipeline.vocabulary import UnknownVoiceError

log = structlog.get_logger(__name__)

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What a library voice may be called."""
REF_AUDIO = "ref.wav"
REF_TEXT = "ref.txt"
INSTRUCT = "instruct.txt"
META = "voice.yaml"
MAX_TEXT_BYTES = 64 * 1024
"""Longer transcripts, instructions or metadata are refused."""


class VoiceKind(StrEnum):
    PRESET = "preset"
    """A speaker built into the model (CustomVoice)."""
    CLONE = "clone"
    """A library voice cloned from ``ref.wav`` (Base models)."""
    DESIGN = "design"
    """A library voice described by ``instruct.txt`` (VoiceDesign models)."""


MODE_KIND = {"base": VoiceKind.CLONE, "voice_design": VoiceKind.DESIGN}
"""The library voices each model mode can speak."""


def default_voices_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_DATA_HOME/s2s-daemon/voices``, else ``~/.local/share/s2s-daemon/voices``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "s2s-daemon" / "voices"


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/s2s-daemon/voices``, else ``~/.cache/s2s-daemon/voices`` (computed clone prompts)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "s2s-daemon" / "voices"


def valid_name(name: str) -> bool:
    return NAME.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class LibraryVoice:
    """One voice folder as read just now."""

    name: str
    """The folder's own spelling."""
    ref_audio: Path | None
    ref_text: str | None
    instruct: str | None
    language: str | None = None
    """From ``voice.yaml``: spoken when a request says ``auto``."""
    description: str | None = None

    @property
    def kinds(self) -> tuple[VoiceKind, ...]:
        found = []
        if self.ref_audio is not None:
            found.append(VoiceKind.CLONE)
        if self.instruct is not None:
            found.append(VoiceKind.DESIGN)
        return tuple(found)


@contextlib.contextmanager
def pinned(recording: Path) -> Iterator[Path]:
    """A private copy of a voice's recording while one request speaks it: renaming, replacing or
    removing the voice meanwhile (the web page, ``voices rename``) cannot fail the request's later
    sentences. A hard link where the file system allows, else a copy, in a folder named like the
    voice's own (``.../alice/ref.wav``); removed afterwards. ``FileNotFoundError`` when the recording
    is already gone."""
    folder = Path(tempfile.mkdtemp(prefix="s2s-voice-"))
    try:
        (folder / recording.parent.name).mkdir()
        copy = folder / recording.parent.name / recording.name
        try:
            os.link(recording, copy)
        except FileNotFoundError:
            raise
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(recording, copy)
        yield copy
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve(strict=True).is_relative_to(root)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        return False


def _read_text(path: Path) -> str | None:
    if path.stat().st_size > MAX_TEXT_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_TEXT_BYTES} bytes")
    text = path.read_text(encoding="utf-8").strip()
    return text or None


def read_voice(root: Path, name: str) -> LibraryVoice | None:
    """The voice ``name`` (exact spelling) under ``root``; None when absent, misnamed or leading outside."""
    if not valid_name(name):
        return None
    try:
        real_root = root.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    folder = root / name
    if not folder.is_dir():
        return None
    if not _inside(folder, real_root):
        log.warning("voice_refused", voice=name, reason="its folder leads outside the voices folder")
        return None
    files = {}
    for file in (REF_AUDIO, REF_TEXT, INSTRUCT, META):
        path = folder / file
        if not (path.exists() or path.is_symlink()):
            continue
        if not _inside(path, real_root) or not path.is_file():
            log.warning("voice_refused", voice=name, file=file, reason="not a file inside the voices folder")
            return None
        files[file] = path
    try:
        ref_text = _read_text(files[REF_TEXT]) if REF_TEXT in files else None
        instruct = _read_text(files[INSTRUCT]) if INSTRUCT in files else None
        meta = yaml.safe_load(_read_text(files[META]) or "") if META in files else None
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        log.warning("voice_unreadable", voice=name, error=str(exc))
        return None
    meta = meta if isinstance(meta, dict) else {}
    language, description = meta.get("language"), meta.get("description")
    return LibraryVoice(
        name=name,
        ref_audio=files.get(REF_AUDIO),
        ref_text=ref_text,
        instruct=instruct,
        language=language if isinstance(language, str) and language.strip() else None,
        description=description if isinstance(description, str) else None,
    )


class VoiceLibrary:
    """The voices under ``root`` a model of ``mode`` can speak. Does no I/O until asked."""

    def __init__(self, root: Path, mode: str) -> None:
        self.root = root
        self.mode = mode
        self.kind = MODE_KIND.get(mode)
        """What this model speaks from the library: clone (Base), design (VoiceDesign) or nothing."""

    def folder_names(self) -> list[str]:
        """Every well-named folder, sorted (whether or not it is a usable voice)."""
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError:
            return []
        return [e.name for e in entries if valid_name(e.name) and e.is_dir()]

    def voices(self) -> list[LibraryVoice]:
        """Every readable voice, sorted by name (a fresh scan)."""
        return [v for name in self.folder_names() if (v := read_voice(self.root, name)) is not None]

    def names(self) -> dict[str, VoiceKind]:
        """The voices this model can speak, by name, with their kind (for ``info``)."""
        if self.kind is None:
            return {}
        return {v.name: self.kind for v in self.voices() if self.kind in v.kinds}

    def lookup(self, name: str) -> LibraryVoice | None:
        """The voice called ``name`` (any case) that this model can speak; None when there is none.

        Raises UnknownVoiceError for a voice that exists but is of the wrong kind for this model.
        """
        name = name.strip()
        if not valid_name(name):
            return None
        voice = read_voice(self.root, name)
        if voice is None:
            lowered = name.lower()
            spelled = next((n for n in self.folder_names() if n.lower() == lowered and n != name), None)
            voice = read_voice(self.root, spelled) if spelled is not None else None
        if voice is None:
            return None
        if self.kind is None or self.kind not in voice.kinds:
            has = "/".join(str(k) for k in voice.kinds) or "no"
            needs = {VoiceKind.CLONE: REF_AUDIO, VoiceKind.DESIGN: INSTRUCT}.get(self.kind) if self.kind else None
            what = f"it needs {needs}" if needs else "this model speaks only its preset voices"
            raise UnknownVoiceError(
                f"voice {voice.name!r} is a {has} voice; this {self.mode} model cannot speak it ({what})"
            )
        return voice
