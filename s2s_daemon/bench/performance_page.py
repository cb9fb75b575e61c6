"""The performance page (``docs/performance.md``), written by the benchmarks themselves.

Each benchmark script run with ``--doc`` replaces its own section, between ``<!-- bench:KEY -->``
and ``<!-- /bench:KEY -->`` lines, with its table and the machine, the UTC date and time and the
command that made it; a section not yet on the page is appended; everything else on the page is
kept byte for byte. No figure on the page is typed by hand. ``--doc-file`` (or ``$S2S_BENCH_DOC``)
sends a run elsewhere, so tests and trial runs never touch the real page.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s2s_daemon.bench.machine import describe, machine_info

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PAGE = REPO / "docs" / "performance.md"
PAGE_ENV = "S2S_BENCH_DOC"
"""Environment variable naming another page to write (a scratch copy) instead of ``DEFAULT_PAGE``."""

_KEY = re.compile(r"[a-z0-9][a-z0-9._-]*")
_MARKER = re.compile(r"<!-- (/?)bench:(\S+) -->")
_MARKER_LIKE = re.compile(r"\s*<!--\s*/?\s*bench\s*:")


class PageError(ValueError):
    """The page's markers do not form well-nested pairs (or a key is not a key); nothing was written."""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A Markdown table: ``align`` is one letter a column (``l`` or ``r``; default: the first column
    left, the rest right, as a label then figures). None and NaN cells show ``-``; ``|`` is escaped."""
    align = align if align is not None else "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of l, r for each of the {len(header)} columns")

    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return " ".join(str(value).split()).replace("|", "\\|")

    body = []
    for number, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"row {number} has {len(row)} cells for {len(header)} columns: {row!r}")
        body.append([cell(v) for v in row])
    head = [cell(h) for h in header]
    widths = [max(3, len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if a == "r" else "-" * w for w, a in zip(widths, align, strict=True))
    return "\n".join([line(head), rule + " |", *(line(r) for r in body)]) + "\n"


def ratio(value: float | None, base: float | None, digits: int = 2) -> str | None:
    """``value / base`` as ``1.23x``; None (shown ``-``) where either is missing or ``base`` is 0."""
    if value is None or base is None or base == 0 or math.isnan(value) or math.isnan(base):
        return None
    return f"{value / base:.{digits}f}x"


def command_line(argv: Sequence[str] | None = None, executable: str | None = None) -> str:
    """The command as a shell would show it: the interpreter and the script relative to the repository
    when they lie in it (``.venv/bin/python scripts/bench_torch.py ...``), ``python -m`` for a package."""
    argv = list(sys.argv if argv is None else argv)
    executable = sys.executable if executable is None else executable

    def shown(path: str, fallback: str) -> str:
        resolved = Path(path).absolute()
        return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else fallback

    program = argv[0] if argv else ""
    if program.endswith("__main__.py"):  # python -m s2s_daemon.bench
        package = Path(program).absolute().parent
        head = [shown(executable, "python"), "-m", ".".join(package.relative_to(REPO).parts)]
    elif program.endswith(".py"):
        head = [shown(executable, "python"), shown(program, program)]
    else:  # a console script: s2s-daemon
        head = [Path(program).name]
    return shlex.join([*head, *argv[1:]])


def page_path(explicit: Path | str | None = None) -> Path:
    """The page to write: ``explicit``, else ``$S2S_BENCH_DOC``, else ``docs/performance.md``."""
    if explicit is not None:
        return Path(explicit)
    return Path(os.environ[PAGE_ENV]) if os.environ.get(PAGE_ENV) else DEFAULT_PAGE


def check_key(key: str) -> str:
    if not _KEY.fullmatch(key):
        raise PageError(
            f"section key {key!r}: lower-case letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    return key


def sections(text: str, where: str = "the page") -> dict[str, tuple[int, int]]:
    """Each section's span in ``text``, from the start of its opening marker's line to the end of its
    closing marker's line. PageError names the line of a stray, unclosed, nested or repeated marker."""
    spans: dict[str, tuple[int, int]] = {}
    open_key: str | None = None
    open_at = open_line = 0
    offset = 0
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        start, offset = offset, offset + len(line)
        stripped = line.strip()
        match = _MARKER.fullmatch(stripped)
        if match is None:
            if _MARKER_LIKE.match(line):
                raise PageError(f"{where}, line {number}: {stripped!r} is not a marker (<!-- bench:KEY --> on a line)")
            continue
        closing, key = match.group(1) == "/", match.group(2)
        if not _KEY.fullmatch(key):
            raise PageError(f"{where}, line {number}: {key!r} is not a section key")
        if not closing:
            if open_key is not None:
                raise PageError(f"{where}, line {number}: section {key!r} opens inside {open_key!r} (line {open_line})")
            if key in spans:
                raise PageError(f"{where}, line {number}: section {key!r} appears a second time")
            open_key, open_at, open_line = key, start, number
        elif open_key != key:
            inside = f"inside {open_key!r} (line {open_line})" if open_key else "with no opening marker"
            raise PageError(f"{where}, line {number}: closing marker of {key!r} {inside}")
        else:
            spans[key] = (open_at, offset)
            open_key = None
    if open_key is not None:
        raise PageError(f"{where}, line {open_line}: section {open_key!r} is never closed (<!-- /bench:{open_key} -->)")
    return spans


