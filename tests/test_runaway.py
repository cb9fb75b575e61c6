"""A runaway utterance is cut where it runs away (issue 41, item 4): its bound follows the text,
not a tokenizer; a loop and a long silence are cut as they come; the request still ends
``completed``, with ``truncated: runaway`` in ``tts/finished``, a ``runaway_cut`` log line and
``s2s_runaway_truncated_total{cause}``; the rest of its text is spoken."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog

from s2s_daemon.tts import runaway
from s2s_daemon.tts.runaway import RunawayWatch, piece_budget_s
from tests.support.broker import Mosquitto
from tests.support.daemon import daemon_in_process, write_config
from tests.support.mqtt import recorder
from tests.support.tone_engine import FRAME_SAMPLES, SAMPLE_RATE, tone
from tests.support.tone_engine import runaway as tone_runaway

SAY = "s2s/kitchen/tts/say"
KETTLE = "The kettle is boiling in the kitchen."


def test_the_bound_follows_the_characters_and_their_script() -> None:
    # 37 characters, said in about 2.6 s: the bound is 2.7 times that (a random checkpoint's small
    # tokenizer gave it 20 s, the real one 8 s), whatever the model's tokenizer makes of it.
    assert piece_budget_s(KETTLE) == pytest.approx(runaway.BASE_S + runaway.MARGIN * 37 * runaway.LATIN_S)
    assert 6.0 < piece_budget_s(KETTLE) < 7.5
    # a Chinese character takes longer to say than a letter, a digit longer still (a word each)
    assert piece_budget_s("水壶在厨房里烧开了。") > piece_budget_s("The kettle boils.")
    assert piece_budget_s("1995") > piece_budget_s("abcd")
    assert piece_budget_s("x" * 300) == pytest.approx(runaway.BASE_S + runaway.MARGIN * 300 * runaway.LATIN_S)


def _feed(watch: RunawayWatch, audio: np.ndarray, chunk: int = 2 * FRAME_SAMPLES) -> runaway.RunawayCut | None:
    for start in range(0, len(audio), chunk):
        cut = watch.add(audio[start : start + chunk])
        if cut is not None:
            return cut
    return None


def _speech_like(seconds: float, seed: int = 1) -> np.ndarray:
    """A tone whose loudness wanders without repeating (every 20 ms a new level)."""
    rng = np.random.default_rng(seed)
    windows = round(seconds / 0.02)
    levels = rng.uniform(0.02, 0.5, windows).astype(np.float32)
    return (tone(440.0, 0, windows // 4 + 1)[: windows * 480] * np.repeat(levels, 480) / 0.3).astype(np.float32)


def test_speech_within_its_bound_is_not_cut() -> None:
    watch = RunawayWatch(KETTLE, SAMPLE_RATE)
    assert _feed(watch, _speech_like(piece_budget_s(KETTLE) - 0.1)) is None


@pytest.mark.parametrize(
    ("kind", "cause", "within_s"),
    [("loop", "loop", 5.0), ("silence", "silence", 3.5), ("tone", "length", None)],
)
def test_a_runaway_is_cut_by_what_gives_it_away(kind: str, cause: str, within_s: float | None) -> None:
    said = _speech_like(1.0)
    frames = round(30 / 0.08)
    audio = np.concatenate([said, tone_runaway(kind, 13, frames)])
    watch = RunawayWatch("A long sentence that would take a while to say out loud.", SAMPLE_RATE)
    cut = _feed(watch, audio)
    assert cut is not None and cut.cause == cause
    limit = 1.0 + within_s if within_s is not None else watch.budget_s + 0.2
    assert cut.audio_s <= min(limit, watch.budget_s + 0.2)


def _config(tmp_path: Path, port: int) -> Path:
    return write_config(tmp_path / "d.yaml", port, tts={"options": {"speed": "0", "ms_per_char": "40"}})


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("marker", "cause"), [("#runaway-loop", "loop"), ("#runaway-silence", "silence")])
async def test_a_runaway_request_ends_completed_truncated_and_goes_on_with_its_text(
    tmp_path: Path, mosquitto: Mosquitto, marker: str, cause: str
) -> None:
    with structlog.testing.capture_logs() as logs:
        async with recorder(mosquitto.port) as rec, daemon_in_process(_config(tmp_path, mosquitto.port)) as daemon:
            await rec.wait_for(lambda: any(m.payload == b"online" for m in rec.on("/status")), 30)
            text = f"It runs away {marker}. Then it says this."
            await rec.say(SAY, {"id": "away", "text": text})
            await rec.say(SAY, {"id": "plain", "text": KETTLE})
            fin = await rec.wait_finished(["away", "plain"], timeout_s=90)
            samples = daemon.metrics.registry.get_sample_value
            assert samples("s2s_runaway_truncated_total", {"cause": cause}) == 1.0
    away, plain = fin["away"], fin["plain"]
    assert away["status"] == "completed" and away["truncated"] == "runaway", away
    assert "error" not in away
    assert "truncated" not in plain and plain["status"] == "completed"
    # cut well before the four minutes the engine would have gone on for, the second sentence said
    second_ms = len("Then it says this.") * 40
    assert second_ms < away["audioMs"] < 1000 * (piece_budget_s(f"It runs away {marker}.") + 1) + second_ms
    cuts = [e for e in logs if e["event"] == "runaway_cut"]
    assert [(e["cause"], e["truncated"], e["segment"]) for e in cuts] == [(cause, "runaway", 1)]
    assert cuts[0]["log_level"] == "warning"
