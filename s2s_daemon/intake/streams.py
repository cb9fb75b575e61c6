"""Streamed says over MQTT (``<p>/<site>/tts/stream``): the pieces of a text still being written.

Piece 0 opens the request (one id, one ``tts/started``, one ``tts/finished`` for the whole
stream) and carries the say fields; it enters the queue like a say, so priority, interrupt,
ttl and stop apply to it, and its language and ``textOptions`` choose how its text stage reads
the pieces. Later pieces go to its ``TextFeed`` by sequence number, so a QoS 1
redelivery or a piece that overtakes another is harmless. Pieces that come before piece 0 wait
for it at most ``stream_idle_s``; a stream that never opens is answered ``rejected``. They count
against ``max_text_chars`` as they come, and at most ``MAX_EARLY_STREAMS`` streams wait so.

A piece of a stream that has been answered (stopped, ended, rejected) changes nothing and gets
no second answer. A malformed piece of an open stream ends it: what came before is spoken and
it finishes ``error`` with ``bad_payload``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog

from s2s_daemon.intake.admission import IntakeRules, new_request_id
from s2s_daemon.intake.schemas import parse_stream_piece
from s2s_daemon.mqtt.packets import InMessage
from s2s_daemon.pipeline.jobs import Job, Ledger, Phase
from s2s_daemon.pipeline.messages import ErrorCode, SayRequest
from s2s_daemon.pipeline.textfeed import FeedEnd, TextFeed

log = structlog.get_logger(__name__)

ANSWERED_WINDOW = 4096
"""Ids of answered streams remembered, so their late or redelivered pieces stay quiet."""
MAX_EARLY_STREAMS = 64
"""Streams whose later pieces wait for their piece 0; a new one past it is rejected at once (each
holds at most ``tts.max_text_chars``)."""
_EARLY_END_CODES = {FeedEnd.TOO_LONG: ErrorCode.TEXT_TOO_LONG, FeedEnd.BAD_PIECE: ErrorCode.BAD_PAYLOAD}


@dataclass(slots=True)
class _Early:
    """Pieces of a stream whose piece 0 has not come yet."""

    feed: TextFeed
    timer: asyncio.TimerHandle | None = None


class StreamIntake:
    """The streams the MQTT intake has open, by request id."""

    def __init__(self, ledger: Ledger, rules: IntakeRules, opened: Callable[[Job, InMessage], None]) -> None:
        self.ledger = ledger
        self.rules = rules
        self._opened = opened
        """Called with each stream that entered the queue (the journal admits it)."""
        self.open: dict[str, tuple[TextFeed, Job]] = {}
        self._early: dict[str, _Early] = {}
        self._answered: collections.OrderedDict[str, None] = collections.OrderedDict()

    def piece(self, message: InMessage) -> None:
        """Take one ``tts/stream`` message. Never raises on bad input."""
        piece = parse_stream_piece(
            message.payload, self.rules, reply_to=message.reply_to, received_at=message.received_at
        )
        self._sweep()
        rid = piece.id
        if rid is not None and (entry := self.open.get(rid)) is not None:
            feed, _ = entry
            if piece.error is not None:
                log.warning("stream_piece_rejected", request_id=rid, reason=piece.error.message)
                feed.stop(FeedEnd.BAD_PIECE, f"a bad piece: {piece.error.message}")
            elif piece.seq is not None and not feed.add(piece.seq, piece.text, last=piece.last, now=piece.received_at):
                log.debug("stream_piece_repeated", request_id=rid, seq=piece.seq)
            return
        if rid is not None and rid in self._answered:
            log.debug("stream_piece_ignored", request_id=rid, seq=piece.seq, why="the stream was answered")
            return
        if piece.error is not None:
            self._pop_early(rid)
            log.debug("stream_rejected", request_id=rid, code=str(piece.error.code), reason=piece.error.message)
            self._reject(rid or new_request_id(), piece.error.code, piece.error.message, message)
            return
        assert rid is not None and piece.seq is not None
        if piece.seq > 0 and self.ledger.seen(rid) and rid not in self._early:
            log.debug("stream_piece_ignored", request_id=rid, seq=piece.seq, why="its id was answered")
            return
        if piece.seq > 0:
            self._hold(rid, piece.seq, piece.text, piece.last, piece.received_at, message)
            return
        opening = piece.opening
        assert opening is not None
        early = self._pop_early(rid)
        if opening.error is not None:
            self._answer(rid)
            self.ledger.reject(opening.request, opening.error.code, opening.error.message)
            return
        if early is not None:
            feed = early.feed
        else:
            feed = TextFeed(self.rules.max_text_chars, self.rules.stream_idle_s, now=piece.received_at)
        if opening.stream is not None:  # read through its text stage (piece 0 says how: language, textOptions)
            feed.prepare_with(opening.stream)
        feed.add(0, piece.text, last=piece.last, now=piece.received_at)
        # Latency counts from the first piece that came, whichever it was.
        request = replace(opening.request, feed=feed, received_at=min(feed.first_piece_at, piece.received_at))
        job = self.ledger.submit(request)
        if job.phase is Phase.DONE:  # rejected: duplicate, queue full, shutting down
            self._answer(rid)
            return
        self.open[rid] = (feed, job)
        log.debug("stream_opened", request_id=rid, early_pieces=feed.pieces - 1)
        self._opened(job, message)

    def close(self) -> None:
        """The daemon stops: open streams take no more text (what came is spoken as the drain
        allows); streams that never opened are answered."""
        for feed, _ in self.open.values():
            feed.stop(FeedEnd.SHUTDOWN, "the daemon is shutting down")
        for rid in list(self._early):
            self._never_opened(rid)

    # -- internals ---------------------------------------------------------------------

    def _hold(self, rid: str, seq: int, text: str, last: bool, at: float, message: InMessage) -> None:
        early = self._early.get(rid)
        if early is None:
            if len(self._early) >= MAX_EARLY_STREAMS:
                why = f"{len(self._early)} streams already wait for their piece 0 (at most {MAX_EARLY_STREAMS})"
                log.warning("stream_rejected", request_id=rid, reason=why)
                self._reject(
                    rid,
                    ErrorCode.BAD_PAYLOAD,
                    f"piece {seq} of stream {rid!r} came before its piece 0 and {why}",
                    message,
                )
                return
            early = self._early[rid] = _Early(TextFeed(self.rules.max_text_chars, self.rules.stream_idle_s, now=at))
        early.feed.add(seq, text, last=last, now=at)
        if (end := early.feed.end) is not None:  # too long, or too many pieces before a gap: answered now
            self._pop_early(rid)
            log.warning("stream_rejected", request_id=rid, reason=early.feed.end_detail)
            message_text = f"stream {rid!r} before its piece 0: {early.feed.end_detail}"
            self._reject(rid, _EARLY_END_CODES.get(end, ErrorCode.BAD_PAYLOAD), message_text, message)
            return
        if early.timer is not None:
            early.timer.cancel()
        loop = asyncio.get_running_loop()
        early.timer = loop.call_later(self.rules.stream_idle_s, self._never_opened, rid)

    def _never_opened(self, rid: str) -> None:
        early = self._pop_early(rid)
        if early is None:
            return
        feed = early.feed
        message = (
            f"piece 0 of stream {rid!r} never came (within tts.stream_idle_s, {self.rules.stream_idle_s:g} s); "
            f"its {feed.received_pieces} later piece{'s' if feed.received_pieces != 1 else ''} "
            f"({feed.received_chars} characters) went unspoken"
        )
        log.warning("stream_never_opened", request_id=rid)
        self._answer(rid)
        self.ledger.reject(self._placeholder(rid), ErrorCode.BAD_PAYLOAD, message)

    def _pop_early(self, rid: str | None) -> _Early | None:
        """Forget the pieces held for ``rid`` (and their timer); what was held, if any."""
        early = self._early.pop(rid, None) if rid is not None else None
        if early is not None and early.timer is not None:
            early.timer.cancel()
        return early

    def _reject(self, rid: str, code: ErrorCode, why: str, message: InMessage) -> None:
        self._answer(rid)
        self.ledger.reject(self._placeholder(rid, message), code, why)

    def _placeholder(self, rid: str, message: InMessage | None = None) -> SayRequest:
        return SayRequest(
            id=rid,
            text="",
            voice=None,
            language="auto",
            site_id=self.rules.site_id,
            reply_to=message.reply_to if message is not None else None,
        )

    def _answer(self, rid: str) -> None:
        self._answered[rid] = None
        self._answered.move_to_end(rid)
        while len(self._answered) > ANSWERED_WINDOW:
            self._answered.popitem(last=False)

    def _sweep(self) -> None:
        """Forget the streams that have been answered."""
        done = [rid for rid, (_, job) in self.open.items() if job.phase is Phase.DONE]
        for rid in done:
            del self.open[rid]
            self._answer(rid)
