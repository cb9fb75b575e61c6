"""The codec on a thread of its own (``codec_overlap``): the same audio as decoded in line, in order;
stops, errors and closing behave as in line."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine  # noqa: E402
from s2s_daemon.tts.torch_qwen3.overlap import ChunkQueue, CodecWorker  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(600)]

CV = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
REQUEST = SynthesisRequest(text="Hello there, this is a test.", voice="Ryan", language="english", greedy=True,
                           chunk_frames=3)  # fmt: skip


def _engine(overlap: bool, threads: str = "1", **extra: str) -> TorchQwen3Engine:
    options = EngineOptions(model=str(CV), device="cpu", dtype="float32",
                            extra={"codec_overlap": "on" if overlap else "off", "threads": threads, "max_frames": "14",
                                   "prepared_cache": "0", "codec_dtype": "float32", **extra})  # fmt: skip
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    assert (engine.codec_worker is not None) == overlap
    return engine


def _chunks(engine: TorchQwen3Engine, request: SynthesisRequest = REQUEST) -> list[np.ndarray]:
    return list(engine.synthesize_blocking(request, lambda: False))


@pytest.mark.slow
@pytest.mark.parametrize("threads", ["1", "2"])
def test_the_same_audio_in_the_same_chunks_as_decoded_in_line(threads: str) -> None:
    results = []
    for overlap in (False, True):
        engine = _engine(overlap, threads)
        try:
            results.append((_chunks(engine), _chunks(engine)))  # twice: a kept prompt prefix, a second stream
        finally:
            engine.close_blocking()
    (inline_a, inline_b), (overlap_a, overlap_b) = results
    for inline, overlapped in ((inline_a, overlap_a), (inline_b, overlap_b)):
        assert [len(c) for c in inline] == [len(c) for c in overlapped]
        assert len(inline) > 3  # 1, then 3 at a time: several pushes in flight
        for a, b in zip(inline, overlapped, strict=True):
            if threads == "1":  # one thread everywhere: the same arithmetic, bit for bit
                assert np.array_equal(a, b)
            else:  # a push on one thread or two may sum in another order
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_batched_requests_decode_the_same_with_the_overlap() -> None:
    audio = []
    for overlap in (False, True):
        engine = _engine(overlap)
        try:
            batch = [engine.open_blocking(REQUEST, lambda: False) for _ in range(2)]
            got: list[list[np.ndarray]] = [[], []]
            while not all(s.done for s in batch):
                engine.step_blocking(batch)
                for i, synthesis in enumerate(batch):
                    got[i].extend(synthesis.take())
            for i, synthesis in enumerate(batch):
                got[i].extend(synthesis.take())
            audio.append([np.concatenate(g) for g in got])
        finally:
            engine.close_blocking()
    for a, b in zip(audio[0], audio[1], strict=True):
        assert np.array_equal(a, b)


def test_a_stop_ends_the_stream_and_leaves_no_push_running() -> None:
    engine = _engine(True)
    try:
        stop = threading.Event()
        chunks = []
        for chunk in engine.synthesize_blocking(REQUEST, stop.is_set):
            chunks.append(chunk)
            stop.set()
        assert len(chunks) == 1
        assert engine.codec_worker is not None and not engine.codec_worker.busy()
        assert len(_chunks(engine)) > 3  # the engine goes on
    finally:
        engine.close_blocking()
    assert engine.codec_worker is None


def test_an_error_of_a_push_on_the_worker_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(True)
    try:
        from s2s_daemon.tts.torch_qwen3.codec import StreamingDecodeState

        pushes = {"n": 0}
        push = StreamingDecodeState.push

        def failing(self: Any, codes: Any) -> Any:
            pushes["n"] += 1
            if pushes["n"] == 2:
                raise RuntimeError("codec failed")
            return push(self, codes)

        monkeypatch.setattr(StreamingDecodeState, "push", failing)
        with pytest.raises(RuntimeError, match="codec failed"):
            _chunks(engine)
    finally:
        engine.close_blocking()


def test_chunks_come_out_in_order_and_a_stream_is_pushed_by_one_thread_at_a_time() -> None:
    """Slow and fast pushes on the worker: ``ready`` hands them out in submission order, and no two
    pushes of the stream overlap."""
    worker = CodecWorker(threads=1)
    active = {"n": 0, "most": 0}
    lock = threading.Lock()
    gate = threading.Event()

    def decode(_stream: Any, rows: list[Any]) -> Any:
        with lock:
            active["n"] += 1
            active["most"] = max(active["most"], active["n"])
        if int(rows[0]) == 0:
            gate.wait(5)  # the first push waits until everything else was submitted
        with lock:
            active["n"] -= 1
        return np.full(2, int(rows[0]), dtype=np.float32)

    queue = ChunkQueue(decode, object(), worker)
    try:
        queue.push([torch.tensor(0)])
        assert worker.busy() and worker.talker_threads(2) == 1
        assert queue.ready() == []
        gate.set()
        for i in range(1, 6):
            queue.push([torch.tensor(i)])
        got = [int(c[0]) for c in queue.drain()]
        assert got == [0, 1, 2, 3, 4, 5]
        assert active["most"] == 1
        assert not worker.busy() and worker.talker_threads(2) == 2
    finally:
        worker.close()


@pytest.mark.parametrize("helping", [True, False])
def test_a_waiting_engine_thread_decodes_another_streams_push_itself(helping: bool) -> None:
    """Two streams: while the worker is held on stream a's push, the engine thread, waiting for
    stream b's, runs b's pushes itself, in order; with ``helping`` off it waits for the worker."""
    worker = CodecWorker(threads=1)
    worker.helping = helping
    gate, started = threading.Event(), threading.Event()
    ran: list[tuple[str, int, str]] = []

    def decode(name: str, rows: list[Any]) -> Any:
        i = int(rows[0])
        if name == "a" and i == 0:
            started.set()
            gate.wait(5)
        ran.append((name, i, threading.current_thread().name))
        return np.full(1, i, dtype=np.float32)

    a, b = ChunkQueue(decode, "a", worker), ChunkQueue(decode, "b", worker)
    try:
        a.push([torch.tensor(0)])
        assert started.wait(5)  # the worker holds a's push
        for i in range(4):  # from the third on, b waits for its oldest push (MAX_AHEAD)
            b.push([torch.tensor(i)])
            if not helping and i == 1:
                gate.set()  # else b would wait on the held worker
        gate.set()
        assert [int(c[0]) for c in b.drain()] == [0, 1, 2, 3]
        assert [int(c[0]) for c in a.drain()] == [0]
        here = threading.current_thread().name
        if helping:
            assert ("b", 0, here) in ran  # the engine thread took b's push while a's held the worker
        else:
            assert all(thread != here for _, _, thread in ran)
    finally:
        gate.set()
        worker.close()


def test_many_streams_on_two_threads_keep_each_streams_order_and_one_thread_at_a_time() -> None:
    """Three streams' pushes, slow and fast, taken by the worker and by the waiting engine thread:
    each stream's chunks in order, never two pushes of one stream at once, both threads used."""
    import random
    import time

    worker = CodecWorker(threads=1)
    lock = threading.Lock()
    active: dict[str, int] = {}
    overlapped = []
    threads_seen = set()
    pick = random.Random(7)

    def decode(name: str, rows: list[Any]) -> Any:
        with lock:
            active[name] = active.get(name, 0) + 1
            if active[name] > 1:
                overlapped.append(name)
            threads_seen.add(threading.current_thread().name)
        time.sleep(pick.choice((0.0, 0.001, 0.004)))
        with lock:
            active[name] -= 1
        return np.full(1, int(rows[0]), dtype=np.float32)

    queues = {name: ChunkQueue(decode, name, worker) for name in "abc"}
    got: dict[str, list[int]] = {name: [] for name in queues}
    try:
        for i in range(30):
            for name, queue in queues.items():
                queue.push([torch.tensor(i)])
                got[name].extend(int(c[0]) for c in queue.ready())
        for name, queue in queues.items():
            got[name].extend(int(c[0]) for c in queue.drain())
    finally:
        worker.close()
    assert all(chunks == list(range(30)) for chunks in got.values())
    assert overlapped == []
    assert threading.current_thread().name in threads_seen and "s2s.codec" in threads_seen


