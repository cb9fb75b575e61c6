# ruff: noqa: RUF001 -- full-width CJK marks are the point
"""Malformed and hostile text: never an exception, a bounded result, the same result streamed, and
time linear in the length (ten times the text takes about ten times as long, not a hundred)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from s2s_daemon.text import StreamingTextStage, TextOptions, prepare_text
from s2s_daemon.text.stage import MAX_GROWTH, MAX_GROWTH_CHARS

HOSTILE: dict[str, Callable[[int], str]] = {
    "unclosed fence": lambda n: "Look:\n```python\n" + "x = 1  # never closed\n" * (n // 22),
    "nested list levels": lambda n: "".join("  " * (i % 2000) + "- level\n" for i in range(n // 40)),
    "nested list markers": lambda n: "- " * (n // 2) + "x",
    "nested quotes": lambda n: "> " * (n // 2) + "deep",
    "emphasis markers": lambda n: "*" * (n // 2) + "a" + "*" * (n // 2),
    "unbalanced emphasis": lambda n: "**a _b ~~c " * (n // 11),
    "brackets": lambda n: "[" * (n // 2) + "a" + "]" * (n // 2),
    "link openers": lambda n: "[a](" * (n // 4),
    "backticks": lambda n: "`a. B " * (n // 6),
    "table rows": lambda n: "| a | b |\n|---|---|\n" + "| 1 | **2** |\n" * (n // 14),
    "control characters": lambda n: "ok\x00\x01\x1b[31m\u202e\ufeff\u200b\r" * (n // 16),
    "only emoji": lambda n: "🎉👍🏽👨‍👩‍👧🇩🇪" * (n // 12),
    "only markup": lambda n: "***\n---\n> \n#\n|\n```\n```\n<br>\n" * (n // 36),
    "one long word": lambda n: "a" * n,
    "digits": lambda n: "1234567890" * (n // 10),
    "grouped numbers": lambda n: "1,234 " * (n // 6),
    "html tags": lambda n: "<a " * (n // 3),
    "no spaces at all in Chinese": lambda n: "中文" * (n // 2),
    "an address without end": lambda n: "https://" + "a." * (n // 2),
    "pipes": lambda n: "|" * n,
}


def bound(text: str) -> int:
    return MAX_GROWTH * len(text) + MAX_GROWTH_CHARS * (text.count("\n") + len(text) // 100 + 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_text_gives_a_bounded_result_and_the_same_one_streamed(name: str) -> None:
    text = HOSTILE[name](20_000)
    whole = prepare_text(text, TextOptions(), "en").text
    assert len(whole) <= bound(text)
    rng = random.Random(name)
    stage = StreamingTextStage(TextOptions(emoji="name", code_blocks="read"), None)
    pieces = []
    at = 0
    while at < len(text):
        size = rng.randint(1, 200)
        pieces.append(stage.feed(text[at : at + size]))
        at += size
    pieces.append(stage.close())
    streamed = "".join(pieces)
    assert streamed == prepare_text(text, TextOptions(emoji="name", code_blocks="read"), None).text
    assert len(streamed) <= bound(text)


@pytest.mark.slow
def test_the_ten_thousand_row_table_reads_each_row() -> None:
    text = "| n | square |\n|---|---|\n" + "".join(f"| {i} | {i * i} |\n" for i in range(10_000))
    lines = prepare_text(text, TextOptions(), "en").text.split("\n")
    assert lines[0] == "n, square."
    assert len(lines) == 10_001
    assert lines[-1] == "9999, 99980001."


@pytest.mark.parametrize("text", ["", "   \n\n ", "***", "🎉🎉🎉", "```", "<br>", "| |\n|-|", "\x00\x07"])
def test_a_text_of_nothing_to_say_is_empty(text: str) -> None:
    assert prepare_text(text, TextOptions(), "en").text == ""


def cpu_seconds(text: str) -> float:
    """The least CPU time of three runs (CPU time: another process on the machine does not count)."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        prepare_text(text, TextOptions(), "en")
        best = min(best, time.process_time() - start)
    return best


CHEAP = {"unclosed fence", "nested quotes", "one long word", "digits", "an address without end", "pipes", "only emoji"}
COSTLY = {"brackets", "link openers", "backticks", "table rows", "control characters", "grouped numbers"}


@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE)
def test_ten_times_the_text_takes_about_ten_times_as_long(name: str) -> None:
    """Sized so that the small run takes milliseconds (a copy of the rest of the text per line or
    per cut, the quadratic way, shows past a few hundred thousand characters)."""
    size = 50_000 if name in CHEAP else 5_000 if name in COSTLY else 10_000
    small = cpu_seconds(HOSTILE[name](size))
    large = cpu_seconds(HOSTILE[name](10 * size))
    floor = 0.002  # below this a run is all start-up and clock grain
    assert large <= 30 * max(small, floor), f"{name}: {small * 1000:.1f} ms -> {large * 1000:.1f} ms"


TOKENS = [
    *"ab Z1234567890.,:;!?-*_~`#|>[]()<>/\\@%$€°\n\t\r ",
    *["https://", "www.", "```", "**", "- ", "1. ", "| a |", "|---|", "。", "！", "中", "文", "か", "한", "я"],
    *["🎉", "👍🏽", "\u200d", "\x00", "\u202e", "km", "°C", "25", "2024-03-15", "15:16:36", "1,234", "<b>"],
]


@pytest.mark.slow
def test_any_mix_in_any_deltas_is_spoken_as_the_whole_and_never_raises() -> None:
    """Two thousand texts of Markdown's marks, numbers, addresses, emoji and scripts in random
    order, with random options and languages, each streamed in random deltas."""
    rng = random.Random(38)
    for case in range(2000):
        text = "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, 150)))
        language = rng.choice(["en", "de", "fr", "zh", "ja", "ko", "ru", None])
        options = TextOptions(
            markdown=rng.random() < 0.85,
            emoji=rng.choice(["drop", "name", "keep"]),
            numbers=rng.choice(["auto", "all", "off"]),
            code_blocks=rng.choice(["skip", "read", "drop"]),
        )
        whole = prepare_text(text, options, language).text
        assert len(whole) <= bound(text)
        stage = StreamingTextStage(options, language)
        said = []
        at = 0
        while at < len(text):
            size = rng.randint(1, 30)
            said.append(stage.feed(text[at : at + size]))
            at += size
        said.append(stage.close())
        assert "".join(said) == whole, (case, text, language, options)


@pytest.mark.parametrize(
    "text",
    [
        "# 标题。Title more\nText after it.",
        "First sentence。Second part | with a pipe later.\nNext line.",
        "| a | b |\n|---|---|\n| 1. One | 2 |\nAfter. The table.",
    ],
)
def test_a_text_in_one_character_deltas_is_spoken_as_the_whole(text: str) -> None:
    stage = StreamingTextStage(TextOptions(), "en")
    said = "".join(stage.feed(char) for char in text) + stage.close()
    assert said == prepare_text(text, TextOptions(), "en").text
