"""Waits on conditions, not on time: poll a predicate until it holds, within a deadline.

``await until(lambda: stage.frames >= 25)`` returns the predicate's first truthy value and fails
the test (``AssertionError`` naming ``what``) when the deadline passes first. The predicate may
return an awaitable (an HTTP probe), which is awaited. ``until_blocking`` is the same for code
that is not on an event loop (a fixture starting a process, a selenium page, a thread).

Where a test waits for something that has an event (a recorder's message, a stream's chunk),
it waits on that event instead; these helpers are for state that has none.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

INTERVAL_S = 0.01
"""Seconds between two looks at the predicate."""


async def until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float = 10.0,
    what: str = "the condition",
    interval_s: float = INTERVAL_S,
) -> T:
    """The predicate's first truthy value; an ``AssertionError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        await asyncio.sleep(interval_s)


def until_blocking(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    what: str = "the condition",
    interval_s: float = INTERVAL_S,
) -> T:
    """``until`` for a caller off the event loop (a thread, a fixture, a selenium page)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        time.sleep(interval_s)


async def loop_turns(count: int = 5) -> None:
    """Let every other task on the loop run ``count`` times (no time passes): a task started
    just before has then reached the point where it waits, if it waits at all."""
    for _ in range(count):
        await asyncio.sleep(0)
