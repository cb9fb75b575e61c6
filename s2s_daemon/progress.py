"""Progress of the long steps of a start (preparing weights, the warm-up):
a bar redrawn in place on a terminal, plain log lines otherwise (systemd's journal, a pipe).

Each step logs ``step_started`` (what, and how long it should take where that is known) and
``step_done`` (how long it took); in between, on a terminal, a bar on stderr, else a
``step_progress`` line every ``LOG_EVERY_S``. A step counts its work (``advance``: linears,
bytes) or, where it cannot (one blocking call), its time against what it is expected to take.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

import structlog

log = structlog.get_logger(__name__)

LOG_EVERY_S = 5.0
"""Seconds between two ``step_progress`` lines (not on a terminal)."""
DRAW_EVERY_S = 0.25
"""Seconds between two redraws of the bar (on a terminal)."""
BAR_WIDTH = 24

_terminal: dict[str, bool] = {"on": False}


def set_terminal(on: bool) -> None:
    """Logs render for a person on a terminal (``logs.configure_logging``): progress draws a bar."""
    _terminal["on"] = on


class Progress:
    """One long step. ``with Progress("preparing_weights", total=254, unit="linears") as p:
    p.advance()``; ``expected_s`` alone (no ``total``): measured against the clock on a thread."""

    def __init__(
        self,
        step: str,
        *,
        total: float | None = None,
        unit: str = "",
        expected_s: float | None = None,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        started: str | None = "step_started",
        done: str | None = "step_done",
        **context: object,
    ) -> None:
        self.step = step
        self._started_event = started
        self._done_event = done
        """The events of the step's start and end (None: the caller logs its own)."""
        self.total = total
        self.unit = unit
        self.expected_s = expected_s
        self.context = context
        self._stream = stream
        self._terminal = terminal
        self._clock = clock
        self.done = 0.0
        self._started = 0.0
        self._last_out = float("-inf")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._drawn = False

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def terminal(self) -> bool:
        on = _terminal["on"] if self._terminal is None else self._terminal
        return on and self.stream.isatty()

    def __enter__(self) -> Progress:
        self._started = self._clock()
        self._last_out = self._started
        fields: dict[str, object] = dict(self.context)
        if self.total is not None:
            fields.update(total=round(self.total, 1), unit=self.unit or None)
        if self.expected_s is not None:
            fields["expected_s"] = round(self.expected_s, 1)
        if self._started_event is not None:
            log.info(self._started_event, step=self.step, **fields)
        if self.total is None:
            self._ticker = threading.Thread(target=self._tick, name=f"s2s.progress.{self.step}", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self._drawn:
                self.stream.write("\r" + " " * 79 + "\r")
                self.stream.flush()
        took = round(self._clock() - self._started, 2)
        if kind is None:
            if self._done_event is not None:
                log.info(self._done_event, step=self.step, took_s=took)
        else:
            log.info("step_failed", step=self.step, took_s=took, error=f"{kind.__name__}: {exc}")

    def advance(self, amount: float = 1.0) -> None:
        """``amount`` more of ``total`` done (any thread)."""
        with self._lock:
            self.done += amount
        self._report()

    def _tick(self) -> None:
        while not self._stop.wait(DRAW_EVERY_S if self.terminal else min(LOG_EVERY_S, 1.0)):
            self._report()

    def fraction(self, now: float) -> float | None:
        """How far along (0..1): counted work, else time against the expected (at most 99 %)."""
        if self.total:
            return min(1.0, self.done / self.total)
        if self.expected_s:
            return min(0.99, (now - self._started) / self.expected_s)
        return None

    def left_s(self, now: float) -> float | None:
        """Seconds still to go: from the pace so far, else from the expected time."""
        elapsed = now - self._started
        if self.total and self.done > 0:
            return max(0.0, elapsed * (self.total - self.done) / self.done)
        if self.expected_s is not None:
            return max(0.0, self.expected_s - elapsed)
        return None

    def _report(self) -> None:
        now = self._clock()
        terminal = self.terminal
        with self._lock:
            if now - self._last_out < (DRAW_EVERY_S if terminal else LOG_EVERY_S):
                return
            self._last_out = now
            fraction, left = self.fraction(now), self.left_s(now)
            elapsed = now - self._started
            if terminal:
                self._draw(fraction, left, elapsed)
                return
        fields: dict[str, object] = {"elapsed_s": round(elapsed, 1)}
        if self.total is not None:
            fields.update(done=round(self.done, 1), total=round(self.total, 1))
        if fraction is not None:
            fields["percent"] = round(100.0 * fraction)
        if left is not None:
            fields["left_s"] = round(left, 1)
        log.info("step_progress", step=self.step, **fields)

    def _draw(self, fraction: float | None, left: float | None, elapsed: float) -> None:
        if fraction is None:
            bar = "".join("#" if i == int(elapsed * 4) % BAR_WIDTH else "." for i in range(BAR_WIDTH))
        else:
            filled = round(BAR_WIDTH * fraction)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
        count = f" {self.done:.0f}/{self.total:.0f} {self.unit}" if self.total is not None else ""
        rest = f", about {left:.0f} s left" if left is not None else ""
        text = f"{self.step.replace('_', ' ')} [{bar}]{count} {elapsed:.0f} s{rest}"
        self.stream.write("\r" + text[:79].ljust(79))
        self.stream.flush()
        self._drawn = True
