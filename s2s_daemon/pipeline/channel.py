"""A bounded asyncio channel that names its overflow policy; closing ends the stream."""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Overflow(enum.Enum):
    """What ``put`` does when the channel is full."""

    BLOCK = "block"
    """Wait for room (back-pressure)."""
    DROP_OLDEST = "drop_oldest"
    """Discard the oldest item and count it."""
    REJECT = "reject"
    """Raise ``ChannelFull`` at once."""


class ChannelClosed(Exception):
    """The channel was closed and is drained."""


class ChannelFull(Exception):
    """A REJECT channel had no room."""


class Channel(Generic[T]):
    """Single-loop bounded FIFO. ``close()`` lets readers drain, then ends iteration."""

    def __init__(self, maxsize: int, overflow: Overflow, name: str) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.name = name
        self.maxsize = maxsize
        self.overflow = overflow
        self.dropped = 0
        """Items discarded by DROP_OLDEST."""
        self._items: collections.deque[T] = collections.deque()
        self._closed = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def _update(self) -> None:
        if self._items or self._closed:
            self._readable.set()
        else:
            self._readable.clear()
        if len(self._items) < self.maxsize or self._closed:
            self._writable.set()
        else:
            self._writable.clear()

    def put_nowait(self, item: T) -> None:
        if self._closed:
            raise ChannelClosed(self.name)
        if len(self._items) >= self.maxsize:
            if self.overflow is Overflow.DROP_OLDEST:
                self._items.popleft()
                self.dropped += 1
            else:
                raise ChannelFull(self.name)
        self._items.append(item)
        self._update()

    def put_front_nowait(self, item: T) -> None:
        """Return an item to the head (a publish that failed and will be retried)."""
        if self._closed:
            raise ChannelClosed(self.name)
        if len(self._items) >= self.maxsize:
            self._items.pop()
            self.dropped += 1
        self._items.appendleft(item)
        self._update()

    async def put(self, item: T) -> None:
        while self.overflow is Overflow.BLOCK and len(self._items) >= self.maxsize and not self._closed:
            await self._writable.wait()
        self.put_nowait(item)

    def get_nowait(self) -> T:
        if not self._items:
            if self._closed:
                raise ChannelClosed(self.name)
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        self._update()
        return item

    async def get(self) -> T:
        while not self._items:
            if self._closed:
                raise ChannelClosed(self.name)
            await self._readable.wait()
        return self.get_nowait()

    async def wait_readable(self) -> None:
        """Until an item is buffered or the channel is closed; takes nothing."""
        await self._readable.wait()

    def clear(self) -> list[T]:
        """Remove and return everything buffered (stop, barge-in)."""
        items = list(self._items)
        self._items.clear()
        self._update()
        return items

    def close(self) -> None:
        self._closed = True
        self._update()

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.get()
            except ChannelClosed:
                return
