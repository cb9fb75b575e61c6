"""The engine conformance suite (``tests/engine_conformance.py``) on every engine we have: torch and mlx
on the committed tiny checkpoints, and a third engine that no code of the daemon names, found
through the entry point of a distribution installed into a temporary site folder."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from s2s_daemon import engines
from s2s_daemon.engines import EngineSpec
from s2s_daemon.tts.engine import EngineInfo, EngineOptions, Samples, ShouldStop, SynthesisRequest
from tests.engine_conformance import EngineCase, EngineConformance, Loaded
from tests.support import chime_dist
from tests.support.chime_engine import VOICES, ChimeEngine, ChimeOptions, ChimeSection

TINY = Path(__file__).parent / "fixtures" / "qwen3_tiny" / "custom_voice"
FRAMES = {"max_frames": "3"}
"""Random weights seldom say end-of-speech: every utterance is capped (0.24 s)."""


@pytest.mark.torch
@pytest.mark.slow
class TestTorchConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls) -> EngineCase:
        pytest.importorskip("torch")
        block = {"device": "cpu", "threads": 1}  # one thread: the tiny model's products on a shared box
        return EngineCase("torch", str(TINY), {"torch": block, "options": FRAMES}, voice="Ryan")


@pytest.mark.mlx
@pytest.mark.slow
@pytest.mark.timeout(300)
class TestMlxConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls) -> EngineCase:
        if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_audio") is None:
            pytest.skip("the mlx extra is not installed")
        return EngineCase("mlx", str(TINY), {"mlx": {"quantization": "8bit"}, "options": FRAMES}, voice="Ryan")


class TestChimeConformance(EngineConformance):
    """The third engine: one module and one entry point of a distribution of its own."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineCase]:
        site = chime_dist.install(tmp_path_factory.mktemp("site"))
        model = tmp_path_factory.mktemp("chime-model")
        with chime_dist.on_path(site):
            yield EngineCase("chime", str(model), {"chime": {"pitch_hz": 660}, "options": {"ms_per_char": "10"}})


class FlawedChime(ChimeEngine):
    """The chime engine with one flaw, to show that the suite fails such an engine."""

    flaw = ""

    def load_blocking(self) -> EngineInfo:
        info = super().load_blocking()
        self.info = dataclasses.replace(info, engine="chime" if self.flaw == "misnamed" else "flawed")
        return self.info

    def synthesize_blocking(self, request: SynthesisRequest, should_stop: ShouldStop) -> Iterator[Samples]:
        if self.flaw == "plain_errors" and request.voice not in (None, *VOICES):
            raise ValueError(f"no voice {request.voice}")
        if self.flaw == "ignores_stop":
            should_stop = lambda: False  # noqa: E731
        if self.flaw == "long_chunks":
            request = dataclasses.replace(request, chunk_frames=request.chunk_frames + 1)
        chunks = super().synthesize_blocking(request, should_stop)
        return (chunk.astype(np.float64) for chunk in chunks) if self.flaw == "float64" else chunks


@pytest.mark.parametrize(
    ("flaw", "check"),
    [
        (flaw, check)
        for flaw, check in [
            ("misnamed", "test_load_says_what_it_offers"),
            ("long_chunks", "test_chunks_are_mono_float32_and_at_most_chunk_frames_long"),
            ("float64", "test_chunks_are_mono_float32_and_at_most_chunk_frames_long"),
            ("plain_errors", "test_an_unknown_voice_or_language_is_refused_with_its_code"),
            ("ignores_stop", "test_a_newer_generation_ends_it_between_chunks_and_the_next_utterance_is_whole"),
        ]
        for flaw in (flaw, "")  # the same check passes on the engine without the flaw
    ],
)
def test_the_suite_fails_an_engine_with_a_flaw(
    flaw: str, check: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def flawed(options: EngineOptions) -> FlawedChime:
        engine = FlawedChime(options)
        engine.flaw = flaw
        return engine

    monkeypatch.setitem(engines._IN_PROCESS, "flawed", EngineSpec(flawed, section=ChimeSection, options=ChimeOptions))
    case = EngineCase("flawed", str(tmp_path), {"options": {"ms_per_char": "40"}})  # 6 frames
    engine = case.build()
    loaded = Loaded(engine, engine.load_blocking())
    run = getattr(EngineConformance(), check)
    if not flaw:
        run(loaded=loaded, case=case)
        return
    with pytest.raises((AssertionError, ValueError)):
        run(loaded=loaded, case=case)
