"""The bounded request queue: priority first, then arrival; interrupts jump the line."""

from __future__ import annotations

import asyncio
import heapq
import itertools

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
        self._readable = asyncio.Event()
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
        self._readable.set()
        return True

    def _pop_live(self) -> SayRequest | None:
        while self._heap:
            _, _, request = heapq.heappop(self._heap)
            if request.id in self._ids:
                self._ids.discard(request.id)
                return request
        return None

    async def get(self) -> SayRequest:
        while True:
            request = self._pop_live()
            if request is not None:
                if not self._ids:
                    self._readable.clear()
                return request
            self._readable.clear()
            if self._closed:
                raise ChannelClosed("requests")
            await self._readable.wait()

    def remove(self, request_id: str) -> bool:
        """Take one request out (lazily dropped from the heap)."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        return True

    def drain(self) -> list[SayRequest]:
        """Remove and return everything queued, in serving order."""
        out: list[SayRequest] = []
        while (request := self._pop_live()) is not None:
            out.append(request)
        self._heap.clear()
        self._readable.clear()
        if self._closed:
            self._readable.set()
        return out

    def close(self) -> None:
        self._closed = True
        self._readable.set()
