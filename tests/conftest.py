from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.support.broker import Mosquitto
from tests.support.tone_engine import register

# The torch engine's prepared weights (packed talkers) of the tests' throwaway checkpoints go to a
# folder of this run, not the user's cache (subprocess daemons inherit it).
_PREPARED = tempfile.TemporaryDirectory(prefix="s2s-prepared-")
os.environ.setdefault("S2S_PREPARED_CACHE", _PREPARED.name)
# Likewise the clone prompts of the reference recordings (the torch engine's voice cache).
_VOICES = tempfile.TemporaryDirectory(prefix="s2s-voice-cache-")
os.environ.setdefault("S2S_VOICE_CACHE", _VOICES.name)

register()


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """A test that runs the CLI in-process configures logging (``warning`` and up): later tests
    that capture ``info`` events would see nothing. Every test starts from structlog's defaults."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def persistent_mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path, persistence=True)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
