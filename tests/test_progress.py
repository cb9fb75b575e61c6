"""Progress of a long step: a bar on a terminal, plain ``step_progress`` lines otherwise, each with
what it does and how long it should still take."""

from __future__ import annotations

import io
import threading

import pytest
from structlog.testing import capture_logs

from s2s_daemon import progress
from s2s_daemon.progress import Progress
from tests.support.wait import until_blocking


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_counted_work_logs_its_pace_and_what_is_left_at_most_every_few_seconds() -> None:
    clock = [100.0]
    with capture_logs() as logs, Progress(
        "preparing_weights", total=10, unit="linears", stream=io.StringIO(), terminal=False, clock=lambda: clock[0],
        fmt="int8",
    ) as p:  # fmt: skip
        for _ in range(10):
            clock[0] += 1.0
            p.advance()
    events = [e["event"] for e in logs]
    assert events[0] == "step_started" and logs[0]["total"] == 10 and logs[0]["fmt"] == "int8"
    lines = [e for e in logs if e["event"] == "step_progress"]
    assert [e["done"] for e in lines] == [5, 10]  # one every LOG_EVERY_S (5 s), not one a linear
    assert lines[0]["left_s"] == pytest.approx(5.0) and lines[0]["percent"] == 50
    assert events[-1] == "step_done" and logs[-1]["took_s"] == pytest.approx(10.0)


def test_a_terminal_gets_a_bar_redrawn_in_place_and_cleared_at_the_end() -> None:
    clock = [0.0]
    terminal = Terminal()
    with (
        capture_logs() as logs,
        Progress(
            "preparing_weights", total=4, unit="linears", stream=terminal, terminal=True, clock=lambda: clock[0]
        ) as p,
    ):
        for _ in range(4):
            clock[0] += 1.0
            p.advance()
    drawn = terminal.getvalue()
    assert "\rpreparing weights [" in drawn and "4/4 linears" in drawn and "about 0 s left" in drawn
    assert drawn.endswith("\r" + " " * 79 + "\r")
    assert not [e for e in logs if e["event"] == "step_progress"]  # the bar, not lines


def test_one_long_call_is_measured_against_its_expected_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)
    with capture_logs() as logs, Progress("warming_up", expected_s=10.0, terminal=False):
        # the long call: it lasts until the progress has spoken twice
        until_blocking(lambda: len([e for e in logs if e["event"] == "step_progress"]) >= 2, 10, "two lines")
    lines = [e for e in logs if e["event"] == "step_progress"]
    assert lines and all(0 <= e["percent"] <= 99 and 9.0 < e["left_s"] <= 10.0 for e in lines)
    assert not [t for t in threading.enumerate() if t.name.startswith("s2s.progress.")]


def test_a_failed_step_says_so() -> None:
    with capture_logs() as logs, pytest.raises(OSError), Progress("warming_up", terminal=False):
        raise OSError("disk full")
    assert logs[-1]["event"] == "step_failed" and "disk full" in logs[-1]["error"]
