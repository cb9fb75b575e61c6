"""Parity of the torch engine with the official qwen-tts 0.1.1 implementation (goldens).

The goldens in ``tests/fixtures/qwen3_tiny/golden`` were produced by the official package
(transformers 4.57.3, float32, eager attention, greedy: do_sample=False, subtalker_dosample=False,
repetition_penalty 1.05) on the committed tiny checkpoints. Each case is checked in float32 on
the CPU at every stage, so a failure says where the two implementations part:

1. prompt token ids: exact;
2. prompt embeddings (prefill, trailing text, tts_pad): atol 1e-5 (measured 0 for CustomVoice and
   VoiceDesign; <= 1e-6 for Base, whose speaker embedding comes from our speaker encoder);
3. talker logits at every step and code-predictor logits of frame 0: atol 1e-5. On these random
   weights logits are of order 0.7; measured differences are <= 2e-7 (SDPA vs eager attention,
   reduction order). 1e-5 leaves 50x headroom for other CPUs' kernels while any wrong position,
   mask, rope section or norm (errors of order 1e-2 and up) fails;
4. codes under greedy decoding: exact (a kernel difference could in principle flip a near-tie;
   none does on these cases);
5. waveform from the streaming codec decoder, 4-frame chunks concatenated, against the official
   one-shot decode: atol 1e-4 and RMS error below 1e-5 (measured 1.3e-6 and 2.3e-7 on output of
   RMS 0.19). Codes are identical, so this measures the codec decoder in float32.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from s2s_daemon.tts.engine import EngineOptions, SynthesisRequest  # noqa: E402
from s2s_daemon.tts.torch_qwen3.engine import TorchQwen3Engine  # noqa: E402
from s2s_daemon.tts.torch_qwen3.runtime import DecodeOptions, DecodeProbe  # noqa: E402

pytestmark = pytest.mark.torch

FIXTURES = Path(os.environ.get("S2S_PARITY_FIXTURES") or Path(__file__).parent / "fixtures" / "qwen3_tiny")
"""The checkpoints (``custom_voice/``, ``voice_design/``, ``base/``) and their goldens (``golden/``).
``S2S_PARITY_FIXTURES`` points the module at others made by hand: a full-size random checkpoint and
the official package's goldens for it (scripts/golden/README.md, "A full-size checkpoint")."""
GOLDEN = FIXTURES / "golden"
LOGIT_ATOL = 1e-5
EMBED_ATOL = 1e-5
WAV_ATOL = 1e-4
WAV_RMS = 1e-5


def _cases() -> list[str]:
    if not GOLDEN.is_dir():
        return []
    names = []
    for meta in sorted(GOLDEN.glob("*.json")):
        data = json.loads(meta.read_text(encoding="utf-8"))
        if "kind" in data and "kwargs" in data and "generation" in data and (GOLDEN / f"{meta.stem}.npz").is_file():
            names.append(meta.stem)
    return names


CASES = _cases()


class RecordingProbe(DecodeProbe):
    """Keeps every raw logits vector the runtime computes."""

    def __init__(self) -> None:
        self.talker: list[torch.Tensor] = []
        self.predictor: dict[tuple[int, int], torch.Tensor] = {}

    def talker_logits(self, step: int, logits: torch.Tensor) -> None:
        self.talker.append(logits[0].clone())

    def predictor_logits(self, frame: int, group: int, logits: torch.Tensor) -> None:
        self.predictor[(frame, group)] = logits[0].clone()


_ENGINES: dict[str, TorchQwen3Engine] = {}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, TorchQwen3Engine]]:
    yield _ENGINES
    for engine in _ENGINES.values():
        engine.close_blocking()
    _ENGINES.clear()


def _engine(engines: dict[str, TorchQwen3Engine], kind: str) -> TorchQwen3Engine:
    if kind not in engines:
        engine = TorchQwen3Engine(
            EngineOptions(
                model=str(FIXTURES / kind),
                device="cpu",
                dtype="float32",
                extra={"threads": "1", "codec_dtype": "float32"},  # the official decoder's arithmetic
            )
        )
        engine.load_blocking()
        engines[kind] = engine
    return engines[kind]


