"""The sampler's short path (top-p, softmax and the draw over the ``top_k`` candidates alone)
draws from the distribution of the whole-vocabulary path, HF's order of filters."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.torch_qwen3.config import SamplingSettings  # noqa: E402
from s2s_daemon.tts.torch_qwen3.sampling import choose, filtered_probabilities, top_k_probabilities  # noqa: E402


def _settings(top_k: int, top_p: float) -> SamplingSettings:
    return SamplingSettings(do_sample=True, temperature=0.9, top_k=top_k, top_p=top_p)


def _kernels() -> Any:
    from s2s_daemon.tts.torch_qwen3 import native

    ext = native.load()
    if ext is None:
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    return ext


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (50, 0.8), (50, 0.05), (7, 0.9), (1, 1.0)])
def test_top_k_probabilities_are_the_whole_vocabularys(top_k: int, top_p: float) -> None:
    generator = torch.Generator().manual_seed(top_k)
    for _ in range(20):
        scores = torch.randn(1, 2048, generator=generator) * 3
        settings = _settings(top_k, top_p)
        kept = top_k_probabilities(scores, settings)
        assert kept is not None
        probs, ids = kept
        spread = torch.zeros_like(scores).scatter(-1, ids, probs)
        torch.testing.assert_close(spread, filtered_probabilities(scores, settings), rtol=1e-5, atol=1e-7)


def test_a_tie_at_the_kth_score_takes_the_whole_vocabulary_path() -> None:
    scores = torch.zeros(1, 2048)
    scores[0, :10] = torch.arange(10, 0, -1).float()  # the 11th best ties with 2,038 others
    assert top_k_probabilities(scores, _settings(11, 1.0)) is None
    masked = torch.full((1, 2048), float("-inf"))
    masked[0, :5] = 1.0  # fewer finite scores than top_k
    assert top_k_probabilities(masked, _settings(50, 1.0)) is None
    draw = choose(masked, _settings(50, 1.0), False, torch.Generator().manual_seed(0))
    assert 0 <= int(draw) < 5


@pytest.mark.parametrize("native", [False, True])
def test_draws_follow_the_filtered_distribution(native: bool) -> None:
    # The ids drawn through choose (the short path in torch, or the native kernels' one call) land
    # where the whole-vocabulary distribution puts its mass, in proportion: 4,000 draws, each
    # candidate within 4 sigma.
    kernels = _kernels() if native else None
    generator = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 2048, generator=generator) * 2
    settings = _settings(20, 0.9)
    expected = filtered_probabilities(scores / settings.temperature, settings)[0]
    counts = torch.zeros(2048)
    n = 4000
    for _ in range(n):
        drawn = choose(scores, settings, False, generator, kernels)
        assert drawn.shape == (1, 1) and drawn.dtype == torch.long
        counts[int(drawn)] += 1
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(expected).flatten().tolist())
    sigma = (n * expected * (1 - expected)).sqrt()
    assert bool(((counts - n * expected).abs() <= 4 * sigma + 1).all())


@pytest.mark.arm64
@pytest.mark.parametrize(
    "top_k,top_p,tie",
    [(50, 1.0, False), (50, 0.8, False), (7, 0.9, False), (0, 1.0, False), (0, 0.5, False), (11, 1.0, True)],
)
def test_the_native_draw_gives_each_id_its_probability(top_k: int, top_p: float, tie: bool) -> None:
    # u swept over [0, 1) on a grid: the share of the grid that draws each id is the id's
    # probability in the whole-vocabulary distribution (HF's filters), to the grid's resolution.
    # tie: the 11th best ties with the rest, which HF's mask keeps (the torch short path falls back).
    ext = _kernels()
    generator = torch.Generator().manual_seed(top_k + int(100 * top_p))
    scores = torch.randn(1, 256, generator=generator) * 2
    if tie:
        scores = torch.zeros(1, 256)
        scores[0, :10] = torch.arange(10, 0, -1).float() / 4
    settings = SamplingSettings(do_sample=True, temperature=0.7, top_k=top_k, top_p=top_p)
    expected = filtered_probabilities(scores / settings.temperature, settings)[0].double()
    n = 4000
    counts = torch.zeros(256, dtype=torch.float64)
    for i in range(n):
        counts[ext.sample(scores[0], settings.temperature, top_k, top_p, (i + 0.5) / n)] += 1
    assert float((counts / n - expected).abs().max()) <= 1.5 / n + 1e-6
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(expected).flatten().tolist())


def test_a_seed_repeats_the_native_draws() -> None:
    # The draw's uniform number comes from the request's generator: the same seed, the same ids.
    ext = _kernels()
    scores = torch.randn(1, 2048, generator=torch.Generator().manual_seed(1)) * 2
    settings = _settings(50, 1.0)

    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [int(choose(scores, settings, False, generator, ext)) for _ in range(20)]

    assert draws(3) == draws(3) and draws(3) != draws(4)


def test_the_native_draw_refuses_what_torch_refuses() -> None:
    ext = _kernels()
    masked = torch.full((2048,), float("-inf"))
    masked[:5] = 1.0  # fewer finite scores than top_k: the finite ones alone can be drawn
    assert all(0 <= ext.sample(masked, 0.9, 50, 1.0, u / 10) < 5 for u in range(10))
    with pytest.raises(ValueError, match="finite"):
        ext.sample(torch.full((2048,), float("-inf")), 0.9, 50, 1.0, 0.5)
    with pytest.raises(ValueError, match="NaN"):
        ext.sample(torch.tensor([0.0, float("nan"), 1.0]), 0.9, 0, 1.0, 0.5)
    with pytest.raises(ValueError, match="float32"):
        ext.sample(torch.zeros(8, dtype=torch.float64), 0.9, 0, 1.0, 0.5)
