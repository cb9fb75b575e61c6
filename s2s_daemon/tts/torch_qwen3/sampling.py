"""Token choice with Hugging Face ``generate`` semantics, on tensors that stay on the device.

Order (as transformers applies it): repetition penalty, suppression masks, then, when sampling,
temperature, top-k, top-p and a multinomial draw. Greedy is argmax after the penalty and masks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from s2s_daemon.tts.torch_qwen3.config import SamplingSettings

if TYPE_CHECKING:
    from s2s_daemon.tts.torch_qwen3.native import Kernels


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF RepetitionPenalty: divide positive, multiply negative logits of ids already generated.

    ``logits`` float32 ``[1, V]``; ``seen`` bool ``[1, V]``.
    """
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def choose(
    logits: torch.Tensor,
    settings: SamplingSettings,
    greedy: bool,
    generator: torch.Generator | None,
    kernels: Kernels | None = None,
) -> torch.Tensor:
    """Pick one id per row of float32 ``logits`` ``[1, V]``; returns a long tensor ``[1, 1]``.

    With ``kernels`` (the native CPU kernels) a row on the CPU is drawn by ``Kernels.sample`` in one
    call, from the same distribution, with one uniform number from ``generator``: the code
    predictor draws 15 times a frame, and each of the dozen torch operators of a draw here runs
    slowly between the kernels' passes, which leave the caches cold (``scripts/bench_sampling.py``).
    """
    if greedy or not settings.do_sample:
        return logits.argmax(dim=-1, keepdim=True)
    temperature = draw_settings(settings)[0]
    if kernels is not None and logits.device.type == "cpu" and logits.shape[0] == 1 and logits.dtype == torch.float32:
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        row = logits if logits.is_contiguous() else logits.contiguous()
        drawn = kernels.sample(row, temperature, settings.top_k, settings.top_p, u)
        return torch.full((1, 1), drawn, dtype=torch.long)
    scores = logits / temperature if temperature != 1.0 else logits
    if scores.device.type == "cpu" and 0 < settings.top_k < scores.shape[-1]:
        kept = top_k_probabilities(scores, settings)
        if kept is not None:
            probs, ids = kept
            return ids.gather(-1, torch.multinomial(probs, num_samples=1, generator=generator))
    return torch.multinomial(filtered_probabilities(scores, settings), num_samples=1, generator=generator)


def draw_settings(settings: SamplingSettings) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a sampled draw: a temperature of 0 or 1 divides nothing (HF
    leaves the scores as they are)."""
    temperature = settings.temperature if settings.temperature not in (0.0, 1.0) else 1.0
    return temperature, settings.top_k, settings.top_p


def filtered_probabilities(scores: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The distribution HF draws from: ``scores`` (temperature applied) through top-k and top-p,
    softmax over the whole vocabulary ``[1, V]``."""
    if settings.top_k > 0:
        k = min(settings.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - settings.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def top_k_probabilities(scores: torch.Tensor, settings: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``filtered_probabilities`` on the ``top_k`` candidates alone: (their probabilities, their ids),
    both ``[1, top_k]``; None when a tie at the k-th score makes HF's mask keep more than ``top_k``
    (or fewer than ``top_k`` scores are finite). Top-p, softmax and the draw then cost ``top_k``
    elements, not the vocabulary's (the code predictor draws 15 times a frame from 2,048)."""
    k = settings.top_k
    values, ids = torch.topk(scores, k, dim=-1)  # descending
    if int((scores >= values[..., -1:]).sum()) != k * scores.shape[0]:  # a CPU tensor: no device sync
        return None
    if settings.top_p < 1.0:
        ascending = values.flip(-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1.0 - settings.top_p)
        remove[..., -1:] = False
        values = ascending.masked_fill(remove, float("-inf")).flip(-1)
    return values.softmax(dim=-1), ids
