"""Codec pushes on a thread of their own, beside the talker (``EngineOptions.extra['codec_overlap']``).

Decoding a frame is a talker step, the code predictor's fifteen steps, and (a chunk at a time) a
codec push; done one after another, each takes every core in turn. With the overlap on, a
completed chunk goes to ``CodecWorker``'s thread and the engine thread goes on with the next
frames at once: the codec of chunk n runs on some cores while the talker and predictor make the
frames of chunk n + 1 on the others (``talker_threads``: all of them again once the codec is idle).
A synthesis's first chunk is decoded in line, with every core: it is waited for, and the frames
after it can wait.
The audio is the same as decoded in line, chunk by chunk in order (``tests/test_codec_overlap.py``).
Whether it pays depends on how well each part uses two cores alone: ``scripts/bench_overlap.py``
times both ways.

``ChunkQueue`` keeps one synthesis's chunks in order, decoded in line (no worker) or on the worker
with at most ``MAX_AHEAD`` pushes in flight; a stream is pushed by one thread at a time.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog
import torch

log = structlog.get_logger(__name__)

Samples = np.ndarray
MAX_AHEAD = 2
"""Pushes of one synthesis in flight at most: past it the engine thread waits for the oldest."""


def set_threads(threads: int) -> None:
    """This thread's intra-op threads (OpenMP keeps the setting per thread)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class CodecWorker:
    """One thread running codec pushes in the order submitted, with ``threads`` intra-op threads."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        """Intra-op threads of a push."""
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="s2s.codec", initializer=set_threads, initargs=(self.threads,)
        )
        self._lock = threading.Lock()
        self._running = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            self._running += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Future[Any]) -> None:
        with self._lock:
            self._running -= 1

    def busy(self) -> bool:
        with self._lock:
            return self._running > 0

    def talker_threads(self, total: int) -> int:
        """Intra-op threads for the engine thread's next step, of the ``total`` the engine has now:
        the cores the codec leaves while it runs, all of them when it is idle."""
        return max(1, total - self.threads) if self.busy() else total

    def close(self) -> None:
        """Wait for the pushes submitted, then end the thread."""
        self._pool.shutdown(wait=True)


class ChunkQueue:
    """One synthesis's chunks, in order: ``push`` frames, ``ready`` the audio decoded since."""

    def __init__(self, decode: Callable[[Any, list[torch.Tensor]], Samples], stream: Any,
                 worker: CodecWorker | None) -> None:  # fmt: skip
        self.decode = decode
        self.stream = stream
        self.worker = worker
        self._done: list[Samples] = []
        self._flight: deque[Future[Samples]] = deque()

    def push(self, rows: list[torch.Tensor], inline: bool = False) -> None:
        """Decode ``rows``: on the worker after the pushes before them, or in line (without a worker,
        or with ``inline`` once those have ended: a first chunk, wanted as soon as it can be)."""
        if self.worker is None or inline:
            while self._flight:
                self._done.append(self._flight.popleft().result())
            self._done.append(self.decode(self.stream, rows))
            return
        self._flight.append(self.worker.submit(self.decode, self.stream, rows))
        while len(self._flight) > MAX_AHEAD:
            self._done.append(self._flight.popleft().result())

    def ready(self) -> list[Samples]:
        """The chunks decoded so far, in order (raises what a push on the worker raised)."""
        while self._flight and self._flight[0].done():
            self._done.append(self._flight.popleft().result())
        done, self._done = self._done, []
        return done

    def drain(self) -> list[Samples]:
        """Every chunk pushed, waiting for those in flight."""
        while self._flight:
            self._done.append(self._flight.popleft().result())
        return self.ready()

    def discard(self) -> None:
        """Drop every chunk, once the pushes in flight have ended (the stream is left to no one)."""
        for future in self._flight:
            future.cancel()
        for future in self._flight:
            if not future.cancelled() and future.exception() is not None:  # waits for it
                log.warning("codec_push_failed_after_stop", error=repr(future.exception()))
        self._flight.clear()
        self._done = []
