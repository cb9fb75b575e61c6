"""The decode loop: talker prefill, then per frame codebook 0, the code predictor, the next talker step.

All state lives in buffers allocated once per request (KV caches, the frame-code matrix, the
embedding scratch); the loop writes into them in place. On CUDA the talker step and the 15
predictor steps can be replayed from CUDA graphs (``graphs.py``); everywhere else they run eagerly.

Several requests decode together a step at a time (``start`` then ``step_batch``): each is a
``Sequence`` with KV caches of its own, and every talker and predictor step runs their rows in
one pass of the weights (``DecoderStack.run_rows``): on a memory-bound CPU, up to 4 rows cost
little more than one. A sequence's codes are those it would get decoded alone (``frames``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from s2s_daemon.tts.torch_qwen3.config import GenerationSettings, ModelConfig, SamplingSettings
from s2s_daemon.tts.torch_qwen3.layers import KVCache, rope_tables
from s2s_daemon.tts.torch_qwen3.prompt import PromptEmbeddings
from s2s_daemon.tts.torch_qwen3.sampling import apply_repetition_penalty, choose, draw_settings
from s2s_daemon.tts.torch_qwen3.talker import Qwen3TtsWeights

if TYPE_CHECKING:
    from s2s_daemon.tts.torch_qwen3.native import Kernels, Predictor

SUPPRESSED_TAIL = 1024
"""The official generate suppresses the top 1024 codec ids (control codes) except EOS."""
MIN_NEW_TOKENS = 2
"""The official generate forbids EOS for the first two frames."""


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """Per-request decoding choices."""

    max_frames: int
    """Codec frames at most (12.5 per second of audio)."""
    greedy: bool
    seed: int | None


@dataclass(eq=False, slots=True)
class Sequence:
    """One request's decoding state among others (``TalkerRuntime.start``, ``step_batch``)."""

    prompt: PromptEmbeddings
    options: DecodeOptions
    budget: int
    prefill_len: int
    cache: KVCache
    """The talker's keys and values, sized for the prompt and the whole frame budget."""
    pred_cache: KVCache
    codes: torch.Tensor
    """``[budget, G]``: row ``step`` is the frame being made."""
    seen: torch.Tensor
    generator: torch.Generator | None
    frame_embeds: torch.Tensor
    """``[1, G, hidden]``: the embeddings of the frame's codes, summed into the next talker input."""
    logits: torch.Tensor
    """Codebook-0 logits ``[1, V]`` of the next frame."""
    hidden: torch.Tensor
    """The talker's normed hidden state ``[1, 1, hidden]`` the next frame's predictor starts from."""
    step: int = 0
    """Frames made so far."""
    done: bool = field(default=False)
    """End of speech, or the budget spent: no more frames."""


PREFIX_ROWS = 128
"""Prompt positions whose talker keys and values are kept for later prompts (``PrefixCache``):
229 KB each for the released talkers in float32 (28 layers, 8 KV heads of 128), 29 MB in all."""


@dataclass(eq=False, slots=True)
class _KeptPrompt:
    embeds: torch.Tensor
    """``[L, hidden]``: the prompt's first L positions."""
    k: torch.Tensor
    """``[layers, 1, kv_heads, L, head_dim]``: their keys (``v`` their values)."""
    v: torch.Tensor