def _code(text: str) -> str:
    """Inline code that survives backticks in the command."""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render_section(
    key: str, title: str, command: str, table: str, notes: str, machine: str, when: datetime.datetime
) -> str:
    """The section, markers included, ending in a newline."""
    check_key(key)
    body = f"{table.rstrip()}\n"
    if notes.strip():
        body += f"\n{notes.strip()}\n"
    if _MARKER_LIKE.search(body) or _MARKER_LIKE.search(title):
        raise PageError(f"section {key!r}: its table, notes or title hold a bench marker")
    stamp = when.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"<!-- bench:{key} -->\n"
        f"## {title}\n\n"
        f"- machine: {machine}\n"
        f"- date: {stamp}\n"
        f"- command: {_code(command)}\n\n"
        f"{body}\n"
        f"<!-- /bench:{key} -->\n"
    )


def replace_section(text: str, key: str, section: str, where: str = "the page") -> str:
    """``text`` with ``key``'s section replaced by ``section`` (appended after a blank line when absent);
    every other byte kept."""
    span = sections(text, where).get(check_key(key))
    if span is not None:
        return text[: span[0]] + section + text[span[1] :]
    if not text:
        return section
    return text + ("\n" if text.endswith("\n") else "\n\n") + section


def check_page(path: Path) -> None:
    """Fail before a benchmark runs, not after: the page's markers are well formed and it can be written.

    The default page must exist (it is the checkout's; an installed package has none); another is
    created when its folder exists."""
    if path == DEFAULT_PAGE and not path.exists():
        raise PageError(f"{path} does not exist: --doc writes a checkout's page; give --doc-file FILE elsewhere")
    if path.exists():
        sections(path.read_text(encoding="utf-8"), str(path))
        if not os.access(path, os.W_OK):
            raise PageError(f"{path}: cannot write it")
    elif not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise PageError(f"{path}: its folder does not exist or cannot be written")


def publish(
    key: str,
    title: str,
    command: str,
    table: str,
    notes: str = "",
    *,
    path: Path | None = None,
    machine: str | None = None,
    when: datetime.datetime | None = None,
) -> Path:
    """Write ``key``'s section of the page (``page_path``): the title, the machine (this one's, measured
    now, unless given), the UTC date and time, the command, the table and the notes. Returns the page."""
    target = page_path(path)
    old = target.read_text(encoding="utf-8") if target.exists() else ""
    section = render_section(
        key,
        title,
        command,
        table,
        notes,
        machine if machine is not None else describe(machine_info()),
        when if when is not None else datetime.datetime.now(datetime.UTC),
    )
    new = replace_section(old, key, section, str(target))
    scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        scratch.write_text(new, encoding="utf-8")
        os.replace(scratch, target)  # readers see the old page or the new one, never half of it
    finally:
        scratch.unlink(missing_ok=True)
    return target


def add_doc_arguments(parser: argparse.ArgumentParser, key: str) -> None:
    """``--doc``, ``--doc-file`` and ``--doc-key`` on a benchmark script's command line."""
    check_key(key)
    group = parser.add_argument_group("performance page")
    group.add_argument(
        "--doc", action="store_true", help=f"write the result table into docs/performance.md (or ${PAGE_ENV})"
    )
    group.add_argument(
        "--doc-file", type=Path, default=None, metavar="FILE", help="write it into FILE instead (implies --doc)"
    )
    group.add_argument(
        "--doc-key",
        default=key,
        metavar="KEY",
        help="the page's section to replace (default: %(default)s; another key keeps a second variant)",
    )
    parser.set_defaults(doc_default_key=key)


@dataclass(frozen=True, slots=True)
class DocTarget:
    """Where a script's ``--doc`` table goes."""

    path: Path
    key: str
    default_key: str

    def publish(self, title: str, table: str, notes: str = "") -> Path:
        """Publish under the script's own command line; a ``--doc-key`` variant names its key in the title."""
        if self.key != self.default_key:
            title = f"{title} ({self.key})"
        written = publish(self.key, title, command_line(), table, notes, path=self.path)
        sys.stderr.write(f"performance page: section {self.key!r} written in {written}\n")
        return written


def doc_target(args: argparse.Namespace) -> DocTarget | None:
    """The page a script run with ``--doc`` or ``--doc-file`` writes (checked now), or None without them.

    Raises PageError when the page's markers are malformed or it cannot be written."""
    if not (args.doc or args.doc_file is not None):
        return None
    target = DocTarget(page_path(args.doc_file), check_key(args.doc_key), args.doc_default_key)
    check_page(target.path)
    return target
