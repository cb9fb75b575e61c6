# ruff: noqa: RUF002 -- full-width CJK marks are the point
"""Markdown that is still being written, cut into pieces that can be read on their own.

Text comes in as it is written (an LLM's deltas); a piece goes out as soon as nothing that follows
can change how it reads: at the end of a block (a blank line, a new list item, heading, fence or
rule, the end of a heading or of a table row), and inside a paragraph at each sentence end
(``.!?…`` before white space and a word that is not lower case, or ``。！？``) where no code span
or link is open. So the stage holds back at most the sentence being written; markdown-it then
reads each piece (``markdown.py``). A ``**`` opened before a cut and closed after it is left as
a stray marker on each side, which the stage drops: emphasis reads as its words either way.

Cuts depend only on the text, never on where the deltas fell: the whole text in one delta gives
the same pieces (the stage reads a whole text through this same path); so a table is one whose
header row starts with ``|`` (known at the line's start). Indentation and ``>`` quote marks at
the start of a line are dropped (a nested list item reads as an item; indented text is read, not
taken for code: only fenced code is code). A piece grows past ``MAX_PIECE`` characters only in a
table row or a line whose kind is not known yet; a paragraph without a sentence end is cut at a
space before it, so every pass over a piece is bounded and the whole is linear in the text's length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MAX_PIECE = 600
"""The longest run of a paragraph without a sentence end that is held (characters)."""

PieceKind = Literal["markdown", "code_start", "code"]


@dataclass(frozen=True, slots=True)
class Piece:
    """Text that reads on its own."""

    source: str
    kind: PieceKind = "markdown"
    ends_block: bool = True
    """The last piece of its block (a full stop follows it, and the next piece starts a new line)."""
    continued: bool = False
    """It continues a block whose start went out in an earlier piece."""
    table_head: str = ""
    """A table's header and delimiter rows, when the piece is one of its body rows."""


_LIST_ITEM = re.compile(r"(?:[-*+]|\d{1,9}[.)])(?:[ \t]|$)")
_HEADING = re.compile(r"#{1,6}(?:[ \t]|$)")
_RULE = re.compile(r"(?:(?:\*[ \t]*){3,}|(?:-[ \t]*){3,}|(?:_[ \t]*){3,}|(?:=[ \t]*){3,})")
_DELIMITER = re.compile(r"\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*")
_FENCE = re.compile(r"(`{3,}|~{3,})")
_SENTENCE_END = re.compile(
    r"[.!?\u2026]+[\"')\]\u00bb\u201d\u2019*_~]*(?=\s)|[\u3002\uff01\uff1f]+[\u300d\u300f\uff09\u201d\u2019*_~]*"
)
_LEAD = re.compile(r"[ \t]*(?:>[ \t]?)*[ \t]*")


class _Balance:
    """Whether a code span or a link is open, scanned once over a growing text."""

    __slots__ = ("brackets", "destination", "ticks")

    def __init__(self) -> None:
        self.ticks = 0
        """Length of the backtick run that opened a code span (0: none open)."""
        self.brackets = 0
        self.destination = 0
        """Open parentheses of a link destination."""

    @property
    def closed(self) -> bool:
        return not (self.ticks or self.brackets or self.destination)

    def scan(self, text: str, start: int, end: int) -> None:
        i = start
        while i < end:
            char = text[i]
            if char == "`":
                run = i
                while i < end and text[i] == "`":
                    i += 1
                length = i - run
                if not self.ticks:
                    self.ticks = length
                elif self.ticks == length:
                    self.ticks = 0
                continue
            if not self.ticks:
                if char == "\\":
                    i += 2
                    continue
                if self.destination:
                    self.destination += (char == "(") - (char == ")")
                elif char == "[":
                    self.brackets += 1
                elif char == "]" and self.brackets:
                    self.brackets -= 1
                    if i + 1 < end and text[i + 1] == "(":
                        self.destination = 1
                        i += 1
            i += 1


