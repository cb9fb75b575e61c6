# ruff: noqa: RUF002 -- full-width CJK marks are the point
"""Sentences from text that may still be growing (an LLM's deltas): rules of our own, for the
languages Qwen3-TTS speaks.

A sentence ends at ``.``, ``!``, ``?`` or ``…`` (with its closing quotes and brackets) before
white space, or at the CJK full stop, exclamation or question mark (``。！？``) before any
character. Not at the end of an abbreviation (``Dr.``, ``e.g.``, ``z. B.``, ``M.``), an
initial (``J. K. Rowling``), a German ordinal (``am 3. Oktober``), an ellipsis or a full stop
followed by a lower-case word, or a decimal (``3.14``: no space follows). A piece without a
letter or digit joins the next sentence; text longer than ``max_chars`` without an end is cut
at its last space (or clause mark) before the limit.

The end of the text is never a sentence end until the caller says the text is complete: the
next piece may be ``5 percent`` after ``Done.``, or ``Smith`` after ``Dr.``; unless the caller says
the text ends at a boundary (``at_boundary``: the text stage's output, whole pieces that end where
a sentence may end), where a terminator at the very end is read as one before white space.

A request's first segment starts its first sound, and its prefill grows with its length: with
``first``, a long first sentence (over ``FIRST_SENTENCE_CHARS``), or a first sentence still
being written, is cut after its first clause of at least ``FIRST_CLAUSE_CHARS`` (``CLAUSE_MARKS``
before white space; a CJK mark before anything). Lengths count a CJK character as three: it is
about a syllable, as long to say as three Latin letters.
"""

from __future__ import annotations

import re

CLOSERS = "\"')]\u201d\u2019\u00bb\u300d\u300f\uff09\u3011"
"""Closing quotes and brackets that stay with the sentence they end (ASCII, curly, French, CJK)."""
CLAUSE_MARKS = ",;:\u3001\uff0c\uff1b\uff1a"
"""Where an over-long sentence is cut, before falling back to a space (Latin and CJK)."""

