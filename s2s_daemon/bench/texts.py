"""The texts a benchmark synthesizes: a built-in multilingual set or a file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SHORT_MAX_CHARS = 40
"""Texts up to this many characters count as short."""
MEDIUM_MAX_CHARS = 140
"""Texts up to this many characters (and above ``SHORT_MAX_CHARS``) count as medium."""


@dataclass(frozen=True, slots=True)
class BenchText:
    """One utterance of the benchmark."""

    text: str
    language: str
    """Language name (``english``, ``german``...) or ``auto``; mapped onto the engine's spelling."""
    size: str
    """``short``, ``medium`` or ``long`` (by character count)."""


def size_of(text: str) -> str:
    n = len(text)
    if n <= SHORT_MAX_CHARS:
        return "short"
    if n <= MEDIUM_MAX_CHARS:
        return "medium"
    return "long"


_BUILTIN: tuple[tuple[str, str], ...] = (
    ("english", "The kettle is boiling."),
    ("chinese", "今天下午三点开会，请准时参加。"),  # noqa: RUF001  (Chinese punctuation on purpose)
    ("german", "Die Waschmaschine ist fertig, bitte die Wäsche aufhängen, bevor sie anfängt zu riechen."),
    ("english", "Your next appointment is at half past four with Doctor Patel, and the traffic on the way is light."),
    (
        "english",
        "Good morning. It is seven fifteen, the outside temperature is twelve degrees and rising, "
        "there is a forty percent chance of rain after lunch, and your first meeting moved to ten o'clock, "
        "so you have time for a proper breakfast.",
    ),
    (
        "french",
        "Bonsoir. Le dernier train pour Lyon part à vingt-deux heures dix du quai numéro trois. "
        "En raison de travaux, il s'arrêtera exceptionnellement à Mâcon, où un autocar assurera "
        "la correspondance jusqu'à la gare de Perrache.",
    ),
)


def builtin_texts() -> tuple[BenchText, ...]:
    """Two short, two medium and two long sentences in English, Chinese, German and French."""
    return tuple(BenchText(text, lang, size_of(text)) for lang, text in _BUILTIN)


def load_texts(spec: str) -> tuple[BenchText, ...]:
    """Resolve ``--texts``: ``builtin``, ``short``/``medium``/``long`` (comma-separated), or a file.

    A file holds one utterance per line; a line ``language<TAB>text`` names its language,
    a plain line means ``auto``. Blank lines and lines starting with ``#`` are skipped.
    """
    sizes = {part.strip() for part in spec.split(",")}
    if spec == "builtin":
        return builtin_texts()
    if sizes <= {"short", "medium", "long"}:
        return tuple(t for t in builtin_texts() if t.size in sizes)
    path = Path(spec)
    if not path.is_file():
        msg = f"--texts {spec!r}: not 'builtin', a size (short, medium, long) or a readable file"
        raise ValueError(msg)
    texts: list[BenchText] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        language, sep, text = line.partition("\t")
        if not sep:
            language, text = "auto", line
        text = text.strip()
        if text:
            texts.append(BenchText(text, language.strip().lower() or "auto", size_of(text)))
    if not texts:
        msg = f"--texts {spec!r}: the file holds no text"
        raise ValueError(msg)
    return tuple(texts)
