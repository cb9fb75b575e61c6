"""A line intake: each line a client sends over TCP is a text spoken on the daemon's speaker, and
the client gets one line back when it has ended: ``<id> completed`` (or how else it ended), or
``<id> rejected <code>: <why>``. The worked example of docs/extending.md (adding an intake), which
shows this file whole; tests/test_extending.py runs it in the daemon.
"""

from __future__ import annotations

import asyncio

import structlog
from pydantic import Field

from s2s_daemon.config import DaemonConfig, Section
from s2s_daemon.errors import UnavailableError
from s2s_daemon.intake.admission import SayAsk, admit
from s2s_daemon.intake.door import Intake, IntakeContext

log = structlog.get_logger(__name__)

MAX_LINE_BYTES = 65_536
"""A longer line ends its connection."""


class LineConfig(Section):
    """``line:`` (in the daemon itself this class sits in config.py, beside the other sections)."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(10300, ge=0, le=65535)
    """0: any free port."""


class LineIntake:
    """Texts by the line, spoken on the speaker. The constructor does no I/O."""

    name = "line"
    origins = frozenset({"line"})

    def __init__(self, config: LineConfig, context: IntakeContext) -> None:
        self.config = config
        self.context = context
        self.port = config.port
        """The port listened on (known once started)."""
        self._server: asyncio.Server | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self._closing = asyncio.Event()

    async def start(self) -> None:
        """Listen; a port that is taken is exit 69."""
        cfg = self.config
        try:
            self._server = await asyncio.start_server(
                self._accept, cfg.host, cfg.port, limit=MAX_LINE_BYTES, start_serving=False
            )
        except OSError as exc:
            raise UnavailableError(f"line: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from exc
        self.port = self._server.sockets[0].getsockname()[1]

    async def run(self) -> None:
        """Serve until ``close``; every client's task belongs to this one."""
        if self._server is None:
            raise RuntimeError("LineIntake.run() before start()")
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            await self._server.start_serving()
            log.info("line_listening", host=self.config.host, port=self.port)
            await self._closing.wait()
        self._tg = None

    def drain(self) -> None:
        """No new connections; a line on one that is open is answered ``shutting_down`` (the ledger)."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Every request has ended, each client has its answer: hang up, and let ``run`` return."""
        self.drain()
        for writer in self._clients:
            writer.close()
        self._closing.set()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._tg is None or self._closing.is_set():
            writer.close()
            return
        self._clients.add(writer)
        self._tg.create_task(self._serve(reader, writer), name="s2s.line.client")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write((await self._speak(line.decode("utf-8", errors="replace"))).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError):  # gone, or a line longer than MAX_LINE_BYTES
            pass
        finally:
            self._clients.discard(writer)
            writer.close()

    async def _speak(self, text: str) -> str:
        """One line: admitted as every door's requests are, queued, and answered once it has ended."""
        ledger = self.context.ledger
        parsed = admit(SayAsk(text), self.context.rules, origin="line")
        if parsed.error is not None:
            ledger.reject(parsed.request, parsed.error.code, parsed.error.message)
            return f"{parsed.request.id} rejected {parsed.error.code}: {parsed.error.message}"
        job = ledger.submit(parsed.request)
        await job.done.wait()
        error = f" {job.error.code}: {job.error.message}" if job.error is not None else ""
        return f"{job.request.id} {job.status}{error}"


async def open_line(config: DaemonConfig, context: IntakeContext) -> Intake | None:
    """The opener ``wiring.INTAKES`` lists: the intake from its section, listening; None when it is off."""
    section: LineConfig = config.line  # the field DaemonConfig gains with the section
    if not section.enabled:
        return None
    intake = LineIntake(section, context)
    await intake.start()
    return intake
