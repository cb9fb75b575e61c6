"""The corpus of assistant answers (``tests/fixtures/llm_answers/``): each ``NN-<lang>-<topic>.md``
beside the ``.txt`` a listener should hear, written by hand. Each answer is read whole and in
random deltas (as an LLM streams it), and both must give the text written down."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from s2s_daemon.text import StreamingTextStage, TextOptions, prepare_text

CORPUS = Path(__file__).parent / "fixtures" / "llm_answers"
ANSWERS = sorted(CORPUS.glob("*.md"))


def language_of(answer: Path) -> str:
    return answer.name.split("-")[1]


def expected(answer: Path) -> str:
    return answer.with_suffix(".txt").read_text(encoding="utf-8").rstrip("\n")


def streamed(text: str, language: str, rng: random.Random, longest: int) -> str:
    stage = StreamingTextStage(TextOptions(), language)
    said: list[str] = []
    at = 0
    while at < len(text):
        size = rng.randint(1, longest)
        said.append(stage.feed(text[at : at + size]))
        at += size
    said.append(stage.close())
    return "".join(said)


def test_the_corpus_has_forty_answers_in_many_languages_with_every_kind_of_markup() -> None:
    assert len(ANSWERS) >= 40
    assert all(answer.with_suffix(".txt").exists() for answer in ANSWERS)
    assert {"en", "de", "fr", "es", "it", "pt", "ru", "zh", "ja", "ko"} <= {language_of(a) for a in ANSWERS}
    sources = "\n".join(answer.read_text(encoding="utf-8") for answer in ANSWERS)
    for markup in ("|---", "```", "](http", "- ", "1. ", "**", "`", "> ", "<p>", "🎉", "%", "€", "°C", "@"):
        assert markup in sources, markup


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda p: p.stem)
def test_an_answer_is_spoken_as_written_down(answer: Path) -> None:
    spoken = prepare_text(answer.read_text(encoding="utf-8"), TextOptions(), language_of(answer))
    assert spoken.text == expected(answer)
    assert spoken.changed


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda p: p.stem)
def test_an_answer_streamed_in_random_deltas_is_spoken_as_the_whole(answer: Path) -> None:
    text = answer.read_text(encoding="utf-8")
    language = language_of(answer)
    for seed in range(25):
        rng = random.Random(f"{answer.name}-{seed}")
        assert streamed(text, language, rng, longest=1 if seed == 0 else 3 + seed) == expected(answer), seed


@pytest.mark.parametrize("answer", ANSWERS[::4], ids=lambda p: p.stem)
def test_without_a_language_the_script_decides_and_the_stream_still_agrees(answer: Path) -> None:
    """``auto``: the language is guessed piece by piece from the script; the stream must still
    give what the whole text gives."""
    text = answer.read_text(encoding="utf-8")
    whole = prepare_text(text, TextOptions(), "auto").text
    assert whole
    assert streamed(text, "auto", random.Random(answer.name), longest=7) == whole