def _load(case: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = json.loads((GOLDEN / f"{case}.json").read_text(encoding="utf-8"))
    with np.load(GOLDEN / f"{case}.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    return meta, arrays


def _request(meta: dict[str, Any]) -> tuple[SynthesisRequest, bool]:
    """The SynthesisRequest for a golden call, and whether the text streams in (non_streaming_mode False)."""
    kw = meta["kwargs"]
    gen = meta.get("generation", {})
    kind = meta["kind"]
    default_non_streaming = kind != "base"  # the official wrappers' defaults
    non_streaming = gen.get("non_streaming_mode", kw.get("non_streaming_mode", default_non_streaming))
    ref_audio = kw.get("ref_audio")
    if isinstance(ref_audio, str) and not Path(ref_audio).is_absolute():
        repo = Path(__file__).resolve().parents[1]
        ref_audio = str(repo / ref_audio if (repo / ref_audio).is_file() else GOLDEN / Path(ref_audio).name)
    request = SynthesisRequest(
        text=kw["text"],
        voice=kw.get("speaker"),
        language=str(kw.get("language") or "auto").lower(),
        instruct=kw.get("instruct"),
        greedy=True,
        chunk_frames=4,
        ref_audio=ref_audio,
        ref_text=kw.get("ref_text"),
    )
    return request, not non_streaming


def _close(a: torch.Tensor | np.ndarray, b: np.ndarray, atol: float, what: str) -> None:
    got = a.detach().float().cpu().numpy() if isinstance(a, torch.Tensor) else a
    assert got.shape == b.shape, f"{what}: shape {got.shape} != golden {b.shape}"
    err = float(np.abs(got - b).max()) if got.size else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol}"


@pytest.mark.skipif(not CASES, reason="no goldens in tests/fixtures/qwen3_tiny/golden")
@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_and_codes_match_official(case: str, engines: dict[str, TorchQwen3Engine]) -> None:
    meta, gold = _load(case)
    engine = _engine(engines, meta["kind"])
    request, text_streaming = _request(meta)
    if request.ref_audio is not None and engine.speaker_encoder is None:
        pytest.skip("speaker/codec encoders not available in this build")
    runtime = engine.runtime
    assert runtime is not None and engine.gen is not None
    frames = int(meta["generation"]["frames"])
    with torch.inference_mode():
        prompt, tokens, _, _ = engine.prepare(request, text_streaming=text_streaming)
        if "input_ids" in gold:
            assert list(tokens.input_ids) == gold["input_ids"].reshape(-1).tolist()
        if "talker_inputs_embeds" in gold:
            _close(
                prompt.prefill[0],
                gold["talker_inputs_embeds"].reshape(-1, prompt.prefill.shape[-1]),
                EMBED_ATOL,
                "prefill",
            )
        if "trailing_text_hidden" in gold:
            _close(
                prompt.trailing,
                gold["trailing_text_hidden"].reshape(-1, prompt.trailing.shape[-1]),
                EMBED_ATOL,
                "trailing",
            )
        if "tts_pad_embed" in gold:
            _close(prompt.pad, gold["tts_pad_embed"].reshape(-1), EMBED_ATOL, "tts_pad")
        probe = RecordingProbe()
        runtime.probe = probe
        try:
            # One frame beyond the golden count: the official loop computes the logits of step
            # ``frames`` (its last sampled codebook-0 token) without running the predictor on it.
            options = DecodeOptions(max_frames=frames + 1, greedy=True, seed=None)
            rows = [row.clone() for row in runtime.frames(prompt, engine.gen, options, lambda: False)]
        finally:
            runtime.probe = None
    codes = torch.stack(rows).cpu()
    _close(probe.talker[0], gold["first_step_logits"].reshape(-1), LOGIT_ATOL, "first-step logits")
    if "talker_logits" in gold:
        n = min(len(probe.talker), gold["talker_logits"].shape[0])
        assert n >= frames
        _close(torch.stack(probe.talker[:n]), gold["talker_logits"][:n], LOGIT_ATOL, "talker logits")
    if "code_predictor_logits_frame0" in gold:
        groups = gold["code_predictor_logits_frame0"].shape[0]
        mine = torch.stack([probe.predictor[(0, g)] for g in range(1, groups + 1)])
        _close(mine, gold["code_predictor_logits_frame0"], LOGIT_ATOL, "predictor logits frame 0")
    expected = gold["codes"]
    assert codes.shape[0] >= expected.shape[0]
    mismatch = np.argwhere(codes[: expected.shape[0]].numpy() != expected)
    assert mismatch.size == 0, f"codes differ first at (frame, group) {mismatch[0].tolist()}"


@pytest.mark.slow
@pytest.mark.skipif(not CASES, reason="no goldens in tests/fixtures/qwen3_tiny/golden")
@pytest.mark.parametrize("case", [c for c in CASES if c in ("cv_ryan_english", "base_icl")])
def test_streamed_waveform_matches_official(case: str, engines: dict[str, TorchQwen3Engine]) -> None:
    meta, gold = _load(case)
    if "wav" not in gold:
        pytest.skip("golden has no waveform")
    engine = _engine(engines, meta["kind"])
    request, text_streaming = _request(meta)
    frames = int(meta["generation"]["frames"])
    engine.options.extra["max_frames"] = str(frames)
    engine.options.extra["text_streaming"] = "true" if text_streaming else "false"
    try:
        chunks = list(engine.synthesize_blocking(request, lambda: False))
    finally:
        engine.options.extra.pop("max_frames", None)
        engine.options.extra.pop("text_streaming", None)
    assert all(c.dtype == np.float32 for c in chunks)
    assert len(chunks[0]) == 1920  # a one-frame first chunk, then chunk_frames each
    assert [len(c) for c in chunks[1:-1]] == [4 * 1920] * (len(chunks) - 2)
    wav = np.concatenate(chunks)
    expected = gold["wav"].reshape(-1)
    assert wav.shape == expected.shape
    err = np.abs(wav - expected)
    rms = float(np.sqrt(np.mean((wav - expected) ** 2)))
    assert float(err.max()) <= WAV_ATOL, f"max abs error {float(err.max()):.3g}"
    assert rms <= WAV_RMS, f"rms error {rms:.3g}"


@pytest.mark.slow
@pytest.mark.skipif("base_icl" not in CASES, reason="no base_icl golden in tests/fixtures/qwen3_tiny/golden")
def test_a_kept_reference_is_not_decoded_again_and_speaks_the_same(
    engines: dict[str, TorchQwen3Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The codec decodes an ICL reference's frames (its left context) once: a second request with
    the same recording continues from a copy of that stream, and its audio is the first's, bit for bit."""
    from s2s_daemon.tts.torch_qwen3.codec import StreamingDecodeState

    meta, gold = _load("base_icl")
    engine = _engine(engines, meta["kind"])
    request, text_streaming = _request(meta)
    if engine.speaker_encoder is None:
        pytest.skip("speaker/codec encoders not available in this build")
    pushed: list[int] = []
    push = StreamingDecodeState.push

    def counting(self: StreamingDecodeState, codes: torch.Tensor) -> torch.Tensor:
        pushed.append(int(codes.shape[0]))
        return push(self, codes)

    monkeypatch.setattr(StreamingDecodeState, "push", counting)
    engine.ref_streams.clear()
    engine.options.extra["max_frames"] = "6"
    engine.options.extra["text_streaming"] = "true" if text_streaming else "false"
    try:
        first = np.concatenate(list(engine.synthesize_blocking(request, lambda: False)))
        first_pushes = list(pushed)
        pushed.clear()
        second = np.concatenate(list(engine.synthesize_blocking(request, lambda: False)))
    finally:
        engine.options.extra.pop("max_frames", None)
        engine.options.extra.pop("text_streaming", None)
    ref_frames = int(gold["ref_code"].shape[0])
    assert first_pushes[0] == ref_frames and len(engine.ref_streams) == 1
    assert ref_frames not in pushed and sum(pushed) == 6  # only the request's own frames
    assert np.array_equal(first, second)
    assert np.abs(first - gold["wav"].reshape(-1)[: first.shape[0]]).max() <= WAV_ATOL
