"""``engine_traits``: what an engine may declare beyond ``TtsEngine``'s methods, with defaults for
one that declares nothing, and a clear error for one that declares it wrong."""

from __future__ import annotations

import pytest

from s2s_daemon.tts.engine import EngineInfo, EngineTraits, engine_traits


class _Plain:
    """Declares none of them (a test's or a plugin's engine)."""


class _Declares:
    max_batch = 4
    park_thread_on_close = True
    info = EngineInfo(engine="test", model="m", device="cpu", sample_rate=16000)


def test_an_engine_that_declares_nothing_takes_the_defaults() -> None:
    assert engine_traits(_Plain()) == EngineTraits(max_batch=1, park_thread_on_close=False, sample_rate=None)


def test_what_an_engine_declares_is_read() -> None:
    assert engine_traits(_Declares()) == EngineTraits(max_batch=4, park_thread_on_close=True, sample_rate=16000)


@pytest.mark.parametrize(("name", "value"), [("max_batch", 0), ("max_batch", "4"), ("park_thread_on_close", 1)])
def test_a_wrong_declaration_is_a_clear_error(name: str, value: object) -> None:
    engine = _Plain()
    setattr(engine, name, value)
    with pytest.raises(TypeError, match=f"_Plain.{name} must be"):
        engine_traits(engine)