class PrefixCache:
    """The talker's keys and values of recent prompts, for the prompts that begin the same way.

    A prompt starts with positions that depend only on the voice (the role tokens and the codec's
    language and speaker tags; an instruction; an ICL reference's transcript), and a sentence said
    again repeats all of them. A position's keys and values depend on it and the positions before it
    alone, so a new prompt takes those of its longest common beginning with a kept one and runs only
    the rest: the same arithmetic, done once. Prompts are compared position by position, exactly.
    Holds at most ``rows`` positions in all, the most recently used prompts first.
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.entries: list[_KeptPrompt] = []
        """Oldest first."""
        self.reused = 0
        """Positions taken from kept prompts so far (tests, logs)."""

    @staticmethod
    def _common(kept: torch.Tensor, embeds: torch.Tensor) -> int:
        n = min(kept.shape[0], embeds.shape[0])
        same = (kept[:n] == embeds[:n]).all(dim=-1)
        differ = (~same).nonzero()
        return n if differ.numel() == 0 else int(differ[0, 0])

    def restore(self, embeds: torch.Tensor, cache: KVCache) -> int:
        """Copy into ``cache`` the positions that ``embeds`` ``[L, hidden]`` shares with the kept
        prompt it shares most with; returns how many (at most L - 1: the last one's output is needed)."""
        best, length = None, 0
        for entry in self.entries:
            m = self._common(entry.embeds, embeds)
            if m > length:
                best, length = entry, m
        length = min(length, embeds.shape[0] - 1)
        if best is None or length <= 0:
            return 0
        cache.k[:, :, :, :length].copy_(best.k[:, :, :, :length])
        cache.v[:, :, :, :length].copy_(best.v[:, :, :, :length])
        self.entries.remove(best)
        self.entries.append(best)
        self.reused += length
        return length

    def keep(self, embeds: torch.Tensor, cache: KVCache) -> None:
        """Keep the first positions (up to ``rows``) of the prompt ``embeds`` just run into ``cache``."""
        n = min(embeds.shape[0], self.rows)
        if n <= 0:
            return
        for entry in self.entries:
            if entry.embeds.shape[0] >= n and self._common(entry.embeds, embeds[:n]) == n:
                return  # already kept (restore made it the most recent)
        # A kept prompt this one begins with is superseded by it.
        self.entries = [e for e in self.entries if self._common(e.embeds, embeds[:n]) < e.embeds.shape[0]]
        self.entries.append(_KeptPrompt(embeds[:n].clone(), cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone()))
        while sum(e.embeds.shape[0] for e in self.entries) > self.rows:
            self.entries.pop(0)

    def clear(self) -> None:
        self.entries.clear()


class DecodeProbe:
    """Receives raw float32 logits as they are computed (parity tests, diagnostics)."""

    def talker_logits(self, step: int, logits: torch.Tensor) -> None:
        """Codebook-0 logits before any processing; step 0 comes from the prefill."""

    def predictor_logits(self, frame: int, group: int, logits: torch.Tensor) -> None:
        """Logits for codebook ``group`` (1..G-1) of ``frame``."""


class TalkerRuntime:
    """Owns the weights on their device and runs the frame loop."""

    def __init__(self, weights: Qwen3TtsWeights, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.weights = weights
        self.talker = weights.talker
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        tc = cfg.talker
        self.groups = tc.num_code_groups
        self.hidden = tc.decoder.hidden_size
        vocab = tc.decoder.vocab_size
        self._rope_len = 0
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        pc, ps = rope_tables(tc.predictor, self.groups + 1, device)
        self.pred_cos, self.pred_sin = pc.to(dtype), ps.to(dtype)
        self.pred_cache = KVCache(tc.predictor, self.groups + 1, device, dtype)
        self.talker_cache: KVCache | None = None
        suppress = torch.zeros(1, vocab, dtype=torch.bool, device=device)
        suppress[:, max(0, vocab - SUPPRESSED_TAIL) :] = True
        suppress[:, tc.codec_eos_id] = False
        self.suppress = suppress
        self.suppress_early = suppress.clone()
        self.suppress_early[:, tc.codec_eos_id] = True
        self.frame_embeds = torch.zeros(1, self.groups, self.hidden, device=device, dtype=dtype)
        self.pred_input = torch.zeros(1, 2, self.hidden, device=device, dtype=dtype)
        self.graphs: object | None = None
        """A ``graphs.CudaGraphSteps`` when CUDA graphs are enabled."""
        self.probe: DecodeProbe | None = None
        """Test/diagnostic hook that sees raw logits; None in service."""
        self.kernels: Kernels | None = None
        """The native CPU kernels, where the engine runs on them: the sampled draws take
        ``Kernels.sample`` (``sampling.choose``)."""
        self.prefixes: PrefixCache | None = PrefixCache(PREFIX_ROWS)
        """Keys and values of recent prompts' beginnings; None runs every prompt whole."""

    # -- positions ---------------------------------------------------------------------------
    def ensure_capacity(self, positions: int) -> None:
        """Make the talker rope tables and KV cache hold ``positions`` tokens."""
        self._ensure_rope(positions)
        if self.talker_cache is None or self.talker_cache.max_len < positions:
            self.talker_cache = None
            size = max(positions, 256)
            self.talker_cache = KVCache(self.cfg.talker.decoder, size, self.device, self.dtype)

    def _ensure_rope(self, positions: int) -> None:
        if positions > self._rope_len:
            size = max(positions, 2 * self._rope_len, 256)
            cos, sin = rope_tables(self.cfg.talker.decoder, size, self.device)
            self._cos, self._sin = cos.to(self.dtype), sin.to(self.dtype)
            self._rope_len = size

    # -- model pieces ------------------------------------------------------------------------
    def prefill(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompt; returns (float32 logits ``[1, V]``, normed hidden ``[1, 1, H]``)."""
        assert self.talker_cache is not None
        last = self._run_prompt(embeds, self.talker_cache)
        return self.talker.codec_head(last)[:, 0].float(), last

    def _run_prompt(self, embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The prompt ``embeds`` ``[1, L, H]`` into ``cache`` from position 0, its beginning from
        ``prefixes`` where kept; returns the last position's normed hidden ``[1, 1, H]``."""
        n = embeds.shape[1]
        prefixes = self.prefixes
        done = prefixes.restore(embeds[0], cache) if prefixes is not None else 0
        native = self.talker.model.native
        if native is not None and self.talker.model.native_prompt and 0 < n - done < native.prompt_rows:
            done = max(0, n - native.prompt_rows)  # the last positions as a prompt, as when none was kept
        h = self.talker.model.run(embeds[:, done:], self._cos[done:n], self._sin[done:n], cache, done)
        if prefixes is not None:
            prefixes.keep(embeds[0], cache)
        return h[:, -1:]

    def talker_step(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One talker position ``x`` ``[1, 1, H]`` at ``pos``; returns (logits, hidden)."""
        assert self.talker_cache is not None
        cos = self._cos[pos : pos + 1]
        sin = self._sin[pos : pos + 1]
        h = self.talker.model.run(x, cos, sin, self.talker_cache, pos)
        return self.talker.codec_head(h)[:, 0].float(), h

    def predictor_logits(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Predictor forward for codebook ``step + 1``: ``x`` is the talker-width input block.

        Step 0 is the 2-position prefill (talker hidden, codebook-0 embedding) at positions 0..1;
        step j > 0 is the single position j + 1 holding the embedding of codebook j.
        """
        cp = self.talker.code_predictor
        h_in = cp.small_to_mtp_projection(x)
        if step == 0:
            h = cp.model.run(h_in, self.pred_cos[:2], self.pred_sin[:2], self.pred_cache, 0)
        else:
            pos = step + 1
            h = cp.model.run(h_in, self.pred_cos[pos : pos + 1], self.pred_sin[pos : pos + 1], self.pred_cache, pos)
        return cp.lm_head[step](h[:, -1]).float()  # type: ignore[no-any-return]

    def predict_frame(
        self,
        hidden: torch.Tensor,
        codes: torch.Tensor,
        settings: SamplingSettings,
        greedy: bool,
        generator: torch.Generator | None,
        frame: int = 0,
    ) -> None:
        """Fill ``codes[1:]`` (a ``[G]`` row whose ``codes[0]`` is set) and ``self.frame_embeds``.

        On the native kernels the whole frame is one library call (``native.Predictor``) unless a
        probe wants the logits; it makes what the loop below makes, with the same uniform numbers
        (``torch.rand`` of G - 1 at once draws what G - 1 draws of one do)."""
        cp = self.talker.code_predictor
        cp_tables = cp.model.codec_embedding
        code0 = codes[0:1]
        self.frame_embeds[0, 0:1].copy_(self.talker.model.codec_embedding(code0))
        fused = cp.native
        if fused is not None and self.graphs is None and self.probe is None:
            sampled = not greedy and settings.do_sample
            u = torch.rand(self.groups - 1, dtype=torch.float64, generator=generator) if sampled else None
            embeds = self.frame_embeds[0]
            caches = [(self.pred_cache.k, self.pred_cache.v)]
            fused.run(hidden.reshape(1, -1), embeds[0:1], caches, self.pred_cos, self.pred_sin, [not sampled], u,
                      draw_settings(settings), codes[1:].view(1, -1), embeds[1:].unsqueeze(0))  # fmt: skip
            return
        self.pred_input[:, 0:1].copy_(hidden)
        self.pred_input[:, 1:2].copy_(self.frame_embeds[:, 0:1])
        graphs = self.graphs
        for step in range(self.groups - 1):
            if graphs is not None:
                logits = graphs.predictor(self, step)  # type: ignore[attr-defined]
            elif step == 0:
                logits = self.predictor_logits(self.pred_input, 0)
            else:
                logits = self.predictor_logits(self.frame_embeds[:, step : step + 1], step)
            if self.probe is not None:
                self.probe.predictor_logits(frame, step + 1, logits)
            code = choose(logits, settings, greedy, generator, self.kernels)
            codes[step + 1 : step + 2].copy_(code[0])
            self.frame_embeds[0, step + 1 : step + 2].copy_(cp_tables[step](code[0]))

    def _code0(
        self,
        logits: torch.Tensor,
        seen: torch.Tensor,
        step: int,
        gen: GenerationSettings,
        greedy: bool,
        generator: torch.Generator | None,
    ) -> torch.Tensor | None:
        """Codebook 0 of frame ``step`` (``[1, 1]``, marked in ``seen``), or None at end of speech."""
        logits = apply_repetition_penalty(logits, seen, gen.repetition_penalty)
        mask = self.suppress_early if step < MIN_NEW_TOKENS else self.suppress
        code0 = choose(logits.masked_fill(mask, float("-inf")), gen.talker, greedy, generator, self.kernels)
        if int(code0) == self.cfg.talker.codec_eos_id:
            return None
        seen.scatter_(1, code0, True)
        return code0

    # -- the loop ----------------------------------------------------------------------------
    def frames(
        self,
        prompt: PromptEmbeddings,
        gen: GenerationSettings,
        options: DecodeOptions,
        should_stop: Callable[[], bool],
    ) -> Iterator[torch.Tensor]:
        """Yield one ``[G]`` long tensor (on the device) per codec frame until EOS or the budget.

        ``should_stop`` is polled before every frame; True ends the iterator at once.
        """
        tc = self.cfg.talker
        budget = max(0, options.max_frames)
        prefill_len = prompt.prefill.shape[1]
        self.ensure_capacity(prefill_len + budget + 1)
        generator = self._generator(options)
        codes = torch.zeros(max(budget, 1), self.groups, dtype=torch.long, device=self.device)
        seen = torch.zeros(1, tc.decoder.vocab_size, dtype=torch.bool, device=self.device)
        trailing = prompt.trailing
        n_trailing = trailing.shape[0]
        step_input = torch.zeros(1, 1, self.hidden, device=self.device, dtype=self.dtype)
        if should_stop():
            return
        logits, hidden = self.prefill(prompt.prefill)
        graphs = self.graphs
        if graphs is not None:
            graphs.begin(self, prefill_len)  # type: ignore[attr-defined]
        probe = self.probe
        for step in range(budget):
            if probe is not None:
                probe.talker_logits(step, logits)
            code0 = self._code0(logits, seen, step, gen, options.greedy, generator)
            if code0 is None:
                return
            row = codes[step]
            row[0:1].copy_(code0[0])
            self.predict_frame(hidden, row, gen.predictor, options.greedy, generator, step)
            yield row
            if step + 1 >= budget or should_stop():
                return
            torch.sum(self.frame_embeds, dim=1, keepdim=True, out=step_input)
            step_input[0, 0].add_(trailing[step] if step < n_trailing else prompt.pad)
            pos = prefill_len + step
            if graphs is not None:
                logits, hidden = graphs.talker(self, step_input, pos)  # type: ignore[attr-defined]
            else:
                logits, hidden = self.talker_step(step_input, pos)

    def _generator(self, options: DecodeOptions) -> torch.Generator | None:
        if options.greedy:
            return None
        generator = torch.Generator(device=self.device)
        if options.seed is None:
            generator.seed()
        else:
            generator.manual_seed(options.seed)
        return generator

    # -- several requests together -----------------------------------------------------------
    def start(self, prompt: PromptEmbeddings, options: DecodeOptions) -> Sequence:
        """Prefill one request into caches of its own; ``step_batch`` then makes its frames."""
        tc = self.cfg.talker
        budget = max(0, options.max_frames)
        n = prompt.prefill.shape[1]
        self._ensure_rope(n + budget + 1)
        cache = KVCache(tc.decoder, n + budget + 1, self.device, self.dtype)
        last = self._run_prompt(prompt.prefill, cache)
        return Sequence(
            prompt=prompt,
            options=options,
            budget=budget,
            prefill_len=n,
            cache=cache,
            pred_cache=KVCache(tc.predictor, self.groups + 1, self.device, self.dtype),
            codes=torch.zeros(max(budget, 1), self.groups, dtype=torch.long, device=self.device),
            seen=torch.zeros(1, tc.decoder.vocab_size, dtype=torch.bool, device=self.device),
            generator=self._generator(options),
            frame_embeds=torch.zeros(1, self.groups, self.hidden, device=self.device, dtype=self.dtype),
            logits=self.talker.codec_head(last)[:, 0].float(),
            hidden=last,
            done=budget == 0,
        )

    def step_batch(self, seqs: list[Sequence], gen: GenerationSettings) -> list[torch.Tensor | None]:
        """One frame of every unfinished sequence, their rows together; per sequence its ``[G]`` row
        (valid until its next step), or None when it ended (end of speech) or was already done."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        live: list[tuple[int, Sequence, torch.Tensor]] = []
        for i, seq in enumerate(seqs):
            if seq.done:
                continue
            code0 = self._code0(seq.logits, seq.seen, seq.step, gen, seq.options.greedy, seq.generator)
            if code0 is None:
                seq.done = True
                continue
            row = seq.codes[seq.step]
            row[0:1].copy_(code0[0])
            live.append((i, seq, row))
        if not live:
            return out
        self._predict_rows([(seq, row) for _, seq, row in live], gen.predictor)
        going: list[Sequence] = []
        for i, seq, row in live:
            out[i] = row
            if seq.step + 1 >= seq.budget:
                seq.done = True
            else:
                going.append(seq)
        if going:
            self._talker_rows(going)
        return out

    def _talker_rows(self, seqs: list[Sequence]) -> None:
        """The next talker position of each sequence, from the frame it just made."""
        inputs = []
        for seq in seqs:
            x = seq.frame_embeds.sum(dim=1, keepdim=True)
            trailing = seq.prompt.trailing
            x[0, 0].add_(trailing[seq.step] if seq.step < trailing.shape[0] else seq.prompt.pad)
            inputs.append(x)
        positions = [seq.prefill_len + seq.step for seq in seqs]
        self._ensure_rope(max(positions) + 1)
        index = torch.tensor(positions, device=self.device)
        h = self.talker.model.run_rows(
            torch.cat(inputs, dim=1),
            self._cos.index_select(0, index),
            self._sin.index_select(0, index),
            [seq.cache for seq in seqs],
            [(k, pos) for k, pos in enumerate(positions)],
        )
        logits = self.talker.codec_head(h)[0].float()
        for k, seq in enumerate(seqs):
            seq.logits = logits[k : k + 1]
            seq.hidden = h[:, k : k + 1]
            seq.step += 1

    def _predict_rows(self, live: list[tuple[Sequence, torch.Tensor]], settings: SamplingSettings) -> None:
        """``predict_frame`` for several sequences: codebooks 1..G-1 of each row, rows together (in
        one library call on the native kernels, as ``predict_frame``)."""
        cp = self.talker.code_predictor
        tables = cp.model.codec_embedding
        caches = [seq.pred_cache for seq, _ in live]
        for seq, row in live:
            seq.frame_embeds[0, 0:1].copy_(self.talker.model.codec_embedding(row[0:1]))
        n = len(live)
        fused = cp.native
        if fused is not None and self.graphs is None and n <= fused.max_sequences:
            self._predict_fused(fused, live, settings)
            return
        blocks = [torch.cat([seq.hidden, seq.frame_embeds[:, 0:1]], dim=1) for seq, _ in live]
        pairs = torch.tensor([0, 1] * n, device=self.device)
        h = cp.model.run_rows(
            cp.small_to_mtp_projection(torch.cat(blocks, dim=1)),
            self.pred_cos.index_select(0, pairs),
            self.pred_sin.index_select(0, pairs),
            caches,
            [(k, p) for k in range(n) for p in (0, 1)],
        )
        last = h[0, 1::2]
        for step in range(self.groups - 1):
            if step > 0:
                pos = step + 1
                x = torch.cat([seq.frame_embeds[:, step : step + 1] for seq, _ in live], dim=1)
                h = cp.model.run_rows(
                    cp.small_to_mtp_projection(x),
                    self.pred_cos[pos : pos + 1].expand(n, -1),
                    self.pred_sin[pos : pos + 1].expand(n, -1),
                    caches,
                    [(k, pos) for k in range(n)],
                )
                last = h[0]
            logits = cp.lm_head[step](last).float()
            for k, (seq, row) in enumerate(live):
                code = choose(logits[k : k + 1], settings, seq.options.greedy, seq.generator, self.kernels)
                row[step + 1 : step + 2].copy_(code[0])
                seq.frame_embeds[0, step + 1 : step + 2].copy_(tables[step](code[0]))

    def _predict_fused(
        self, fused: Predictor, live: list[tuple[Sequence, torch.Tensor]], settings: SamplingSettings
    ) -> None:
        """``_predict_rows`` by the native kernels' one call (``native.Predictor``); each sequence's
        uniform numbers from its own generator, as its draws one at a time would take them."""
        steps = self.groups - 1
        greedy = [seq.options.greedy or not settings.do_sample for seq, _ in live]
        u = None
        if not all(greedy):
            u = torch.zeros(len(live), steps, dtype=torch.float64)
            for k, (seq, _) in enumerate(live):
                if not greedy[k]:
                    u[k] = torch.rand(steps, dtype=torch.float64, generator=seq.generator)
        hidden = torch.cat([seq.hidden.reshape(1, -1) for seq, _ in live])
        first = torch.cat([seq.frame_embeds[0, 0:1] for seq, _ in live])
        codes = torch.empty(len(live), steps, dtype=torch.long)
        embeds = torch.empty(len(live), steps, self.hidden, dtype=self.dtype)
        caches = [(seq.pred_cache.k, seq.pred_cache.v) for seq, _ in live]
        sampling = draw_settings(settings)
        fused.run(hidden, first, caches, self.pred_cos, self.pred_sin, greedy, u, sampling, codes, embeds)
        for k, (seq, row) in enumerate(live):
            row[1:].copy_(codes[k])
            seq.frame_embeds[0, 1:].copy_(embeds[k])
