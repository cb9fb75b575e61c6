"""CUDA graphs for the two decode steps (talker position, predictor codebook), guarded.

A graph needs static shapes and addresses:
- the predictor steps read the runtime's fixed scratch buffers (``pred_input``,
  ``frame_embeds``) and write a fixed 17-position cache, so each of the G-1 steps is captured
  as is, once;
- the talker step attends over its whole preallocated cache with an additive mask, writes its
  keys with ``index_copy_`` at a position held in a device tensor, and reads rope rows with
  ``index_select``; it is captured per (cache, rope table) pair and recaptured if either grows.
Sampling stays outside the graphs. Any capture failure logs once and falls back to eager steps.
Never exercised on this project's CPU-only CI; see the tests' CPU run of the same static-shape path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import torch

if TYPE_CHECKING:
    from s2s_daemon.tts.torch_qwen3.runtime import TalkerRuntime

log = structlog.get_logger(__name__)

WARMUP_ITERS = 2


class CudaGraphSteps:
    """Replays captured decode steps; ``disabled`` after a failed capture."""

    def __init__(self) -> None:
        self.disabled = False
        self._pool: Any = None
        self._pred: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []
        self._talker: tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor] | None = None
        self._talker_key: tuple[int, int] | None = None
        self._x: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def _capture(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_ITERS):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        return graph, out

    def begin(self, rt: TalkerRuntime, prefill_len: int) -> None:
        """Called after the prefill: (re)capture as needed and reset the talker mask."""
        if self.disabled:
            return
        try:
            if not self._pred:
                self._capture_predictor(rt)
            cache = rt.talker_cache
            assert cache is not None
            key = (id(cache), id(rt._cos))
            if self._talker_key != key:
                self._capture_talker(rt, prefill_len)
                self._talker_key = key
            assert self._mask is not None
            self._mask.fill_(float("-inf"))
            self._mask[..., :prefill_len] = 0.0
        except (RuntimeError, AssertionError) as exc:
            log.warning("cuda_graphs_disabled", error=str(exc))
            self.disabled = True
            self._pred, self._talker = [], None

    def _capture_predictor(self, rt: TalkerRuntime) -> None:
        graphs: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []
        for step in range(rt.groups - 1):

            def fn(s: int = step) -> torch.Tensor:
                block = rt.pred_input if s == 0 else rt.frame_embeds[:, s : s + 1]
                return rt.predictor_logits(block, s)

            graph, out = self._capture(fn)
            graphs.append((graph, out))
        self._pred = graphs

    def _capture_talker(self, rt: TalkerRuntime, start: int) -> None:
        cache = rt.talker_cache
        assert cache is not None
        self._x = torch.zeros(1, 1, rt.hidden, device=rt.device, dtype=rt.dtype)
        self._pos = torch.full((1,), start, dtype=torch.long, device=rt.device)
        self._mask = torch.zeros(1, 1, 1, cache.max_len, device=rt.device, dtype=rt.dtype)
        x, pos, mask = self._x, self._pos, self._mask
        cos_table, sin_table = rt._cos, rt._sin

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            cos = cos_table.index_select(0, pos)
            sin = sin_table.index_select(0, pos)
            h = rt.talker.model.run(x, cos, sin, cache, 0, mask=mask, positions=pos)
            return rt.talker.codec_head(h)[:, 0].float(), h

        graph, out = self._capture(step)
        self._talker = (graph, out[0], out[1])

    def predictor(self, rt: TalkerRuntime, step: int) -> torch.Tensor:
        if self.disabled or not self._pred:
            if step == 0:
                return rt.predictor_logits(rt.pred_input, 0)
            return rt.predictor_logits(rt.frame_embeds[:, step : step + 1], step)
        graph, out = self._pred[step]
        graph.replay()
        return out

    def talker(self, rt: TalkerRuntime, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.disabled or self._talker is None:
            return rt.talker_step(x, pos)
        assert self._x is not None and self._pos is not None and self._mask is not None
        self._x.copy_(x)
        self._pos.fill_(pos)
        self._mask[..., pos] = 0.0
        graph, logits, hidden = self._talker
        graph.replay()
        return logits, hidden
