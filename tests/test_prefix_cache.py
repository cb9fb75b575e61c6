"""The talker's prefix cache (``runtime.PrefixCache``): a prompt that begins as a recent one did runs
only its new positions, and decodes what it decodes with every prompt run whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.engine import SynthesisRequest  # noqa: E402
from s2s_daemon.tts.torch_qwen3 import TorchQwen3Engine  # noqa: E402
from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions, PrefixCache  # noqa: E402
from tests.test_torch_batch import _engine as batch_engine  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120), pytest.mark.usefixtures("torch_one_thread")]

CV = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
FRAMES = 12


def _engine(kernels: str = "torch", quantization: str = "none", **extra: str) -> TorchQwen3Engine:
    """The tiny CustomVoice engine of the batch tests, torch's own kernels unless told."""
    return batch_engine(kernels, quantization, **extra)


def _request(engine: TorchQwen3Engine, text: str, voice: int = 0, **kw: Any) -> SynthesisRequest:
    assert engine.info is not None
    return SynthesisRequest(text=text, voice=engine.info.voices[voice], language="auto", greedy=True, **kw)


def _decode(engine: TorchQwen3Engine, request: SynthesisRequest) -> tuple[Any, Any]:
    """(first-step logits, codes) of ``request`` through ``TalkerRuntime.frames``."""
    runtime, gen = engine.runtime, engine.gen
    assert runtime is not None and gen is not None
    with torch.inference_mode():
        prompt = engine.prepare(request)[0]
        _fresh_cache(engine, prompt.prefill.shape[1] + FRAMES + 1)
        logits, _ = runtime.prefill(prompt.prefill)
        _fresh_cache(engine, prompt.prefill.shape[1] + FRAMES + 1)
        options = DecodeOptions(max_frames=FRAMES, greedy=True, seed=None)
        codes = torch.stack([row.clone() for row in runtime.frames(prompt, gen, options, lambda: False)])
    return logits.clone(), codes


def _fresh_cache(engine: TorchQwen3Engine, positions: int) -> None:
    """A new, zeroed talker cache: the runtime's own keeps the last request's keys, which would hide
    positions that a reuse failed to restore."""
    assert engine.runtime is not None
    engine.runtime.talker_cache = None
    engine.runtime.ensure_capacity(positions)


def _prompt_rows(engine: TorchQwen3Engine, request: SynthesisRequest) -> Any:
    with torch.inference_mode():
        return engine.prepare(request)[0].prefill[0]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[TorchQwen3Engine, TorchQwen3Engine]]:
    """The same checkpoint with the prefix cache and without it (torch's own kernels, float32)."""
    cached, whole = _engine(), _engine(prefix_cache_rows="0")
    assert whole.runtime is not None and whole.runtime.prefixes is None
    yield cached, whole
    cached.close_blocking()
    whole.close_blocking()


@pytest.mark.slow
def test_a_new_sentence_in_the_same_voice_reuses_the_voices_positions(
    pair: tuple[TorchQwen3Engine, TorchQwen3Engine],
) -> None:
    cached, whole = pair
    prefixes = cached.runtime.prefixes if cached.runtime is not None else None
    assert prefixes is not None
    prefixes.clear()
    first, second = _request(cached, "The kettle is boiling."), _request(cached, "Someone is at the door.")
    _decode(cached, first)
    before = prefixes.reused
    logits, codes = _decode(cached, second)
    reused = prefixes.reused - before
    # What the two prompts share: their first positions, up to the first that differs.
    a, b = _prompt_rows(cached, first), _prompt_rows(cached, second)
    shared = int((~(a[: b.shape[0]] == b[: a.shape[0]]).all(dim=-1)).nonzero()[0, 0])
    assert shared >= 4  # the role tokens and the codec tags of the voice at least
    # frames() prefills the same prompt again after _decode's own prefill: the second of them reuses
    # all but the last position, the first reuses what the sentences share.
    assert reused == shared + b.shape[0] - 1
    ref_logits, ref_codes = _decode(whole, second)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(codes, ref_codes)


def test_another_voice_shares_only_the_role_positions(pair: tuple[TorchQwen3Engine, TorchQwen3Engine]) -> None:
    cached, whole = pair
    prefixes = cached.runtime.prefixes if cached.runtime is not None else None
    assert prefixes is not None and cached.info is not None and len(cached.info.voices) >= 2
    prefixes.clear()
    with torch.inference_mode():
        a = cached.prepare(_request(cached, "The kettle is boiling.", voice=0))[0].prefill
        b = cached.prepare(_request(cached, "The kettle is boiling.", voice=1))[0].prefill
    runtime = cached.runtime
    assert runtime is not None
    with torch.inference_mode():
        _fresh_cache(cached, 64)
        runtime.prefill(a)
        before = prefixes.reused
        _fresh_cache(cached, 64)
        logits, _ = runtime.prefill(b)
    reused = prefixes.reused - before
    assert 0 < reused < b.shape[1] - 1
    assert not torch.equal(a[0, reused], b[0, reused])  # it stopped where the voices part
    ref_logits, ref_codes = _decode(whole, _request(whole, "The kettle is boiling.", voice=1))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(_decode(cached, _request(cached, "The kettle is boiling.", voice=1))[1], ref_codes)