@pytest.mark.slow
@pytest.mark.parametrize(("threads", "now", "on_the_worker"), [("2", 2, True), ("2", 1, False), ("1", 1, False)])
def test_auto_takes_the_codec_thread_only_with_two_threads_in_force(threads: str, now: int, on_the_worker: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The default ``auto``: with two threads in force (a quiet box) chunks after the first are
    decoded on the codec's thread; with one (the watch's count beside a busy process, ``now``, or
    one fixed) in line."""
    options = EngineOptions(model=str(CV), device="cpu", dtype="float32",
                            extra={"threads": threads, "max_frames": "14", "prepared_cache": "0",
                                   "codec_dtype": "float32"})  # fmt: skip
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    try:
        submitted = []
        worker = engine.codec_worker  # none where one thread is fixed; else made once, used per utterance
        if worker is not None:
            submit = worker.submit
            monkeypatch.setattr(worker, "submit", lambda *a: submitted.append(1) or submit(*a))
        assert (worker is not None) == (threads == "2")
        assert engine.threads is not None
        monkeypatch.setattr(engine.threads, "threads", now)
        chunks = _chunks(engine)
        assert len(chunks) > 3
        assert bool(submitted) == on_the_worker
    finally:
        engine.close_blocking()


def test_an_unknown_overlap_value_is_refused_naming_the_option() -> None:
    """A wrong setting (exit 78, the typed options of ``options.py``), not an engine failure (69)."""
    from s2s_daemon.errors import ConfigError

    options = EngineOptions(model=str(CV), device="cpu", dtype="float32", extra={"codec_overlap": "sometimes"})
    with pytest.raises(ConfigError, match=r"tts\.options\.codec_overlap: 'sometimes': Input should be 'auto', 'on'"):
        TorchQwen3Engine(options).load_blocking()
