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
with at most ``MAX_AHEAD`` pushes in flight; a stream is pushed by one thread at a time. With
several syntheses (a batch) the engine thread, where it waits for a push, decodes a waiting push
of another synthesis itself (``CodecWorker.wait``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
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


class _Push:
    """A push waiting for a thread: ``fn(*args)``, its result for ``future``; ``key`` its stream's queue."""

    __slots__ = ("args", "fn", "future", "key")

    def __init__(self, key: object, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.key = key
        self.fn = fn
        self.args = args
        self.future: Future[Any] = Future()


class CodecWorker:
    """Codec pushes on a thread of their own, with ``threads`` intra-op threads, each stream's
    (``key``'s) in the order submitted and never two of one stream at once.

    Several streams at once (a batch) can make more pushes than the one thread decodes, and the
    engine thread then waits for one of them (a stream ``MAX_AHEAD`` pushes behind, or at its
    end): while it waits it runs waiting pushes itself (``wait``, ``help``), those of streams the
    worker is not pushing, so that no core idles while pushes wait.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        """Intra-op threads of a push."""
        self.helping = True
        """The engine thread takes pushes (``help``); False: every push on the worker's thread."""
        self._cond = threading.Condition()
        self._waiting: deque[_Push] = deque()
        self._pushing: set[object] = set()
        """The keys whose push runs now, on any thread."""
        self._on_worker = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="s2s.codec", daemon=True)
        self._thread.start()

    def submit(self, key: object, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` after the pushes of ``key`` submitted before it; its result's future."""
        push = _Push(key, fn, args)
        with self._cond:
            if self._closed:
                raise RuntimeError("the codec worker is closed")
            self._waiting.append(push)
            self._cond.notify_all()
        return push.future

    def busy(self) -> bool:
        """A push runs on the worker's thread or waits for one."""
        with self._cond:
            return self._on_worker or bool(self._waiting)

    def talker_threads(self, total: int) -> int:
        """Intra-op threads for the engine thread's next step, of the ``total`` the engine has now:
        the cores the codec leaves while it runs, all of them when it is idle."""
        return max(1, total - self.threads) if self.busy() else total

    def help(self) -> bool:
        """Run one waiting push here (the calling thread, with the codec's threads), of a stream
        no thread is pushing now; False where there is none."""
        if not self.helping:
            return False
        with self._cond:
            push = self._take()
        if push is None:
            return False
        before = torch.get_num_threads()
        set_threads(self.threads)
        try:
            self._run(push)
        finally:
            set_threads(before)
        return True

    def wait(self, future: Future[Any]) -> Any:
        """``future``'s result; meanwhile this thread runs waiting pushes (its own among them once
        the pushes of its stream before it have ended) instead of idling."""
        while not future.done():
            if self.help():
                continue
            with self._cond:
                if not future.done():
                    self._cond.wait()
        return future.result()

    def close(self) -> None:
        """Wait for the pushes submitted, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _take(self) -> _Push | None:
        """The first waiting push whose stream no thread is pushing (held: ``_cond``)."""
        i = 0
        while i < len(self._waiting):
            push = self._waiting[i]
            if push.key in self._pushing:
                i += 1
                continue
            del self._waiting[i]
            if push.future.set_running_or_notify_cancel():
                self._pushing.add(push.key)
                return push
        return None

    def _run(self, push: _Push) -> None:
        try:
            result = push.fn(*push.args)
        except BaseException as exc:  # handed to whoever waits for the push, as ThreadPoolExecutor does
            push.future.set_exception(exc)
        else:
            push.future.set_result(result)
        finally:
            with self._cond:
                self._pushing.discard(push.key)
                self._cond.notify_all()

    def _loop(self) -> None:
        set_threads(self.threads)
        while True:
            with self._cond:
                push = self._take()
                while push is None:
                    if self._closed and not self._waiting:
                        return
                    self._cond.wait()
                    push = self._take()
                self._on_worker = True
            try:
                self._run(push)
            finally:
                with self._cond:
                    self._on_worker = False


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
                self._done.append(self._result(self._flight.popleft()))
            self._done.append(self.decode(self.stream, rows))
            return
        self._flight.append(self.worker.submit(self, self.decode, self.stream, rows))
        while len(self._flight) > MAX_AHEAD:
            self._done.append(self._result(self._flight.popleft()))

    def ready(self) -> list[Samples]:
        """The chunks decoded so far, in order (raises what a push on the worker raised)."""
        while self._flight and self._flight[0].done():
            self._done.append(self._flight.popleft().result())
        done, self._done = self._done, []
        return done

    def drain(self) -> list[Samples]:
        """Every chunk pushed, waiting for those in flight."""
        while self._flight:
            self._done.append(self._result(self._flight.popleft()))
        return self.ready()

    def _result(self, future: Future[Samples]) -> Samples:
        return self.worker.wait(future) if self.worker is not None else future.result()

    def discard(self) -> None:
        """Drop every chunk, once the pushes in flight have ended (the stream is left to no one)."""
        for future in self._flight:
            future.cancel()
        for future in self._flight:
            if not future.cancelled() and future.exception() is not None:  # waits for it
                log.warning("codec_push_failed_after_stop", error=repr(future.exception()))
        self._flight.clear()
        self._done = []