FIRST_SENTENCE_CHARS = 60
"""A complete first sentence longer than this is spoken from its first clause (``first``)."""
FIRST_CLAUSE_CHARS = 20
"""The shortest first clause spoken alone."""

ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof st sr jr vs etc e.g i.e cf approx dept est fig inc ltd co corp no nos vol
    a.m p.m jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun
    z z.b u.a d.h bzw ca evtl ggf inkl nr str hr fr dipl bspw vgl
    mme mlle mm env p.ex av
    sra srta ud uds
    """.split()
)
"""Words whose final dot is not a full stop (lower case, without that dot)."""

_CLOSING = rf"(?:[{re.escape(CLOSERS)}]|[ \u00a0\u202f]\u00bb)*"
"""Closers after a terminator; French sets its closing guillemet after a space (``Bonjour ! »``)."""
_END = re.compile(
    rf"(?:\.{{2,}}|\u2026|[.!?]+){_CLOSING}(?=\s)"  # Latin: a terminator before white space
    rf"|[\u3002\uff01\uff1f]+{_CLOSING}(?=\S)"  # CJK: nothing follows but the next sentence
)
_END_AT_BOUNDARY = re.compile(rf"(?:\.{{2,}}|\u2026|[.!?]+){_CLOSING}(?=\s|$)|[\u3002\uff01\uff1f]+{_CLOSING}(?=\S|$)")
"""``_END``, with the end of a text that ends at a boundary as what follows a terminator."""
_CLAUSE = re.compile(r"[,;:](?=\s)|[\u3001\uff0c\uff1b\uff1a](?=\S)")
_WORD_BEFORE = re.compile(r"([\w.\-]+)\.$")
_MONTHS_DE: tuple[str, ...] = ("januar", "februar", "märz", "april", "mai", "juni", "juli", "august")
_MONTHS_DE += ("september", "oktober", "november", "dezember")
_MONTH_CHARS = max(len(month) for month in _MONTHS_DE)
_SPACE = re.compile(r"\s*")
"""White space (what ``str.strip`` removes), matched in place."""


def _skip_space(text: str, pos: int = 0) -> int:
    """The first index at or after ``pos`` that is not white space (``len(text)`` when none is)."""
    match = _SPACE.match(text, pos)
    return match.end() if match is not None else pos


def _is_end(text: str, match: re.Match[str]) -> bool:
    """Whether the terminator ``match`` in ``text`` really ends a sentence."""
    mark = match.group(0)
    if mark[0] in "\u3002\uff01\uff1f" or mark[0] in "!?":
        return True
    # What follows, read in place: a copy of the rest at every full stop made a long text quadratic.
    next_at = _skip_space(text, match.end())
    following = text[next_at : next_at + 1]
    if following and following.islower():
        return False  # "etc. and", "... and then", "z. B. die"
    if mark.startswith("..") or mark.startswith("\u2026"):
        return True  # an ellipsis before a capital (or the end) ends the sentence
    head = text[match.start() - 40 if match.start() > 40 else 0 : match.start() + 1]
    word = _WORD_BEFORE.search(head)
    if word is None:
        return True
    token = word.group(1)
    if token.lower() in ABBREVIATIONS or token.lower().rstrip(".") in ABBREVIATIONS:
        return False
    if len(token) == 1 and token.isalpha() and token.isupper():
        return False  # an initial: "J. K. Rowling"
    if token.isdigit() and len(token) <= 2 and text[next_at : next_at + _MONTH_CHARS].lower().startswith(_MONTHS_DE):
        return False  # a German date: "am 3. Oktober"
    return True


def _first_clause(text: str) -> int | None:
    """Where the first clause of ``text`` long enough to be spoken alone ends (after its mark).

    The head before each mark is measured by adding what lies between one mark and the next, so
    a text of many short clauses costs its length once."""
    pos = _skip_space(text)
    spoken = 0
    """Spoken length of ``text`` from its first non-space to ``pos``."""
    head = 0
    """Spoken length of the head before the mark, without its trailing white space."""
    alnum = False
    for match in _CLAUSE.finditer(text, pos):
        between = text[pos : match.start()]
        body = between.rstrip()
        if body:
            head = spoken + _spoken_length(body)
            alnum = alnum or any(c.isalnum() for c in body)
        spoken += _spoken_length(between)
        pos = match.start()
        if head >= FIRST_CLAUSE_CHARS and alnum:
            return match.end()
    return None


def _spoken_length(text: str) -> int:
    """Characters, a CJK one counted as three."""
    return len(text) + 2 * sum(1 for c in text if c >= "\u3000")


def split_sentences(
    text: str, max_chars: int, *, complete: bool = False, first: bool = False, at_boundary: bool = False
) -> tuple[list[str], str]:
    """The complete sentences at the start of ``text``, and the rest (kept for more text).

    With ``complete`` the rest is a sentence too (the stream has ended): nothing is left over.
    With ``first`` (nothing of the request has been spoken yet) a long or unfinished first
    sentence gives its first clause alone. With ``at_boundary`` the text's end is where a sentence
    may end (what the text stage gave out): a terminator there ends one, as before white space.
    """
    if first:
        sentences, rest = split_sentences(text, max_chars, complete=complete, at_boundary=at_boundary)
        head = sentences[0] if sentences else rest if not complete else ""
        if (_spoken_length(head) > FIRST_SENTENCE_CHARS or not sentences) and (cut := _first_clause(head)) is not None:
            clause = head[:cut].strip()
            if sentences:
                return [clause, head[cut:].strip(), *sentences[1:]], rest
            return [clause], rest[cut:]
        return sentences, rest
    sentences = []
    start = 0
    for match in (_END_AT_BOUNDARY if at_boundary else _END).finditer(text):
        if not _is_end(text, match):
            continue
        piece = text[start : match.end()].strip()
        if any(c.isalnum() for c in piece):
            sentences.append(piece)
            start = match.end()
    # An over-long rest is cut in place, one window at a time (no copy of what is left per cut).
    end = len(text.rstrip())
    while end - (lead := _skip_space(text, start)) > max_chars:
        window = text[lead : lead + max_chars + 1]
        cut = max(window.rfind(mark, 0, max_chars) for mark in CLAUSE_MARKS)
        cut = cut + 1 if cut > max_chars // 3 else window.rfind(" ", 0, max_chars + 1)
        cut = cut if cut > 0 else max_chars
        sentences.append(window[:cut].strip())
        start = lead + cut
    rest = text[start:]
    if complete:
        if any(c.isalnum() for c in rest):
            sentences.append(rest.strip())
        elif sentences and rest.strip():
            sentences[-1] += rest.rstrip()
        rest = ""
    return sentences, rest


def split_clauses(sentence: str, min_chars: int = FIRST_CLAUSE_CHARS) -> list[str]:
    """``sentence`` cut after each clause mark (``CLAUSE_MARKS``) where both the clause and what
    follows it are at least ``min_chars`` long: where a slow engine's unavoidable pauses may fall
    (``tts/stage.py``). The sentence alone when there is no such mark."""
    pieces: list[str] = []
    start = 0
    for match in _CLAUSE.finditer(sentence):
        head = sentence[start : match.end()].strip()
        tail = sentence[match.end() :].strip()
        if _spoken_length(head) >= min_chars and _spoken_length(tail) >= min_chars and any(c.isalnum() for c in head):
            pieces.append(head)
            start = match.end()
    pieces.append(sentence[start:].strip())
    return pieces
