"""The bounded request queue: priority first, then arrival; interrupts jump the line.

Its consumer may take only the requests it can serve now (``get(accept)``: the TTS stage, whose
speaker is busy, takes a caller's request queued behind the speaker's next one); what it
refuses keeps its place.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from s2s_daemon.pipeline.channel import ChannelClosed
from s2s_daemon.pipeline.messages import SayRequest


class RequestQueue:
    """Bounded priority queue. Overflow policy: reject the newcomer (``queue_full``)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._heap: list[tuple[int, int, SayRequest]] = []
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)
        self._ids: set[str] = set()
        self._changed = asyncio.Event()
        """Set when what ``get`` may find has changed (an offer, a removal, a close, ``reconsider``)."""
        self._closed = False

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    @property
    def full(self) -> bool:
        return len(self._ids) >= self.maxsize

    def offer(self, request: SayRequest, *, front: bool = False) -> bool:
        """Add ``request``; False (and nothing added) when full or closed."""
        if self._closed or self.full:
            return False
        order = next(self._front) if front else next(self._seq)
        priority = -(1 << 30) if front else -request.priority
        heapq.heappush(self._heap, (priority, order, request))
        self._ids.add(request.id)
        self._changed.set()
        return True

    def _pop_live(self) -> SayRequest | None:
        while self._heap:
            _, _, request = heapq.heappop(self._heap)
            if request.id in self._ids:
                self._ids.discard(request.id)
                return request
        return None

    def _pop_accepted(self, accept: Callable[[SayRequest], bool]) -> SayRequest | None:
        """The first live request in serving order that ``accept`` takes, out of the queue."""
        while self._heap and self._heap[0][2].id not in self._ids:
            heapq.heappop(self._heap)  # removed ones at the top
        if self._heap and accept(self._heap[0][2]):
            return self._pop_live()
        entry = min((e for e in self._heap if e[2].id in self._ids and accept(e[2])), default=None)
        if entry is None:
            return None
        self._heap.remove(entry)
        heapq.heapify(self._heap)
        self._ids.discard(entry[2].id)
        return entry[2]

    async def get(self, accept: Callable[[SayRequest], bool] | None = None) -> SayRequest:
        """The next request in serving order, or the first of them that ``accept`` takes (the others
        keep their place). Waits for one; ``ChannelClosed`` once closed and empty. ``accept`` is asked
        again at each change of the queue and after ``reconsider``."""
        while True:
            request = self._pop_live() if accept is None else self._pop_accepted(accept)
            if request is not None:
                return request
            if self._closed and not self._ids:
                raise ChannelClosed("requests")
            self._changed.clear()
            await self._changed.wait()

    def reconsider(self) -> None:
        """What ``get``'s ``accept`` refused it may take now (the consumer freed a place): ask again."""
        self._changed.set()

    def remove(self, request_id: str) -> bool:
        """Take one request out (lazily dropped from the heap)."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        self._changed.set()
        return True

    def waiting(self) -> list[SayRequest]:
        """What is queued, in serving order, left in place (the web page's queue view)."""
        live = [entry for entry in self._heap if entry[2].id in self._ids]
        return [request for _, _, request in sorted(live, key=lambda entry: entry[:2])]

    def drain(self) -> list[SayRequest]:
        """Remove and return everything queued, in serving order."""
        out: list[SayRequest] = []
        while (request := self._pop_live()) is not None:
            out.append(request)
        self._heap.clear()
        self._changed.set()
        return out

    def close(self) -> None:
        self._closed = True
        self._changed.set()
