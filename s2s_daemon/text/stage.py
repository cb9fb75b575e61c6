# ruff: noqa: RUF001 -- full-width CJK marks are the point
"""The text stage: what was asked (an assistant's Markdown) in, what is spoken out.

One call per request with the whole text (``TextStage.prepare``), or one object per streamed text
(``TextStage.stream``: ``feed`` each delta, ``close`` at the end), each returning the text ready to
speak. Both read through the same path (``pieces.py`` cuts, ``markdown.py`` reads each piece, then
addresses, emoji and numbers), so a text streamed in any deltas is spoken as the whole text is.
Blocks (paragraphs, headings, list items, table rows, code notes) end with a full stop and go on a
line of their own; after a CJK full stop the next one follows without a space (``pipeline/segment.py``
cuts a CJK sentence only before a character). Never raises on any text; each piece's result is
bounded (``MAX_GROWTH``) and each pass is linear, so the whole is linear in the text's length.
Its cost per sentence: ``scripts/bench_text.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from s2s_daemon.config import TextConfig
from s2s_daemon.text.emoji_words import drop_emoji, name_emoji
from s2s_daemon.text.languages import CODE_NOTE, guess_language, is_cjk, language_code
from s2s_daemon.text.links import read_addresses
from s2s_daemon.text.markdown import CODE_END, CODE_START, CONTINUED, LINE_BREAK, render
from s2s_daemon.text.numbers import rewrite_numbers
from s2s_daemon.text.options import TextOptions, TextOverrides
from s2s_daemon.text.pieces import Piece, PieceSplitter

MAX_GROWTH = 16
"""A piece's spoken text is at most this many times its source, plus ``MAX_GROWTH_CHARS``."""
MAX_GROWTH_CHARS = 64

_CONTROL = re.compile(
    r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]"
)
"""Control and invisible format characters (not the joiner inside emoji sequences)."""
_ENDS = ".!?\u2026。！？"
CJK_STOP = ("zh", "ja")
"""Languages whose blocks end with 。 (Korean ends with a full stop and spaces its words)."""
_CLOSERS = "\"')]»”’」』）"
_SOFT_ENDS = ",;:，；：、"
_MARKERS = re.compile(r"(?<![\w*_~])[*_~]+(?=\S)|(?<=\S)[*_~]+(?![\w*_~])|`+")
_PIPES = re.compile(r"\s*\|[\s|]*")
_SPACES = re.compile(r"[ \t\n\u00a0]+")
_TASK = re.compile(r"^\[[ xX]\]\s+")
_BEFORE_MARK = re.compile(r" +(?=[,.;:!?，。；：！？、](?:\s|$))")


@dataclass(frozen=True, slots=True)
class SpokenText:
    """What a request's text is spoken as."""

    text: str
    changed: bool
    """The stage changed more than white space and the full stop it ends a text with (the journal
    keeps what was asked)."""


class TextStage:
    """The ``text:`` section, built once; a request's ``prepare`` or ``stream`` call per request."""

    def __init__(self, section: TextConfig) -> None:
        self.options = TextOptions.from_config(section)

    def prepare(self, text: str, language: str | None = None, overrides: TextOverrides | None = None) -> SpokenText:
        return prepare_text(text, self.options.overridden(overrides), language)

    def stream(self, language: str | None = None, overrides: TextOverrides | None = None) -> StreamingTextStage:
        return StreamingTextStage(self.options.overridden(overrides), language)


def prepare_text(text: str, options: TextOptions, language: str | None = None) -> SpokenText:
    """``text`` as it is spoken (``language``: a code, a name, ``auto`` or None)."""
    stream = StreamingTextStage(options, language)
    spoken = stream.feed(text) + stream.close()
    return SpokenText(spoken, changed=_words(spoken) != _words(text))


def _words(text: str) -> list[str]:
    """The words of ``text``, but a full stop at its end (the stage ends every text with one)."""
    return text.rstrip().rstrip(".\u3002").split()


