"""The text of a request that is still being written (an LLM's deltas, standard input).

Pieces carry a sequence number from 0: a piece seen before is ignored (a QoS 1 redelivery),
one that comes early waits for the pieces before it, and the text is read in order through its
text stage (``text/``: a ``StreamingTextStage`` per streamed text, which holds back at most the
sentence being written) and cut into sentences (``pipeline/segment.py``), each handed out as soon
as it is complete, so the engine speaks the first sentence while the writer is still on the second.
What the stage gives out ends where a sentence may end, so the cutting holds nothing more back
(``at_boundary``).

The feed ends when the piece marked last and every piece before it have arrived (``CLOSED``).
It also ends early, keeping what came: when no piece came for ``idle_s`` (the writer is gone:
``IDLE``), when the text outgrows ``max_chars`` (``TOO_LONG``: the pieces waiting for a gap
count from their arrival), when a piece is malformed
(``BAD_PIECE``) or when the daemon stops (``SHUTDOWN``). What was received in order is spoken
either way; the reason is the request's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncGenerator

from s2s_daemon.pipeline.segment import split_sentences
from s2s_daemon.text.stage import StreamingTextStage

MAX_EARLY_PIECES = 1000
"""Pieces held for a gap before them; more means the gap will not be filled (``BAD_PIECE``)."""


class FeedEnd(enum.StrEnum):
    """Why a feed stopped taking text."""

    CLOSED = "closed"
    IDLE = "idle"
    TOO_LONG = "too_long"
    BAD_PIECE = "bad_piece"
    SHUTDOWN = "shutdown"


class TextFeed:
    """Pieces of one request's text in, sentences out. Lives on the event loop."""

    def __init__(
        self, max_chars: int, idle_s: float, *, now: float | None = None, stage: StreamingTextStage | None = None
    ) -> None:
        self.stage = stage
        """The text stage the pieces pass through in order; None: read as written (``prepare_with``
        gives it one before its first piece is read, when the request is known after its pieces)."""
        self.max_chars = max_chars
        self.idle_s = idle_s
        self.first_piece_at = time.monotonic() if now is None else now
        """When the first piece (in any order) arrived: where the latency of a stream counts from."""
        self.last_piece_at = self.first_piece_at
        self.chars = 0
        """Characters taken in order so far (as asked)."""
        self.spoken_chars = 0
        """Characters the text stage gave out so far (what is spoken)."""
        self.pieces = 0
        """Pieces taken in order so far."""
        self.end: FeedEnd | None = None
        self.end_detail = ""
        """Why it ended early, in words (for the request's error message)."""
        self.waiting = False
        """The reader has spoken all it was given and waits for the writer."""
        self._text = ""
        """Text taken in order (and through the stage) and not handed out yet."""
        self._asked: list[str] = []
        self._spoken: list[str] = []
        """The whole text as asked and as spoken (at most ``max_chars`` asked): ``changed``."""
        self._next = 0
        self._early: dict[int, str] = {}
        self._early_chars = 0
        """Characters of the pieces in ``_early``: they count against ``max_chars`` from their arrival."""
        self._last_seq: int | None = None
        self._changed = asyncio.Event()

    @property
    def complete(self) -> bool:
        return self.end is not None

    @property
    def asked_text(self) -> bool:
        """The pieces taken so far hold more than white space."""
        return any(not piece.isspace() for piece in self._asked if piece)

    @property
    def changed(self) -> bool:
        """The text stage changed more than white space in what was taken so far."""
        return "".join(self._spoken).split() != "".join(self._asked).split()

    def prepare_with(self, stage: StreamingTextStage) -> None:
        """Read the pieces through ``stage`` (a stream whose pieces came before the one that says
        how to read them); before any piece is read in order."""
        if self.pieces:
            raise RuntimeError("TextFeed.prepare_with() after a piece was read")
        self.stage = stage

    @property
    def received_pieces(self) -> int:
        """Pieces received, in order or waiting for one before them."""
        return self.pieces + len(self._early)

    @property
    def received_chars(self) -> int:
        """Characters received, in order or waiting for a piece before them."""
        return self.chars + self._early_chars

    def add(self, seq: int, text: str, *, last: bool = False, now: float | None = None) -> bool:
        """Take piece ``seq`` (``last``: no piece follows it); False when it changes nothing (a
        repeat, or a piece after the end)."""
        if self.end is not None or seq < self._next or seq in self._early:
            return False
        if self._last_seq is not None and seq > self._last_seq:
            return False  # after the piece marked last: not part of this text
        self.last_piece_at = time.monotonic() if now is None else now
        if last:
            self._last_seq = seq
        # Counted as it arrives, in order or not: pieces waiting for a gap are held text too.
        if self.chars + self._early_chars + len(text) > self.max_chars:
            self.stop(FeedEnd.TOO_LONG, f"the text grew past {self.max_chars} characters at piece {seq}")
            return True
        self._early[seq] = text
        self._early_chars += len(text)
        if len(self._early) > MAX_EARLY_PIECES:
            self.stop(FeedEnd.BAD_PIECE, f"piece {self._next} never came ({len(self._early)} pieces after it wait)")
            return True
        while self._next in self._early:
            piece = self._early.pop(self._next)
            self._early_chars -= len(piece)
            self._asked.append(piece)
            self._say(self.stage.feed(piece) if self.stage is not None else piece)
            self.chars += len(piece)
            self.pieces += 1
            self._next += 1
        if self._last_seq is not None and self._next > self._last_seq:
            self.end = FeedEnd.CLOSED
            self._close_stage()
        self._changed.set()
        return True

    def stop(self, why: FeedEnd, detail: str = "") -> None:
        """End the feed now; the text taken so far is still read."""
        if self.end is None:
            self.end = why
            self.end_detail = detail
            self._early.clear()
            self._early_chars = 0
            self._close_stage()
            self._changed.set()

    def _say(self, text: str) -> None:
        self._text += text
        self._spoken.append(text)
        self.spoken_chars += len(text)

    def _close_stage(self) -> None:
        """The text is complete: what the stage held back (the sentence being written) comes out."""
        if self.stage is not None:
            self._say(self.stage.close())

    def pending(self) -> str:
        """The text taken and not read yet (for a request that never reached the engine)."""
        return self._text

    async def sentences(self, max_chars: int, stopped: asyncio.Event) -> AsyncGenerator[str, None]:
        """Sentences as they are complete, the first one from its first clause when that is
        sooner; ends with the feed (or at once when ``stopped`` is set)."""
        first = True
        while not stopped.is_set():
            # The stage gives out whole pieces (it holds back the sentence being written): a
            # sentence end at the end of what it gave is one, and does not wait for the next piece.
            boundary = self.stage is not None
            done, self._text = split_sentences(
                self._text, max_chars, complete=self.complete, first=first, at_boundary=boundary
            )
            if done:
                for sentence in done:
                    first = False
                    yield sentence
                    if stopped.is_set():
                        return
                continue
            if self.complete:
                return
            self._changed.clear()
            wait_s = self.last_piece_at + self.idle_s - time.monotonic()
            if wait_s <= 0:
                self.stop(FeedEnd.IDLE, f"no text came for {self.idle_s:g} s and the stream was not closed")
                continue
            self.waiting = True
            try:
                await _first_of(self._changed, stopped, wait_s)
            finally:
                self.waiting = False


async def _first_of(a: asyncio.Event, b: asyncio.Event, timeout_s: float) -> None:
    """Until ``a`` or ``b`` is set, at most ``timeout_s``."""
    waits = {asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())}
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        for task in waits:
            with contextlib.suppress(asyncio.CancelledError):
                await task
