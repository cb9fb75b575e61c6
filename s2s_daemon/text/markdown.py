# ruff: noqa: RUF001 -- the full-width comma is the point
"""One piece of Markdown as the sentences a listener hears, by markdown-it-py (CommonMark with
GFM tables and strikethrough).

Emphasis, strikethrough and headings are read as their words; a link as its text, an image as its
alt text; inline code as its words (``user_id`` -> user id), kept apart from the later passes
between ``CODE_START`` and ``CODE_END``; a table row as its cells, joined by commas; HTML tags
dropped (the text of an HTML block kept, that of a script or style dropped). Each paragraph,
heading, list item and table row is a block of its own: the stage ends each with a full stop.
"""

from __future__ import annotations

from html.parser import HTMLParser

from markdown_it import MarkdownIt
from markdown_it.token import Token

from s2s_daemon.text.languages import is_cjk

CODE_START = "\x02"
CODE_END = "\x03"
"""Around inline code in a block's text: the passes after Markdown leave it as written."""
LINE_BREAK = "\x04"
"""A line break inside a block (the stage decides whether it ends a sentence)."""
CONTINUED = "\x01"
"""Put before a piece that continues a block (after a sentence cut), so that markdown-it does not
read its start as a list marker, a heading or indented code; it is removed from the result."""

_PARSER: MarkdownIt | None = None


def _parser() -> MarkdownIt:
    global _PARSER
    if _PARSER is None:
        _PARSER = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
    return _PARSER


def render(source: str, *, table_body: bool = False) -> list[str]:
    """The blocks of ``source`` in reading order, as text; ``table_body``: ``source`` is a table's
    header and delimiter rows and then one body row, and only the body row is wanted."""
    blocks: list[str] = []
    cells: list[str] | None = None
    in_head = False
    for token in _parser().parse(source):
        kind = token.type
        if kind == "inline":
            text = _inline(token.children or [])
            if cells is not None:
                cells.append(text)
            else:
                blocks.append(text)
        elif kind == "thead_open":
            in_head = True
        elif kind == "thead_close":
            in_head = False
        elif kind == "tr_open":
            cells = []
        elif kind == "tr_close" and cells is not None:
            if not (table_body and in_head):
                blocks.append(_cells(cells))
            cells = None
        elif kind == "html_block":
            blocks.append(html_text(token.content))
        elif kind in ("fence", "code_block"):
            blocks.append(token.content)  # not made by the stage's pieces; read as written
    return [block.replace(CONTINUED, "") for block in blocks]


def _cells(cells: list[str]) -> str:
    """A table row: its cells joined by a comma (a full-width one after CJK text)."""
    comma = "，" if any(is_cjk(char) for cell in cells for char in cell) else ", "
    return comma.join(cell.strip() for cell in cells if cell.strip())


def _inline(children: list[Token]) -> str:
    out: list[str] = []
    for child in children:
        kind = child.type
        if kind == "text":
            out.append(child.content)
        elif kind == "code_inline":
            out.append(CODE_START + code_words(child.content) + CODE_END)
        elif kind in ("softbreak", "hardbreak"):
            out.append(LINE_BREAK)
        elif kind == "image":
            out.append(_inline(child.children or []))
        elif kind == "html_inline" and child.content.lower().startswith("<br"):
            out.append(LINE_BREAK)
    return "".join(out)


def code_words(code: str) -> str:
    """Inline code as its words: ``user_id`` -> user id, ``print()`` -> print."""
    return code.replace("_", " ").replace("()", "").strip()


class _TextOnly(HTMLParser):
    """The text of an HTML fragment, without tags, scripts and styles."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("br", "p", "div", "li", "tr"):
            self.parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_text(html: str) -> str:
    parser = _TextOnly()
    parser.feed(html)
    parser.close()
    return " ".join("".join(parser.parts).split())
