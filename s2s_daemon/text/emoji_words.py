"""Emoji left out or said by their name in the request's language (the ``emoji`` package's CLDR
names); a run of the same emoji is named once. The package and its tables are imported by the
first text that is not ASCII: an ASCII text has no emoji."""

from __future__ import annotations

from s2s_daemon.text.languages import CJK


def drop_emoji(text: str) -> str:
    """``text`` without its emoji."""
    if text.isascii():
        return text
    import emoji

    return emoji.replace_emoji(text, "")


def name_emoji(text: str, language: str | None) -> str:
    """``text`` with each emoji replaced by its name (English where the language is unknown)."""
    if text.isascii():
        return text
    import emoji

    found = emoji.emoji_list(text)
    if not found:
        return text
    lang = language or "en"
    pieces: list[str] = []
    at = 0
    last = ""
    for item in found:
        start, end, char = item["match_start"], item["match_end"], item["emoji"]
        between = text[at:start]
        if char == last and not between.strip():
            at = end
            continue  # the same emoji again: named once
        name = emoji.demojize(char, language=lang, delimiters=("", "")).replace("_", " ")
        pad = "" if lang in CJK else " "
        pieces.append(f"{between}{pad}{name}{pad}")
        at = end
        last = char
    pieces.append(text[at:])
    return "".join(pieces)
