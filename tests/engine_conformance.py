"""The conformance suite every engine passes (docs/extending.md, "Writing an engine": the tests an engine must pass).

What the daemon relies on an engine for, checked on the engine as the daemon builds it: from a
``tts`` section (``tts.engine``, the engine's own block, ``tts.options``) through the registry, which
finds it by its ``s2s_daemon.engines`` entry point. Subclass ``EngineConformance`` and give it a
``case`` fixture (class scope) returning an ``EngineCase``: ``tests/test_engine_conformance.py``
runs it on the torch and mlx engines (the committed tiny checkpoints) and on a third engine that a
test distribution installs (``tests/support/chime_engine.py``).

It checks: the registry builds it without touching the model; a missing model is an ``EngineError``
with a contract code; ``load_blocking`` says what it offers (its registry name, a sample rate,
``auto`` first among the languages); chunks are mono float32 in [-1, 1], never longer than
``chunk_frames`` frames; its voices are spoken, an unknown voice or language refused with its code;
a newer generation (the job's counter moving on: a stop, a barge-in) ends a synthesis between
chunks, and the next utterance is whole; a stop before the first chunk makes at most one; warmup and
the memory counters; the traits it declares (``tts/engine.py``'s ``EngineTraits``); and, through
``EngineWorker``, load, warmup, a stop mid-utterance, the next utterance and close on its one thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from s2s_daemon.config import TtsConfig
from s2s_daemon.pipeline.messages import ErrorCode
from s2s_daemon.tts.engine import (
    BatchEngine,
    DeviceMemory,
    EngineError,
    EngineInfo,
    SynthesisRequest,
    TtsEngine,
    UnknownVoiceError,
    UnsupportedLanguageError,
    engine_traits,
)
from s2s_daemon.tts.registry import create_engine, engine_options
from s2s_daemon.tts.worker import EngineWorker

FRAME_RATE_HZ = 12.5
"""``SynthesisRequest.chunk_frames`` counts frames of 80 ms."""
CODES = frozenset(code.value for code in ErrorCode)
"""The error codes of the contract (``tts/finished``'s ``error.code``)."""


@dataclass(frozen=True, slots=True)
class EngineCase:
    """One engine as a configuration chooses it."""

    engine: str
    """``tts.engine``."""
    model: str
    """``tts.model``: a model the engine loads here."""
    tts: Mapping[str, Any] = field(default_factory=dict)
    """The rest of the ``tts`` section: the engine's block, ``tts.options`` (a frame cap for a
    checkpoint of random weights, which seldom ends by itself)."""
    voice: str | None = None
    """A voice the model speaks; None: its default."""
    text: str = "Hello there."

    def build(self, model: str | None = None) -> TtsEngine:
        """The engine as the daemon makes it (``wiring.load_engine``), not loaded."""
        tts = TtsConfig.model_validate({"engine": self.engine, "model": model or self.model, **self.tts})
        return create_engine(tts.engine, engine_options(tts))

    def request(self, chunk_frames: int = 1, seed: int = 3, **fields: Any) -> SynthesisRequest:
        base: dict[str, Any] = {"text": self.text, "voice": self.voice, "language": "auto", "seed": seed}
        return SynthesisRequest(**{**base, "chunk_frames": chunk_frames, **fields})


@dataclass(frozen=True, slots=True)
class Loaded:
    engine: TtsEngine
    info: EngineInfo

    def speak(self, request: SynthesisRequest) -> list[np.ndarray]:
        return list(self.engine.synthesize_blocking(request, lambda: False))


class EngineConformance:
    """The suite; a subclass provides ``case``. The loaded engine is shared by the class's tests and
    called on pytest's one thread (an engine may be thread-affine: every call on one thread)."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls) -> EngineCase:
        raise NotImplementedError("a subclass gives its engine's case")

    @pytest.fixture(scope="class")
    @classmethod
    def loaded(cls, case: EngineCase) -> Iterator[Loaded]:
        engine = case.build()
        info = engine.load_blocking()
        yield Loaded(engine, info)
        engine.close_blocking()

    def test_the_registry_builds_it_without_touching_the_model(self, case: EngineCase, tmp_path: Path) -> None:
        engine = case.build(str(tmp_path / "absent"))  # constructors do no I/O: nothing is read yet
        assert isinstance(engine, TtsEngine)

    def test_a_missing_model_is_an_engine_error_with_a_contract_code(self, case: EngineCase, tmp_path: Path) -> None:
        engine = case.build(str(tmp_path / "absent"))
        with pytest.raises(EngineError) as raised:
            engine.load_blocking()
        assert raised.value.code in CODES, raised.value.code

    def test_load_says_what_it_offers(self, case: EngineCase, loaded: Loaded) -> None:
        info = loaded.info
        assert info.engine == case.engine  # the registry's name: metrics, events and /info carry it
        assert isinstance(info.sample_rate, int) and info.sample_rate > 0
        assert info.languages[0] == "auto"  # tts.language: auto, the default, must be spoken
        assert all(isinstance(v, str) and v for v in info.voices) and len(set(info.voices)) == len(info.voices)
        assert case.voice is None or case.voice in info.voices

    def test_chunks_are_mono_float32_and_at_most_chunk_frames_long(self, loaded: Loaded, case: EngineCase) -> None:
        frame = round(loaded.info.sample_rate / FRAME_RATE_HZ)
        chunks = loaded.speak(case.request(chunk_frames=2))
        assert chunks, "no audio"
        for chunk in chunks:
            assert isinstance(chunk, np.ndarray) and chunk.dtype == np.float32 and chunk.ndim == 1
            assert 0 < len(chunk) <= 2 * frame, len(chunk)
            assert np.isfinite(chunk).all() and float(np.abs(chunk).max()) <= 1.0

    def test_its_voices_and_its_default_are_spoken(self, loaded: Loaded, case: EngineCase) -> None:
        for voice in {loaded.info.voices[0] if loaded.info.voices else None, None}:
            assert loaded.speak(case.request(chunk_frames=4, voice=voice)), voice

    def test_an_unknown_voice_or_language_is_refused_with_its_code(self, loaded: Loaded, case: EngineCase) -> None:
        with pytest.raises(UnknownVoiceError) as voice:
            loaded.speak(case.request(voice="Nobody Of This Name"))
        with pytest.raises(UnsupportedLanguageError) as language:
            loaded.speak(case.request(language="klingon"))
        assert (voice.value.code, language.value.code) == ("unknown_voice", "unsupported_language")

    def test_a_newer_generation_ends_it_between_chunks_and_the_next_utterance_is_whole(
        self, loaded: Loaded, case: EngineCase
    ) -> None:
        request = case.request(chunk_frames=1)
        whole = loaded.speak(request)
        assert len(whole) >= 2, "the case must make two chunks or more to show a stop between them"
        generation = [0]  # the job's counter: a stop or a barge-in moves it on
        mine = generation[0]
        got = []
        for chunk in loaded.engine.synthesize_blocking(request, lambda: generation[0] != mine):
            got.append(chunk)
            generation[0] += 1
        assert len(got) == 1
        np.testing.assert_array_equal(got[0], whole[0])
        again = loaded.speak(request)  # nothing of the stopped one is left behind
        assert [len(c) for c in again] == [len(c) for c in whole]
        np.testing.assert_array_equal(np.concatenate(again), np.concatenate(whole))

    def test_a_stop_before_the_first_chunk_makes_at_most_one(self, loaded: Loaded, case: EngineCase) -> None:
        assert len(list(loaded.engine.synthesize_blocking(case.request(), lambda: True))) <= 1

    def test_warmup_leaves_it_ready_and_memory_is_counted(self, loaded: Loaded, case: EngineCase) -> None:
        loaded.engine.warmup_blocking()
        assert isinstance(loaded.engine.memory_blocking(), DeviceMemory)
        assert loaded.speak(case.request(chunk_frames=4))

    def test_the_traits_it_declares_hold(self, loaded: Loaded) -> None:
        traits = engine_traits(loaded.engine)  # raises TypeError on a wrong declaration
        if traits.max_batch > 1:
            assert isinstance(loaded.engine, BatchEngine)
        assert traits.sample_rate in (None, loaded.info.sample_rate)

    @pytest.mark.timeout(300)
    async def test_the_worker_drives_it_on_its_thread_through_a_stop_and_a_close(self, case: EngineCase) -> None:
        worker = EngineWorker(case.build(), stall_timeout_s=120)
        info = await worker.load()
        assert info.engine == case.engine
        await worker.warmup()
        request = case.request(chunk_frames=1)
        token = {"stop": False}  # a job's stop token, as the ledger sets it on stop, barge-in and shutdown
        stopped = []
        async for chunk in worker.stream(request, lambda: token["stop"]):
            stopped.append(chunk)
            token["stop"] = True
        assert len(stopped) == 1
        whole = [chunk async for chunk in worker.stream(request, lambda: False)]
        assert len(whole) >= 2
        np.testing.assert_array_equal(whole[0], stopped[0])
        assert isinstance(await worker.memory(), DeviceMemory)
        await worker.close()