class PieceSplitter:
    """Text in (``feed``, then ``close``), pieces out; ``markdown`` False: blank lines and sentences only."""

    def __init__(self, *, markdown: bool = True) -> None:
        self._markdown = markdown
        self._raw = ""
        self._pos = 0
        """Input not taken yet is ``_raw[_pos:]``: the start of the next line, or the rest of the current one."""
        self._mid_line = False
        self._block = ""
        """The current block's source not sent yet (at most a sentence, or ``MAX_PIECE``, but when held)."""
        self._sent_in_block = False
        self._line_start = 0
        """Where the current line starts in ``_block``."""
        self._line_pipe = False
        """The current line starts with ``|``: it may be a table's header (no cut inside it)."""
        self._hold: int | None = None
        """No cut at or after this index: a line with ``|`` that may be a table's header."""
        self._heading = False
        self._fence: str | None = None
        self._fence_mid = False
        self._table_head = ""
        self._scanned = 0
        self._balance = _Balance()
        self._closed = False

    def feed(self, text: str) -> list[Piece]:
        self._raw = self._raw[self._pos :] + text if self._pos else self._raw + text
        self._pos = 0
        return self._pump()

    def close(self) -> list[Piece]:
        self._closed = True
        out = self._pump()
        self._flush(out)
        self._fence = None
        return out

    # -- lines ------------------------------------------------------------------------------

    def _pump(self) -> list[Piece]:
        out: list[Piece] = []
        while self._pos < len(self._raw) or (self._mid_line and self._closed):
            if self._fence is not None:
                if not self._code_line(out):
                    break
            elif self._mid_line:
                self._rest_of_line(out)
                if self._mid_line and not self._closed:
                    break
            elif not self._line_start_(out):
                break
        return out

    def _rest_of_line(self, out: list[Piece]) -> None:
        """Take the current line's text, ``MAX_PIECE`` at a time (cuts keep the block short)."""
        newline = self._raw.find("\n", self._pos)
        end = len(self._raw) if newline < 0 else newline
        take = min(end, self._pos + MAX_PIECE)
        chunk = self._raw[self._pos : take]
        self._pos = take
        self._block += chunk
        self._cuts(out)  # whatever the deltas: the same cuts whether the line is complete or not
        if take < end or (newline < 0 and not self._closed):
            return
        if newline >= 0:
            self._pos = newline + 1
        self._mid_line = False
        self._line_ended(out)

    def _line_ended(self, out: list[Piece]) -> None:
        if self._heading:
            self._flush(out)
            return
        if self._line_pipe and self._hold is None:
            self._hold = self._line_start
        self._line_pipe = False
        self._cuts(out)

    def _line_start_(self, out: list[Piece]) -> bool:
        """Take the line at ``_pos`` when its kind is known; False: wait for more."""
        raw = self._raw
        newline = raw.find("\n", self._pos)
        complete = newline >= 0 or self._closed
        end = newline if newline >= 0 else len(raw)
        lead = _LEAD.match(raw, self._pos, end).end() - self._pos if self._markdown else 0  # type: ignore[union-attr]
        start = self._pos + lead
        if start == end or not raw[start:end].strip():
            if not complete:
                self._pos = start  # indentation and quote marks so far: dropped either way
                return False
            self._end_table()
            self._flush(out)
            self._pos = end + 1
            return True
        content = raw[start:end] if complete else raw[start : min(end, start + 64)]
        kind = self._kind(content, complete) if self._markdown else "text"
        if kind is None:
            return False
        if kind == "text" and self._table_head:
            if not complete:
                return False
            if "|" in content:
                out.append(Piece(content, table_head=self._table_head))
                self._pos = end + 1
                return True
            self._end_table()
        if kind == "text" and self._hold is not None:
            if not complete and not content.strip(" \t|:-"):
                return False  # may still be a delimiter row
            if complete and _DELIMITER.fullmatch(content.rstrip()):
                self._start_table(out, content.rstrip())
                self._pos = end + 1
                return True
            self._hold = None
        if kind in ("fence", "rule", "heading", "item"):
            self._end_table()
            self._flush(out)
        if kind == "fence":
            self._fence = _FENCE.match(content).group(1)  # type: ignore[union-attr]  # _kind matched it
            out.append(Piece("", kind="code_start"))
            self._pos = end + 1
            return True
        if kind == "rule":
            self._pos = end + 1
            return True
        self._heading = kind == "heading"
        self._line_pipe = content.startswith("|")  # known at the line's start, whatever the deltas
        if self._block:
            self._block += "\n"
        self._line_start = len(self._block)
        self._pos = start
        self._mid_line = True
        return True

    def _kind(self, content: str, complete: bool) -> str | None:
        """``fence``, ``heading``, ``item``, ``rule`` or ``text``; None while it cannot be told."""
        first = content[0]
        if first in "`~":
            if _FENCE.match(content):
                return "fence" if complete else None
            return "text" if complete or len(content) >= 3 or content.strip(first) else None
        if first == "#":
            hashes = len(content) - len(content.lstrip("#"))
            if not complete and hashes == len(content) and hashes <= 6:
                return None
            return "heading" if _HEADING.match(content) else "text"
        if first in "-*_=+":
            if complete and _RULE.fullmatch(content.rstrip()):
                return "rule"
            if not complete and not content.strip("-*_=+ \t"):
                return None  # a rule, a list item or text
            return "item" if first in "-*+" and _LIST_ITEM.match(content) else "text"
        if first.isdigit():
            digits = len(content) - len(content.lstrip("0123456789"))
            if not complete and digits < 10 and (digits == len(content) or content[digits:] in (".", ")")):
                return None  # "1" or "1." so far: a list item or a number
            if _LIST_ITEM.match(content):
                return "item"
        return "text"

    def _code_line(self, out: list[Piece]) -> bool:
        raw = self._raw
        newline = raw.find("\n", self._pos)
        complete = newline >= 0 or self._closed
        end = newline if newline >= 0 else len(raw)
        fence = self._fence or "`"
        if not complete:
            head = raw[self._pos : min(end, self._pos + MAX_PIECE + 1)]
            could_close = not self._fence_mid and not head.strip(" \t" + fence[0])
            if could_close or len(head) <= MAX_PIECE:
                return False
            out.append(Piece(head, kind="code", ends_block=False))
            self._pos += len(head)
            self._fence_mid = True
            return False
        line = raw[self._pos : end]
        self._pos = end + 1
        stripped = line.strip()
        if not self._fence_mid and stripped.startswith(fence) and not stripped.strip(fence[0]):
            self._fence = None
        else:
            out.append(Piece(line, kind="code"))
        self._fence_mid = False
        return True

    # -- blocks and cuts --------------------------------------------------------------------

    def _start_table(self, out: list[Piece], delimiter: str) -> None:
        start = self._hold or 0
        header = self._block[start:]
        self._block = self._block[:start].rstrip("\n")
        self._hold = None
        self._flush(out)
        self._table_head = f"{header}\n{delimiter}"
        out.append(Piece(self._table_head))

    def _end_table(self) -> None:
        self._table_head = ""

    def _flush(self, out: list[Piece]) -> None:
        """The current block ends: send what is left of it."""
        if self._block.strip() or self._sent_in_block:
            out.append(Piece(self._block, continued=self._sent_in_block))
        self._block = ""
        self._sent_in_block = False
        self._line_start = 0
        self._hold = None
        self._heading = False
        self._reset_scan()

    def _reset_scan(self) -> None:
        self._scanned = 0
        self._balance = _Balance()

    def _cuts(self, out: list[Piece]) -> None:
        """Send each complete sentence at the start of the block (or a long run of it)."""
        while True:
            limit = len(self._block) if self._hold is None else self._hold
            if self._mid_line and self._line_pipe:
                limit = min(limit, self._line_start)
            cut = self._sentence_cut(limit)
            if cut is None and limit > MAX_PIECE:
                space = self._block.rfind(" ", 0, MAX_PIECE)
                cut = space if space > MAX_PIECE // 2 else MAX_PIECE
            if cut is None:
                return
            out.append(Piece(self._block[:cut], ends_block=False, continued=self._sent_in_block))
            self._sent_in_block = True
            rest = self._block[cut:]
            trimmed = rest.lstrip()
            shift = cut + len(rest) - len(trimmed)
            self._block = trimmed
            self._line_start = max(0, self._line_start - shift)
            if self._hold is not None:
                self._hold = max(0, self._hold - shift)
            self._reset_scan()

    def _sentence_cut(self, limit: int) -> int | None:
        """The first sentence end before ``limit`` with no code span or link open, or None."""
        text = self._block
        for match in _SENTENCE_END.finditer(text, self._scanned, limit):
            end = match.end()
            if end >= len(text):
                return None  # what follows the mark is not known yet
            after = end
            while after < len(text) and text[after].isspace():
                after += 1
            if after >= len(text):
                return None
            self._balance.scan(text, self._scanned, end)
            self._scanned = end
            if self._balance.closed and not text[after].islower():
                return end
        return None
