"""Language names and aliases, voice matching, text checks shared by every engine."""

from __future__ import annotations

from s2s_daemon.tts.engine import UnknownVoiceError, UnsupportedLanguageError

LANGUAGE_ALIASES: dict[str, str] = {
    "auto": "auto",
    "zh": "chinese", "zh-cn": "chinese", "zh-hans": "chinese", "cmn": "chinese", "mandarin": "chinese",
    "en": "english", "en-us": "english", "en-gb": "english",
    "ja": "japanese", "ja-jp": "japanese", "jp": "japanese",
    "ko": "korean", "ko-kr": "korean",
    "de": "german", "de-de": "german",
    "fr": "french", "fr-fr": "french",
    "ru": "russian", "ru-ru": "russian",
    "pt": "portuguese", "pt-br": "portuguese", "pt-pt": "portuguese",
    "es": "spanish", "es-es": "spanish", "es-mx": "spanish",
    "it": "italian", "it-it": "italian",
}  # fmt: skip


def normalize_language(value: str | None, supported: tuple[str, ...]) -> str:
    """Map ``en``, ``zh-CN``, ``English``... onto a canonical name the engine supports."""
    if value is None or not value.strip():
        return "auto"
    key = value.strip().lower().replace("_", "-")
    canonical = LANGUAGE_ALIASES.get(key, key)
    lowered = {lang.lower(): lang for lang in supported}
    if canonical in lowered:
        return lowered[canonical]
    raise UnsupportedLanguageError(f"language {value!r} is not supported; choose one of {', '.join(supported)}")


def match_voice(value: str | None, voices: tuple[str, ...], default: str | None) -> str | None:
    """Case-insensitive match against the engine's preset voices; None picks the default."""
    wanted = value if value is not None and value.strip() else default
    if not voices:
        if value is not None and value.strip():
            raise UnknownVoiceError(f"voice {value!r}: this model has no preset voices")
        return None
    if wanted is None:
        return voices[0]
    lowered = {v.lower(): v for v in voices}
    found = lowered.get(wanted.strip().lower())
    if found is None:
        raise UnknownVoiceError(f"voice {wanted!r} is unknown; choose one of {', '.join(voices)}")
    return found
