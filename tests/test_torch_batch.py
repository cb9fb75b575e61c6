"""Several requests decoded together (``TalkerRuntime.step_batch``, ``EngineWorker``'s batch):
each gets the codes and audio it gets alone, joins and leaves at any frame, and fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.engine import EngineError, EngineOptions, SynthesisRequest, UnknownVoiceError  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine, native  # noqa: E402
from s2s_daemon.tts.torch_qwen3.layers import KVCache  # noqa: E402
from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions  # noqa: E402
from s2s_daemon.tts.worker import EngineWorker  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120), pytest.mark.usefixtures("torch_one_thread")]

CV = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
TEXTS = ["Hello there, how are you today?", "The quick brown fox.", "A longer sentence that keeps going, on and on."]
FRAMES = 16


def _native_or_skip() -> None:
    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")


def _engine(kernels: str = "native", quantization: str = "none", **extra: str) -> TorchQwen3Engine:
    if kernels == "native" or quantization == "int4":
        _native_or_skip()
    options = EngineOptions(
        model=str(CV),
        device="cpu",
        dtype="float32",
        quantization=quantization,
        kernels=kernels,
        extra={"max_frames": str(FRAMES), **extra},
    )
    engine = TorchQwen3Engine(options)
    engine.load_blocking()
    return engine


@pytest.fixture(scope="module")
def fp32() -> Iterator[TorchQwen3Engine]:
    engine = _engine()
    yield engine
    engine.close_blocking()


def _requests(engine: TorchQwen3Engine, **kw: Any) -> list[SynthesisRequest]:
    voices = engine.info.voices if engine.info is not None else ()
    return [
        SynthesisRequest(text=t, voice=voices[i % len(voices)], language="auto", greedy=True, **kw)
        for i, t in enumerate(TEXTS)
    ]


def _batched_codes(engine: TorchQwen3Engine, requests: list[SynthesisRequest], join_at: int) -> list[Any]:
    """Codes of each request decoded together; the last joins the batch at step ``join_at``."""
    runtime = engine.runtime
    assert runtime is not None and engine.gen is not None
    with torch.inference_mode():
        seqs = []
        for request in requests:
            prompt, _, _, budget = engine.prepare(request)
            seqs.append(runtime.start(prompt, DecodeOptions(max_frames=budget, greedy=True, seed=None)))
        rows: list[list[Any]] = [[] for _ in seqs]
        active = seqs[:-1]
        step = 0
        while any(not s.done for s in seqs):
            if step == join_at:
                active.append(seqs[-1])
            for seq, row in zip(active, runtime.step_batch(active, engine.gen), strict=True):
                if row is not None:
                    rows[seqs.index(seq)].append(row.clone())
            step += 1
    return [torch.stack(r) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_batched_codes_are_each_requests_codes_alone(kernels: str) -> None:
    """float32 (native kernels: rows of one pass; torch's: a run per row): bit for bit what each
    request decodes alone, a request joining mid-way included."""
    engine = _engine(kernels)
    try:
        requests = _requests(engine)
        alone = [engine.codes_blocking(r) for r in requests]
        together = _batched_codes(engine, requests, join_at=3)
    finally:
        engine.close_blocking()
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape == (FRAMES, 16)
        assert torch.equal(a, b)


@pytest.mark.parametrize(("quantization", "atol"), [("none", 1e-5), ("int8", 1e-4), ("int4", 1e-4)])
def test_native_run_rows_is_run_per_sequence(quantization: str, atol: float) -> None:
    """The kernel: rows of two caches at their own positions (one with two consecutive rows) give
    what each cache's own run gives, and write the same keys; and six rows, more than a stream's
    four (integer weights: one call, on the prompt's tiled products; float: two calls). (int8 and
    int4 sum a lone row in two chains, several in one (native/x86.inc): the last bits may differ,
    so batched greedy codes of random weights can part from the codes alone at a near tie.)"""
    engine = _engine(quantization=quantization)
    try:
        runtime = engine.runtime
        assert runtime is not None
        stack = runtime.talker.model
        cfg = engine.cfg
        assert cfg is not None and stack.native is not None
        runtime.ensure_capacity(64)
        gen = torch.Generator().manual_seed(0)
        hidden = runtime.hidden
        caches = [KVCache(cfg.talker.decoder, 32, runtime.device, runtime.dtype) for _ in range(2)]
        ref = [KVCache(cfg.talker.decoder, 32, runtime.device, runtime.dtype) for _ in range(2)]
        for c, r in zip(caches, ref, strict=True):
            fill = torch.randn(c.k.shape, generator=gen)
            c.k.copy_(fill)
            r.k.copy_(fill)
            c.v.copy_(fill * 0.5)
            r.v.copy_(fill * 0.5)
        x = torch.randn(1, 3, hidden, generator=gen)
        rows = [(0, 7), (1, 12), (1, 13)]
        pos = torch.tensor([p for _, p in rows])
        cos, sin = runtime._cos.index_select(0, pos), runtime._sin.index_select(0, pos)
        got = stack.run_rows(x, cos, sin, caches, rows)
        want0 = stack.run(x[:, 0:1], cos[0:1], sin[0:1], ref[0], 7)
        want1 = stack.run(x[:, 1:3], cos[1:3], sin[1:3], ref[1], 12)
        # Six rows: three of each cache, at positions after the ones above.
        x6 = torch.randn(1, 6, hidden, generator=gen)
        rows6 = [(0, 8), (1, 14), (0, 9), (1, 15), (0, 10), (1, 16)]
        pos6 = torch.tensor([p for _, p in rows6])
        cos6, sin6 = runtime._cos.index_select(0, pos6), runtime._sin.index_select(0, pos6)
        got6 = stack.run_rows(x6, cos6, sin6, caches, rows6)
        want6 = [stack.run(x6[:, c::2].contiguous(), cos6[c::2].contiguous(), sin6[c::2].contiguous(), ref[c], start)
                 for c, start in ((0, 8), (1, 14))]  # fmt: skip
        isa = engine.info.isa if engine.info is not None else ""
    finally:
        engine.close_blocking()
    torch.testing.assert_close(got, torch.cat([want0, want1], dim=1), rtol=0, atol=atol)
    # On the amx path the six rows' integer products run on bfloat16 tiles (the input rounded to
    # bfloat16, not to int8 per block as the three rows alone are): outputs 2e-3 and keys (after
    # their norm) 2e-2 apart at most here, where a row at another position or in the other cache
    # is tenths to units apart.
    atol6 = 3e-2 if quantization != "none" and isa.startswith("amx") else atol
    torch.testing.assert_close(got6[:, 0::2], want6[0], rtol=0, atol=atol6)
    torch.testing.assert_close(got6[:, 1::2], want6[1], rtol=0, atol=atol6)
    for c, r in zip(caches, ref, strict=True):
        torch.testing.assert_close(c.k, r.k, rtol=0, atol=atol6)


def test_max_batch_follows_the_kernels(fp32: TorchQwen3Engine) -> None:
    assert fp32.max_batch == 4
    plain = _engine("torch")
    try:
        assert plain.max_batch == 1  # torch's kernels gain nothing from it: the worker interleaves
    finally:
        plain.close_blocking()


async def _collect(worker: EngineWorker, request: SynthesisRequest, stop_after: int | None = None) -> np.ndarray:
    chunks: list[np.ndarray] = []
    stop = [False]
    async for chunk in worker.stream(request, lambda: stop[0]):
        chunks.append(chunk)
        if stop_after is not None and len(chunks) >= stop_after:
            stop[0] = True
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


@pytest.mark.slow
async def test_worker_streams_together_give_each_requests_audio(fp32: TorchQwen3Engine) -> None:
    """Through the daemon's path: more streams than fit in a batch, all at once; each gets the
    audio it gets alone; and they overlap (the second's first chunk comes before the first ends)."""
    worker = EngineWorker(fp32, stall_timeout_s=60)
    requests = (_requests(fp32, chunk_frames=4) * 2)[:6]
    alone = [await _collect(worker, r) for r in requests[:3]]
    firsts: dict[int, float] = {}
    ends: dict[int, float] = {}
    loop = asyncio.get_running_loop()

    async def timed(i: int, request: SynthesisRequest) -> np.ndarray:
        chunks = []
        async for chunk in worker.stream(request, lambda: False):
            firsts.setdefault(i, loop.time())
            chunks.append(chunk)
        ends[i] = loop.time()
        return np.concatenate(chunks)

    together = await asyncio.gather(*(timed(i, r) for i, r in enumerate(requests)))
    for i, audio in enumerate(together):
        assert np.array_equal(audio, alone[i % 3]), f"stream {i}"
    assert firsts[1] < ends[0]
    assert firsts[3] < ends[5]  # a stream past the batch's four got its place while others ran


@pytest.mark.slow
async def test_a_stopped_stream_frees_its_place_and_a_bad_one_fails_alone(fp32: TorchQwen3Engine) -> None:
    worker = EngineWorker(fp32, stall_timeout_s=60)
    good = _requests(fp32, chunk_frames=2)
    bad = SynthesisRequest(text="x", voice="Nobody", language="auto", greedy=True)
    alone = await _collect(worker, good[1])

    async def fails() -> None:
        with pytest.raises(UnknownVoiceError):
            await _collect(worker, bad)

    stopped, audio, _ = await asyncio.gather(
        _collect(worker, good[0], stop_after=1), _collect(worker, good[1]), fails()
    )
    assert len(stopped) == 1920  # the one-frame first chunk, then nothing more
    assert np.array_equal(audio, alone)
    assert worker._batch() is not None and not worker._batch()._streams  # type: ignore[union-attr]


async def test_a_step_that_fails_fails_its_streams_and_the_next_request_runs(fp32: TorchQwen3Engine) -> None:
    worker = EngineWorker(fp32, stall_timeout_s=60)
    real = fp32.step_blocking
    calls = 0

    def flaky(batch: list[Any]) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a kernel failed")
        real(batch)

    fp32.step_blocking = flaky  # type: ignore[method-assign]
    try:
        requests = _requests(fp32, chunk_frames=1)
        results = await asyncio.gather(*(_collect(worker, r) for r in requests[:2]), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results), results
        after = await _collect(worker, requests[2])
    finally:
        del fp32.step_blocking
    assert len(after) == FRAMES * 1920


async def test_engine_time_limit_holds_in_a_batch(fp32: TorchQwen3Engine) -> None:
    worker = EngineWorker(fp32, stall_timeout_s=60, max_utterance_s=0.01)
    with pytest.raises(EngineError, match="max_utterance_s"):
        await _collect(worker, _requests(fp32, chunk_frames=1)[0])


@pytest.mark.slow
async def test_a_stream_whose_consumer_lags_is_paused_while_the_others_go_on(fp32: TorchQwen3Engine) -> None:
    """Back-pressure in a batch: a stream STREAM_AHEAD chunks ahead of its consumer is left out of
    the steps (it does not hold the others back), and resumes where it was when read again."""
    from s2s_daemon.tts.bridge import STREAM_AHEAD

    worker = EngineWorker(fp32, stall_timeout_s=60)
    slow_request, fast_request = _requests(fp32, chunk_frames=1)[:2]
    slow_alone = await _collect(worker, slow_request)
    fast_done = asyncio.Event()
    chunks: list[np.ndarray] = []
    held_at: int | None = None

    async def slow() -> None:
        nonlocal held_at
        async for chunk in worker.stream(slow_request, lambda: False):
            chunks.append(chunk)
            if len(chunks) == 1:
                await fast_done.wait()  # the engine fills this stream's buffer meanwhile, then skips it
                batch = worker._batch()
                assert batch is not None
                held_at = len(batch._streams[0]._items) if batch._streams else None

    async def fast() -> None:
        await _collect(worker, fast_request)
        fast_done.set()

    await asyncio.gather(slow(), fast())
    assert FRAMES > STREAM_AHEAD + 1
    assert held_at is not None and STREAM_AHEAD <= held_at < FRAMES - 1
    assert np.array_equal(np.concatenate(chunks), slow_alone)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("block", [None, 8])  # the whole prompt in one call; in blocks of 8
def test_an_integer_prompt_runs_through_the_native_stack(quantization: str, block: int | None) -> None:
    """A prompt with integer weights runs through the native stack, in one call up to its
    ``max_rows`` positions and beyond block by block (each block attending to what the blocks before
    it wrote): the same hidden states as the float path within the activations' int8 rounding, and
    the same keys in the cache."""
    engine = _engine(quantization=quantization)
    try:
        runtime = engine.runtime
        assert runtime is not None
        stack = runtime.talker.model
        assert stack.native_prompt
        with torch.inference_mode():
            prompt = engine.prepare(_requests(engine)[2])[0].prefill
            n = prompt.shape[1]
            assert n > 4 * 2
            assert n <= stack.native.max_rows
            if block is not None:
                stack.native.max_rows = block
            calls = 0
            run = stack.native.run

            def counted(*args: Any) -> torch.Tensor:
                nonlocal calls
                calls += 1
                return run(*args)

            stack.native.run = counted
            runtime.ensure_capacity(n + 1)
            cache = runtime.talker_cache
            assert cache is not None
            blocks = stack.run(prompt, runtime._cos[:n], runtime._sin[:n], cache, 0)
            assert calls == (1 if block is None else -(-n // block))
            keys = cache.k[:, :, :, :n].clone()
            stack.native_prompt = False
            try:
                float_path = stack.run(prompt, runtime._cos[:n], runtime._sin[:n], cache, 0)
            finally:
                stack.native_prompt = True
    finally:
        engine.close_blocking()
    rms = float((blocks - float_path).pow(2).mean().sqrt() / float_path.pow(2).mean().sqrt())
    assert rms < 0.05, rms
    key_rms = float((keys - cache.k[:, :, :, :n]).pow(2).mean().sqrt() / keys.pow(2).mean().sqrt())
    assert key_rms < 0.05, key_rms
