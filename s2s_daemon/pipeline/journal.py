"""The request journal: every MQTT request durably stored before the broker gets its PUBACK.

SQLite (the standard library's ``sqlite3``) in WAL mode. Writes are collected on the event loop
into a batch; the writer (``run``, the task ``s2s.journal``) commits it in one transaction on a
worker thread, so the loop never waits for the disk, and what is written meanwhile is the next
batch (group commit: a burst shares its fsyncs). ``then(callback)`` runs the callback on the
loop once what was written before it is committed (the PUBACKs of the requests, the publishing
of terminal events), in the order given. A failed commit keeps nothing of its batch: the
``lost`` callbacks of its requests run (the intake withdraws them: ``rejected`` /
``journal_error``), then the ``then`` callbacks.

Tables:
- ``requests``: one row per accepted request, in arrival order (``seq``), the validated
  request as JSON, its wall-clock receipt and ``done`` (0 until its terminal event is journaled).
  Done rows are kept for the de-duplication window, then deleted.
- ``outgoing``: the terminal event's messages (``tts/finished``, a v5 reply, Hermes) until the
  broker acknowledged them; one that was never acknowledged is published again at start.

The file is locked (``locking_mode=EXCLUSIVE``) while the daemon runs: one daemon per journal.
``synchronous=FULL`` by default: WAL with FULL fsyncs the log at every commit, so a request
whose PUBACK left survives a power cut; NORMAL survives a process crash (SIGKILL, OOM) only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from s2s_daemon.errors import UnavailableError
from s2s_daemon.holders import describe, file_lock_holder
from s2s_daemon.pipeline.messages import ReplyTo, SayRequest

log = structlog.get_logger(__name__)

LOCK_TIMEOUT_S = 2.0
"""How long ``open`` waits for the journal's lock (a predecessor still exiting)."""
LOCKED_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
"""SQLite's answers when another connection holds the lock."""
PRUNE_EVERY = 512
"""Admissions between two deletions of done rows older than the de-duplication window."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL,
    request TEXT NOT NULL,
    received_wall REAL NOT NULL,
    done INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS requests_open ON requests (done, seq);
CREATE TABLE IF NOT EXISTS outgoing (
    row INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    correlation BLOB
);
"""


class JournalError(Exception):
    """A journal write failed (disk full, I/O error); the message names the file."""


PRIVATE_SUFFIXES = ("", "-wal", "-shm", "-journal")
"""The journal's file and SQLite's files beside it (which SQLite creates with the journal's mode)."""


