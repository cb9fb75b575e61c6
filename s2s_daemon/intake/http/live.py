"""The web page's live view: the events the daemon publishes, kept and handed to open pages.

``MqttEvents`` hands the feed each event it publishes (``add``: its kind and its payload, the
object the MQTT message encodes, as it is built): the feed keeps the latest state, the latency
events of the last requests and the memory events of the last minutes, and gives each event to
every open subscription (the page's Server-Sent Events stream). The page so sees the payloads an
MQTT subscriber sees, whether or not a broker is up, and never talks MQTT itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MEMORY_KEPT_S = 600.0
"""Memory events younger than this are kept (the page plots the last minutes)."""
LATENCY_KEPT = 200
"""Latency events of this many requests are kept."""
KINDS = frozenset({"state", "started", "finished", "latency", "memory", "info"})
"""The events the live view shows."""
SUBSCRIPTION_QUEUE = 256
"""Events waiting for one page; past that the oldest are dropped (a stalled page loses history, not the daemon)."""


@dataclass(frozen=True, slots=True)
class LiveEvent:
    kind: str
    """``state``, ``started``, ``finished``, ``latency``, ``memory`` or ``info``."""
    payload: dict[str, Any]
    """The object published on the event's topic (as MQTT's JSON encodes it)."""


class Subscription:
    """One page's events: a bounded buffer that drops its oldest event when full."""

    def __init__(self, maxsize: int = SUBSCRIPTION_QUEUE) -> None:
        self._events: collections.deque[LiveEvent] = collections.deque(maxlen=maxsize)
        self._ready = asyncio.Event()
        self.closed = False
        self.dropped = 0
        """Events dropped because the page did not read them in time."""

    def put(self, event: LiveEvent) -> None:
        if self._events.maxlen is not None and len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)
        self._ready.set()

    async def get(self) -> LiveEvent | None:
        """The next event; None once the feed closed and nothing is left."""
        while not self._events:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._events.popleft()

    def close(self) -> None:
        self.closed = True
        self._ready.set()


class LiveFeed:
    """What ``MqttEvents`` publishes, for the page (``add`` is its ``live`` listener). The constructor does no I/O."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        """The latest state payload; None before the first."""
        self._latency: collections.deque[dict[str, Any]] = collections.deque(maxlen=LATENCY_KEPT)
        self._memory: collections.deque[dict[str, Any]] = collections.deque()
        self._subscriptions: set[Subscription] = set()

    def add(self, kind: str, payload: dict[str, Any]) -> None:
        """One event the daemon published: kept (state, latency, memory) and handed to every page."""
        if kind not in KINDS:
            return
        if kind == "state":
            self.state = payload
        elif kind == "latency":
            self._latency.append(payload)
        elif kind == "memory":
            self._memory.append(payload)
            self._forget_memory()
        event = LiveEvent(kind, payload)
        for subscription in self._subscriptions:
            subscription.put(event)

    def _forget_memory(self) -> None:
        oldest_ms = (time.time() - MEMORY_KEPT_S) * 1000.0
        while self._memory:
            ts = self._memory[0].get("ts")
            if isinstance(ts, int | float) and ts >= oldest_ms:
                return
            self._memory.popleft()

    def history(self) -> dict[str, list[dict[str, Any]]]:
        """The kept latency events (oldest first) and the memory events of the last minutes."""
        self._forget_memory()
        return {"latency": list(self._latency), "memory": list(self._memory)}

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[Subscription]:
        """Events from now on, until the block ends or the feed closes."""
        subscription = Subscription()
        self._subscriptions.add(subscription)
        try:
            yield subscription
        finally:
            self._subscriptions.discard(subscription)
            subscription.close()

    def close(self) -> None:
        """End every subscription (the HTTP server is closing): open streams end at once."""
        for subscription in self._subscriptions:
            subscription.close()

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)
