"""The sampler's short path (top-p, softmax and the draw over the ``top_k`` candidates alone)
draws from the distribution of the whole-vocabulary path, HF's order of filters."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.torch_qwen3.config import SamplingSettings  # noqa: E402
from s2s_daemon.tts.torch_qwen3.sampling import choose, filtered_probabilities, top_k_probabilities  # noqa: E402


def _settings(top_k: int, top_p: float) -> SamplingSettings:
    return SamplingSettings(do_sample=True, temperature=0.9, top_k=top_k, top_p=top_p)


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


def test_draws_follow_the_filtered_distribution() -> None:
    # The ids drawn through choose (the short path) land where the whole-vocabulary
    # distribution puts its mass, in proportion: 4,000 draws, each candidate within 4 sigma.
    generator = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 2048, generator=generator) * 2
    settings = _settings(20, 0.9)
    expected = filtered_probabilities(scores / settings.temperature, settings)[0]
    counts = torch.zeros(2048)
    n = 4000
    for _ in range(n):
        counts[int(choose(scores, settings, False, generator))] += 1
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(expected).flatten().tolist())
    sigma = (n * expected * (1 - expected)).sqrt()
    assert bool(((counts - n * expected).abs() <= 4 * sigma + 1).all())