def make_private(path: Path) -> None:
    """Create ``path`` readable and writable by its owner only (0600), whatever the umask (outside
    systemd's ``UMask=0077`` it is usually 022: world-readable), or take the group's and others'
    access off it and its SQLite companions when an earlier run left them open: the journal keeps
    the requests' texts."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.close(fd)
    for suffix in PRIVATE_SUFFIXES:
        companion = path.with_name(path.name + suffix)
        try:
            mode = stat.S_IMODE(companion.stat().st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            companion.chmod(mode & 0o700)
            log.info("journal_made_private", path=str(companion), was=oct(mode), now=oct(mode & 0o700))


def held_message(path: Path, holder: str | None) -> str:
    """Why a journal cannot be opened when another process holds its lock (one daemon per journal)."""
    who = f"another daemon ({holder})" if holder is not None else "another daemon"
    return (
        f"{path} is held by {who}: one daemon per journal; stop that one, or give this one its own"
        " site_id (each site has its own journal) or journal.path"
    )


def default_journal_path(site_id: str, environ: Mapping[str, str] | None = None, home: Path | None = None) -> Path:
    """``$STATE_DIRECTORY`` (systemd's StateDirectory=), else ``$XDG_STATE_HOME/s2s-daemon``, else
    ``~/.local/state/s2s-daemon``; the file ``journal-<site_id>.sqlite3`` there (one per daemon:
    two sites on one box do not share one)."""
    env = os.environ if environ is None else environ
    name = f"journal-{site_id}.sqlite3"
    state_dir = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state_dir:
        return Path(state_dir) / name
    xdg = env.get("XDG_STATE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else (home or Path.home()) / ".local" / "state"
    return base / "s2s-daemon" / name


@dataclass(frozen=True, slots=True)
class OpenEntry:
    """A request journaled but never answered (the daemon stopped without its terminal event)."""

    seq: int
    request: SayRequest
    """``received_at`` is rebuilt from the wall-clock receipt: its age counts across the restart."""
    age_s: float
    """Seconds since it was received (wall clock)."""
    streamed: bool = False
    """Its text was being streamed (``tts/stream``): what came after the restart cannot join it."""


@dataclass(frozen=True, slots=True)
class Unsent:
    """A terminal event's message the broker never acknowledged."""

    row: int
    topic: str
    payload: bytes
    qos: int
    correlation_data: bytes | None


@dataclass(frozen=True, slots=True)
class Recovered:
    open: list[OpenEntry]
    """Unanswered requests, in arrival order."""
    unsent: list[Unsent]
    """Unacknowledged terminal messages, in the order they were made."""
    seen_ids: list[str]
    """Ids of answered requests within the de-duplication window, oldest first."""


def _encode(request: SayRequest) -> str:
    reply = request.reply_to
    return json.dumps(
        {
            "id": request.id,
            "text": request.text,
            "voice": request.voice,
            "language": request.language,
            "siteId": request.site_id,
            "instruct": request.instruct,
            "sessionId": request.session_id,
            "priority": request.priority,
            "interrupt": request.interrupt,
            "ttlMs": request.ttl_ms,
            "volume": request.volume,
            "origin": request.origin,
            "replyTopic": reply.topic if reply is not None else None,
            "correlation": reply.correlation_data.hex() if reply and reply.correlation_data is not None else None,
            "stream": request.feed is not None,
            "spoken": request.spoken,
            "textChanged": request.text_changed,
        },
        separators=(",", ":"),
        ensure_ascii=False,
    )


def _decode(text: str, received_at: float) -> SayRequest:
    d: dict[str, Any] = json.loads(text)
    reply = None
    if d.get("replyTopic"):
        corr = d.get("correlation")
        reply = ReplyTo(d["replyTopic"], bytes.fromhex(corr) if corr is not None else None)
    return SayRequest(
        id=d["id"],
        text=d["text"],
        voice=d["voice"],
        language=d["language"],
        site_id=d["siteId"],
        instruct=d["instruct"],
        session_id=d["sessionId"],
        priority=d["priority"],
        interrupt=d["interrupt"],
        ttl_ms=d["ttlMs"],
        volume=d["volume"],
        received_at=received_at,
        origin=d["origin"],
        reply_to=reply,
        # What the text stage made of it when it was admitted (rows written before it have none:
        # their text is spoken as it is): a resumed request speaks the same.
        spoken=d.get("spoken"),
        text_changed=d.get("textChanged", False),
    )


@dataclass(slots=True)
class _Batch:
    """What was written since the last commit, and what waits for it."""

    statements: list[tuple[str, tuple[object, ...]]] = field(default_factory=list)
    then: list[Callable[[], None]] = field(default_factory=list)
    lost: list[Callable[[], None]] = field(default_factory=list)


class RequestJournal:
    """The journal file. The constructor does no I/O; ``open()`` creates and reads it."""

    def __init__(
        self,
        path: Path,
        dedup_window: int,
        synchronous: str = "full",
        schedule: Callable[[Callable[[], None]], object] | None = None,
        on_commit: Callable[[float], None] | None = None,
    ) -> None:
        self.path = path
        self.dedup_window = dedup_window
        self.synchronous = synchronous.upper()
        self._schedule = schedule
        """How a flush is scheduled (default: ``call_soon`` on the running loop)."""
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        """Held by the thread that uses the connection (the writer's worker, or ``flush``)."""
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="s2s.journal")
        """The one thread commits run on (the loop's shared pool would add a thread now and then)."""
        self._batch = _Batch()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._flush_scheduled = False
        self._seq = 0
        self._row = 0
        self.commits = 0
        self.failures = 0
        self.on_commit = on_commit
        """Called with the seconds each commit of a batch took (on the thread that committed it)."""

    # -- opening -----------------------------------------------------------------------

    def open(self) -> Recovered:
        """Create (or open) the file and read what the last run left; UnavailableError (exit 69)
        naming the path when it cannot be opened or written."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            make_private(self.path)
            # The writer's worker thread commits: one thread at a time, under ``_lock``.
            db = sqlite3.connect(self.path, timeout=LOCK_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise self._unavailable(exc) from exc
        try:
            # One daemon per journal: the lock is held until the process ends (a SIGKILL frees it),
            # so a second daemon on the same file stops at start instead of resuming our requests.
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"WAL mode refused (journal_mode={mode})")
            db.execute(f"PRAGMA synchronous={self.synchronous}")
            db.executescript(_SCHEMA)
            db.execute("BEGIN EXCLUSIVE")  # takes the lock; proves the file is writable now
            db.execute("COMMIT")
            recovered = self._read(db)
        except sqlite3.Error as exc:
            db.close()
            raise self._unavailable(exc) from exc
        self._seq = int(db.execute("SELECT COALESCE(MAX(seq), 0) FROM requests").fetchone()[0])
        self._row = int(db.execute("SELECT COALESCE(MAX(row), 0) FROM outgoing").fetchone()[0])
        self._db = db
        log.info(
            "journal_opened",
            path=str(self.path),
            unanswered=len(recovered.open),
            unsent=len(recovered.unsent),
            synchronous=self.synchronous.lower(),
        )
        return recovered

    def _unavailable(self, exc: BaseException) -> UnavailableError:
        if isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode in LOCKED_CODES:
            holder = file_lock_holder(self.path)
            return UnavailableError(
                "journal.path: " + held_message(self.path, describe(holder) if holder is not None else None)
            )
        return UnavailableError(
            f"journal {self.path}: cannot open or write it ({exc}); make its folder writable, set journal.path,"
            " or run without durability: journal.enabled: false (S2S_JOURNAL__ENABLED=false)"
        )

    def _read(self, db: sqlite3.Connection) -> Recovered:
        now_wall, now_mono = time.time(), time.monotonic()
        entries = []
        rows = db.execute("SELECT seq, request, received_wall FROM requests WHERE done = 0 ORDER BY seq")
        for seq, text, wall in rows:
            age_s = max(0.0, now_wall - wall)
            streamed = bool(json.loads(text).get("stream", False))
            entries.append(OpenEntry(seq, _decode(text, now_mono - age_s), age_s, streamed))
        unsent = [
            Unsent(row, topic, bytes(payload), qos, bytes(corr) if corr is not None else None)
            for row, topic, payload, qos, corr in db.execute(
                "SELECT row, topic, payload, qos, correlation FROM outgoing ORDER BY row"
            )
        ]
        seen = [
            rid
            for (rid,) in db.execute(
                "SELECT id FROM (SELECT seq, id FROM requests WHERE done = 1 ORDER BY seq DESC LIMIT ?) ORDER BY seq",
                (self.dedup_window,),
            )
        ]
        return Recovered(entries, unsent, seen)

    # -- writing -----------------------------------------------------------------------

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        if self._db is None:
            raise JournalError(f"journal {self.path} is not open")
        self._batch.statements.append((sql, args))
        self._request_flush()

    def admit(self, request: SayRequest, received_wall: float, lost: Callable[[], None]) -> int:
        """Journal an accepted request; its ``seq``. ``lost`` runs if its commit fails."""
        self._seq += 1
        self._write(
            "INSERT INTO requests (seq, id, request, received_wall) VALUES (?, ?, ?, ?)",
            (self._seq, request.id, _encode(request), received_wall),
        )
        self._batch.lost.append(lost)
        if self._seq % PRUNE_EVERY == 0:
            self._write("DELETE FROM requests WHERE done = 1 AND seq <= ?", (self._seq - self.dedup_window,))
        return self._seq

    def done(self, seq: int) -> None:
        """The request ``seq`` was answered (its terminal messages are journaled in the same commit)."""
        self._write("UPDATE requests SET done = 1 WHERE seq = ?", (seq,))

    def outgoing(self, request_id: str, topic: str, payload: bytes, qos: int, correlation: bytes | None) -> int:
        """Journal one terminal message until the broker acknowledged it; its row."""
        self._row += 1
        self._write(
            "INSERT INTO outgoing (row, id, topic, payload, qos, correlation) VALUES (?, ?, ?, ?, ?, ?)",
            (self._row, request_id, topic, payload, qos, correlation),
        )
        return self._row

    def sent(self, row: int) -> None:
        """The broker acknowledged the terminal message ``row``: forget it."""
        if self._db is not None:
            self._write("DELETE FROM outgoing WHERE row = ?", (row,))

    def then(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once what was written so far is committed (or its commit failed)."""
        self._batch.then.append(callback)
        self._request_flush()

    def _request_flush(self) -> None:
        if self._schedule is None:
            self._wake.set()  # the writer (``run``) commits it
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._schedule(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def _take(self) -> _Batch:
        batch, self._batch = self._batch, _Batch()
        return batch

    def _commit_blocking(self, statements: list[tuple[str, tuple[object, ...]]]) -> str | None:
        """Run one batch in one transaction; None, or why it failed (then nothing of it is kept)."""
        with self._lock:
            db = self._db
            if db is None:
                return "the journal is closed"
            if not statements:
                return None
            started = time.monotonic()
            try:
                db.execute("BEGIN")
                for sql, args in statements:
                    db.execute(sql, args)
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                if db.in_transaction:
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error as again:
                        return f"{exc}; rollback: {again}"
                return str(exc)
            if self.on_commit is not None:
                self.on_commit(time.monotonic() - started)
            return None

    def _settle(self, batch: _Batch, error: str | None) -> None:
        """After a commit: the lost callbacks when it failed, then the waiting ones, in order."""
        if error is None:
            self.commits += 1 if batch.statements else 0
        else:
            self.failures += 1
            log.error("journal_write_failed", path=str(self.path), error=error, requests_lost=len(batch.lost))
            for callback in batch.lost:
                callback()
        for callback in batch.then:
            callback()

    def flush(self) -> bool:
        """Commit what is waiting here and now (blocking), then run its callbacks; False when it failed."""
        batch = self._take()
        error = self._commit_blocking(batch.statements) if batch.statements else None
        self._settle(batch, error)
        return error is None

    async def run(self) -> None:
        """The writer: commits each batch on a worker thread (the loop never waits for the disk), then
        runs its callbacks on the loop. What is written meanwhile is the next batch (group commit)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = self._take()
            if not batch.statements:
                self._settle(batch, None)
                self._idle.set()
                continue
            self._idle.clear()
            loop = asyncio.get_running_loop()
            commit = asyncio.ensure_future(loop.run_in_executor(self._writer, self._commit_blocking, batch.statements))
            try:
                error = await asyncio.shield(commit)
            except asyncio.CancelledError:
                self._settle(batch, await commit)  # the thread finishes its transaction regardless
                raise
            self._settle(batch, error)
            if not self._batch.statements and not self._batch.then:
                self._idle.set()

    async def settle(self) -> None:
        """Wait until everything written so far is committed and its callbacks ran (the drain)."""
        while self._batch.statements or self._batch.then or not self._idle.is_set():
            self._wake.set()
            self._idle.clear()
            await self._idle.wait()

    def close(self) -> None:
        """Commit what is pending and close the file (the writer has stopped)."""
        self._writer.shutdown(wait=True)
        if self._db is None:
            return
        self.flush()
        with self._lock:
            self._db.close()
            self._db = None
