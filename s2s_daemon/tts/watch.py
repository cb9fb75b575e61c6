"""The watch over a hanging engine: each utterance's time budget and the wedge verdict.

The engine can hang (a deadlock in torch, a stuck device). No chunk for ``tts.stall_timeout_s``,
or more than ``tts.max_utterance_s`` of engine time on one utterance, fails the request
(``EngineTimeout``). A Python thread cannot be killed: the engine's generator is asked to stop
and closed on its thread, and when that thread does not come back within another
``stall_timeout_s`` the engine is *wedged* (``EngineWatch``): it is never called again, and
``on_wedged`` tells the daemon, which exits (70) for its service manager to restart it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from s2s_daemon.tts.engine import EngineError

log = structlog.get_logger(__name__)


class EngineTimeout(EngineError):
    """The engine made no audio for ``tts.stall_timeout_s``, or ran past ``tts.max_utterance_s``."""


class EngineWedged(EngineError):
    """The engine thread did not come back after a request failed: no synthesis is possible."""


@dataclass(slots=True)
class UtteranceBudget:
    """Engine time one utterance may take (``tts.max_utterance_s``), shared by its sentences; and,
    for a paced one (``SynthesisRequest.paced``), how far its audio is ahead of playing time."""

    limit_s: float | None
    spent_s: float = 0.0
    """Seconds the engine thread spent in this utterance's finished runs (written by that thread)."""
    made_s: float = 0.0
    """Seconds of audio a paced utterance's steps made so far (engine thread)."""
    first_at: float | None = None
    """When its first chunk was made (monotonic; engine thread)."""

    def lead_s(self, now: float) -> float:
        """Audio made beyond what could have played since the first chunk (playback may have
        started later, never sooner: a lower bound); minus infinity before the first chunk."""
        if self.first_at is None:
            return float("-inf")
        return self.made_s - (now - self.first_at)

    def over(self, engine_time_s: float) -> EngineTimeout | None:
        """The error once ``engine_time_s`` reached the limit; None while within it."""
        if self.limit_s is not None and engine_time_s >= self.limit_s:
            return EngineTimeout(
                f"the engine ran past the time limit of one utterance ({self.limit_s:g} s, tts.max_utterance_s)"
            )
        return None


current_utterance: contextvars.ContextVar[UtteranceBudget | None] = contextvars.ContextVar(
    "s2s_utterance_budget", default=None
)
"""The budget of the request being synthesized (``EngineWorker.utterance``); None outside one."""


class Abortable(Protocol):
    """A stream waiting on the engine thread that can be ended from the event loop."""

    def abort(self, error: BaseException) -> None: ...


class EngineWatch:
    """Whether the engine thread comes back after a stream is closed; the verdict when it does not.

    ``grace_s`` (``tts.stall_timeout_s``; None: forever) is how long the thread may take to
    return. The first time it does not, the engine is wedged: ``on_wedged(reason)`` is called
    once, on the event loop, and every waiting stream is aborted with ``EngineWedged``.
    """

    def __init__(self, grace_s: float | None, on_wedged: Callable[[str], None] | None = None) -> None:
        self.grace_s = grace_s
        self.on_wedged = on_wedged
        self.wedged: str | None = None
        """Why the engine thread is given up on; None while it is healthy."""
        self._watches: set[asyncio.Task[None]] = set()

    def pending(self) -> bool:
        """A closed stream's engine run has not returned yet."""
        return bool(self._watches)

    async def verdict(self) -> None:
        """Wait until every watched run returned or the engine was declared wedged."""
        await asyncio.wait(set(self._watches))

    def watch(
        self, released: asyncio.Future[None], failed: EngineTimeout | None, waiting: Callable[[], Iterable[Abortable]]
    ) -> asyncio.Task[None]:
        """Watch ``released`` (a stream's close on the engine thread) for ``grace_s``; past it the
        engine is wedged and the streams ``waiting()`` names are aborted."""

        async def watch() -> None:
            grace = self.grace_s
            done, _ = await asyncio.wait({released}, timeout=grace)
            if done:
                if not released.cancelled() and (exc := released.exception()) is not None:
                    log.warning("engine_close_failed", error=repr(exc))
                elif failed is not None:
                    log.info("engine_recovered", after=str(failed))
                return
            why = f"after {failed}" if failed is not None else "while a stream was being closed"
            self.declare_wedged(f"the engine thread did not return within {grace:g} s {why}", waiting())

        task = asyncio.get_running_loop().create_task(watch(), name="s2s.engine.watch")
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)
        return task

    def declare_wedged(self, reason: str, waiting: Iterable[Abortable]) -> None:
        if self.wedged is not None:
            return
        self.wedged = reason
        log.critical(
            "engine_wedged",
            reason=reason,
            consequence="no more synthesis in this process: the daemon exits for its service manager to restart it",
        )
        if self.on_wedged is not None:
            try:
                self.on_wedged(reason)
            except Exception:  # the streams below must still be woken
                log.exception("engine_wedged_handler_failed")
        for stream in list(waiting):  # waiting on the thread that will not come back
            stream.abort(EngineWedged(reason))