@pytest.mark.slow
def test_the_cache_holds_at_most_its_rows_most_recent_first() -> None:
    engine = _engine(prefix_cache_rows="40")
    try:
        runtime = engine.runtime
        assert runtime is not None and runtime.prefixes is not None
        prefixes = runtime.prefixes
        texts = ["One two three.", "Four five six seven.", "Eight nine ten eleven twelve.", "Thirteen."]
        for text in texts:
            _decode(engine, _request(engine, text))
            assert sum(e.embeds.shape[0] for e in prefixes.entries) <= 40
        newest = _prompt_rows(engine, _request(engine, texts[-1]))
        kept = prefixes.entries[-1].embeds
        assert torch.equal(kept, newest[: kept.shape[0]])
        # A prompt longer than the whole cache keeps its first 40 positions.
        long = _request(engine, "A sentence long enough to need more positions than the cache holds, " * 2)
        _decode(engine, long)
        assert [e.embeds.shape[0] for e in prefixes.entries] == [40]
    finally:
        engine.close_blocking()


@pytest.mark.slow
def test_batched_requests_reuse_too_and_decode_the_same() -> None:
    """``TalkerRuntime.start`` (the batch's prefill) takes kept positions as ``frames`` does."""
    cached, whole = _engine(), _engine(prefix_cache_rows="0")
    try:
        results = []
        for engine in (cached, whole):
            runtime, gen = engine.runtime, engine.gen
            assert runtime is not None and gen is not None
            with torch.inference_mode():
                seqs = [
                    runtime.start(engine.prepare(_request(engine, t))[0], DecodeOptions(FRAMES, True, None))
                    for t in ("Good morning.", "Good evening, everyone.")
                ]
                codes: list[list[Any]] = [[], []]
                while not all(s.done for s in seqs):
                    for k, row in enumerate(runtime.step_batch(seqs, gen)):
                        if row is not None:
                            codes[k].append(row.clone())
            results.append([torch.stack(c) for c in codes])
        assert cached.runtime is not None and cached.runtime.prefixes is not None
        assert cached.runtime.prefixes.reused >= 4
        for got, want in zip(results[0], results[1], strict=True):
            assert torch.equal(got, want)
    finally:
        cached.close_blocking()
        whole.close_blocking()


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_native_kernels_reuse_within_rounding(quantization: str) -> None:
    """The native stack runs a prompt 4 positions at a time, so where the run starts moves the block
    boundaries: the logits agree within rounding, not bit for bit."""
    cached = _engine("native", quantization)
    whole = _engine("native", quantization, prefix_cache_rows="0")
    try:
        _decode(cached, _request(cached, "The kettle is boiling."))
        request = _request(cached, "Someone is at the door.")
        runtime, prefixes = cached.runtime, cached.runtime.prefixes if cached.runtime else None
        assert runtime is not None and prefixes is not None
        before = prefixes.reused
        with torch.inference_mode():
            prompt = cached.prepare(request)[0].prefill
            _fresh_cache(cached, prompt.shape[1] + 1)
            logits, _ = runtime.prefill(prompt)
        assert prefixes.reused - before >= 4
        with torch.inference_mode():
            wrt = whole.runtime
            assert wrt is not None
            wrt.ensure_capacity(prompt.shape[1] + 1)
            ref, _ = wrt.prefill(prompt)
        scale = float(ref.abs().max())
        assert float((logits - ref).abs().max()) <= 1e-4 * max(1.0, scale)
    finally:
        cached.close_blocking()
        whole.close_blocking()


def test_prefix_cache_unit_common_rows() -> None:
    rows = torch.arange(12.0).reshape(6, 2)
    other = rows.clone()
    other[4] += 1
    assert PrefixCache._common(rows, other) == 4
    assert PrefixCache._common(rows, rows[:3]) == 3
    assert PrefixCache._common(rows, rows) == 6
    other[0] += 1
    assert PrefixCache._common(rows, other) == 0


def test_where_a_prompts_numbers_differ_the_last_positions_run_as_a_prompt() -> None:
    """On the amx path a prompt's integer products run on bfloat16 tiles and a lone row's on the
    int8 kernels (``Stack.prompt_rows``): the same sentence said again keeps all of its prompt but
    the last position, which must then run with the positions before it as a prompt, as in the
    first run, or its numbers (and on random weights its codes) would not be the first run's.
    Here the rule is forced on whatever path runs, and the rows of each call counted."""
    engine = _engine("native", "int8")
    try:
        runtime = engine.runtime
        assert runtime is not None and runtime.prefixes is not None
        stack = runtime.talker.model
        assert stack.native is not None and stack.native_prompt
        rows: list[int] = []
        run = stack.run

        def counted(x: Any, *args: Any, **kwargs: Any) -> Any:
            rows.append(int(x.shape[1]))
            return run(x, *args, **kwargs)

        stack.run = counted  # type: ignore[method-assign]
        request = _request(engine, "The kettle is boiling.")
        with torch.inference_mode():
            prompt = engine.prepare(request)[0].prefill
            n = prompt.shape[1]
            runtime.ensure_capacity(n + 1)
            for prompt_rows, want in ((0, 1), (5, 5)):
                stack.native.prompt_rows = prompt_rows
                runtime.prefixes.clear()
                runtime.prefill(prompt)  # whole, kept
                rows.clear()
                runtime.prefill(prompt)  # kept but its last position
                assert sum(rows) == want, (prompt_rows, rows, n)
    finally:
        engine.close_blocking()
