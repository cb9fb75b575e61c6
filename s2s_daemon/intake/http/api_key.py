"""The speech API's bearer token (``http.api_key_file``): read, checked, and who else may read it."""

from __future__ import annotations

import stat
from pathlib import Path

from s2s_daemon.errors import ConfigError

MIN_API_KEY_CHARS = 16
"""A shorter bearer token is refused: a few characters are guessed in minutes over loopback."""


def read_api_key(path: Path) -> str:
    """The bearer token in ``path`` (``http.api_key_file``); ConfigError (exit 78) naming the key
    when it cannot be read, is empty or is shorter than ``MIN_API_KEY_CHARS``."""
    try:
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"http.api_key_file: cannot read {path}: {why}") from exc
    if not key:
        raise ConfigError(f"http.api_key_file: {path} is empty")
    if len(key) < MIN_API_KEY_CHARS:
        raise ConfigError(
            f"http.api_key_file: the key in {path} is {len(key)} characters; use at least {MIN_API_KEY_CHARS}"
            " (openssl rand -hex 16 makes one)"
        )
    return key


def key_file_exposure(path: Path) -> str | None:
    """Who else may read the key file (``group``, ``others``), as its mode says; None when only its owner."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    readers = [who for who, bit in (("group", stat.S_IRGRP), ("others", stat.S_IROTH)) if mode & bit]
    return " and ".join(readers) or None