class StreamingTextStage:
    """One streamed text: ``feed`` each delta and speak what it returns; ``close`` returns the rest.

    Holds back at most the sentence being written (a table row or a code fence's line until it
    ends). What the calls return, joined, is what ``prepare_text`` returns for the whole text.
    """

    def __init__(self, options: TextOptions, language: str | None = None) -> None:
        self.options = options
        self.language = language_code(language)
        self._splitter = PieceSplitter(markdown=options.markdown)
        self._said = ""
        """The last character given out ("" before the first)."""
        self._owed = ""
        """White space owed before the next text: " " inside a block, "\\n" after one."""
        self._block_open = False
        """Text of the current block went out without its full stop."""
        self._words_language = self.language or "en"
        """The language of the words the stage adds (a code note, "dot"): the last one seen."""
        self._cr = False
        self._note_owed = False
        """A code block began: its note is said with its first line that is not blank."""

    def feed(self, delta: str) -> str:
        return self._emit(self._splitter.feed(self._clean(delta)))

    def close(self) -> str:
        tail = "\n" if self._cr else ""
        self._cr = False
        pieces = self._splitter.feed(tail) + self._splitter.close()
        out = self._emit(pieces)
        if self._block_open:
            out += self._full_stop()
            self._block_open = False
        return out

    def _clean(self, delta: str) -> str:
        if self._cr:
            delta = "\r" + delta
            self._cr = False
        if delta.endswith("\r"):
            self._cr = True
            delta = delta[:-1]
        if "\r" in delta:
            delta = delta.replace("\r\n", "\n").replace("\r", "\n")
        return _CONTROL.sub("", delta) if not delta.isascii() or not delta.isprintable() else delta

    # -- pieces -> text ---------------------------------------------------------------------

    def _emit(self, pieces: list[Piece]) -> str:
        out: list[str] = []
        for piece in pieces:
            blocks = self._blocks(piece)
            bound = MAX_GROWTH * len(piece.source) + MAX_GROWTH_CHARS
            for index, (text, cjk) in enumerate(blocks):
                ends = piece.ends_block or index < len(blocks) - 1
                if text:
                    out.append(self._join(text[:bound], ends, cjk))
                elif ends and self._block_open:
                    out.append(self._full_stop())
                if ends:
                    self._block_open = False
                    self._owed = "\n"
        return "".join(out)

    def _join(self, text: str, ends: bool, cjk: bool) -> str:
        if ends and self.options.markdown:  # without Markdown the text is read as written
            text = _with_full_stop(text, cjk or is_cjk(text[-1]))
        if not self._said:
            owed = ""
        elif self._owed == "\n":
            owed = "" if self._said in "。！？" else "\n"  # segment.py cuts 。 only before a character
        else:
            owed = "" if is_cjk(self._said) and is_cjk(text[0]) else " "
        self._said = text[-1]
        self._owed = "\n" if ends else " "
        self._block_open = not ends
        return owed + text

    def _full_stop(self) -> str:
        if not self._said or self._said in _ENDS + _CLOSERS or not self.options.markdown:
            return ""
        stop = "。" if is_cjk(self._said) else "."
        self._said = stop
        return stop

    def _blocks(self, piece: Piece) -> list[tuple[str, bool]]:
        """Each block of ``piece``: its spoken text ("" for nothing to say), and whether it ends
        with a CJK full stop (Chinese and Japanese)."""
        options = self.options
        if piece.kind == "code_start":
            self._note_owed = options.code_blocks == "skip"  # said with the block's first line
            return []
        if piece.kind == "code":
            if self._note_owed and piece.source.strip():
                self._note_owed = False
                return [(CODE_NOTE[self._words_language], self._words_language in CJK_STOP)]
            return [(_tidy(piece.source), False)] if options.code_blocks == "read" else []
        self._note_owed = False
        if not options.markdown:
            return [self._spoken(piece.source)]
        source = (CONTINUED + piece.source) if piece.continued else piece.source
        if piece.table_head:
            return [self._spoken(block) for block in render(f"{piece.table_head}\n{source}", table_body=True)]
        return [self._spoken(block) for block in render(source)]

    def _spoken(self, block: str) -> tuple[str, bool]:
        """One block's text after Markdown: addresses, emoji, numbers, then white space."""
        language = self.language or guess_language(block)
        if language is not None:
            self._words_language = language
        words_language = language or self._words_language
        parts = re.split(f"({CODE_START}[^{CODE_END}]*{CODE_END})", block) if CODE_START in block else [block]
        spoken: list[str] = []
        for part in parts:
            if part.startswith(CODE_START):
                spoken.append(part[1:-1])
                continue
            if self.options.markdown:
                part = _PIPES.sub(", ", _MARKERS.sub("", part)) if "|" in part else _MARKERS.sub("", part)
            if self.options.urls:
                part = read_addresses(part, words_language)
            if self.options.emoji == "drop":
                part = drop_emoji(part)
            elif self.options.emoji == "name":
                part = name_emoji(part, words_language)
            if self.options.numbers != "off" and language is not None:
                part = rewrite_numbers(part, language, self.options.numbers)
            spoken.append(part)
        text = _line_breaks("".join(spoken))
        text = _TASK.sub("", _tidy(text))
        text = text.strip(" ,")
        if not (any(c.isalnum() for c in text) or (self.options.emoji == "keep" and not text.isascii())):
            text = ""
        return text, words_language in CJK_STOP


def _tidy(text: str) -> str:
    """White space runs as one space, none before punctuation (where a dropped emoji was)."""
    return _BEFORE_MARK.sub("", _SPACES.sub(" ", text)).strip()


def _line_breaks(text: str) -> str:
    """A line break inside a block: a space after punctuation or before a lower-case word, else
    the end of a sentence (a line of its own, as an assistant writes a short list)."""
    if LINE_BREAK not in text:
        return text
    parts = text.split(LINE_BREAK)
    out = parts[0].rstrip()
    for part in parts[1:]:
        nxt = part.lstrip()
        if not nxt:
            continue
        if not out:
            out = nxt
            continue
        last, first = out[-1], nxt[0]
        cjk = is_cjk(last)
        space = "" if cjk and is_cjk(first) else " "
        if last in _ENDS + _CLOSERS + _SOFT_ENDS or first.islower():
            out += space + nxt
        else:
            out += ("。" if cjk else ".") + space + nxt
    return out


def _with_full_stop(text: str, cjk: bool) -> str:
    """``text`` ending a block: with a full stop (``cjk``: 。) unless it ends with one; a colon,
    comma or semicolon at its end becomes one."""
    text = text.rstrip()
    core = text.rstrip(_CLOSERS)
    if core and core[-1] in _ENDS:
        return text
    if core and core[-1] in _SOFT_ENDS and core == text:
        text = text[:-1]
    return text + ("。" if cjk else ".")
