# ruff: noqa: RUF001, RUF003 -- full-width CJK marks are the point
"""Sentence segmentation in the languages the daemon speaks (pipeline/segment.py)."""

from __future__ import annotations

import pytest

from s2s_daemon.pipeline.segment import split_sentences


def whole(text: str, max_chars: int = 300) -> list[str]:
    return split_sentences(text, max_chars, complete=True)[0]


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        # English: abbreviations, initials, decimals, ellipses, quotes
        (
            'Dr. Smith arrived at 3.30 p.m. today. He said "Hello." Then he left!',
            ["Dr. Smith arrived at 3.30 p.m. today.", 'He said "Hello."', "Then he left!"],
        ),
        (
            "J. K. Rowling wrote it, e.g. the first book. Really?",
            ["J. K. Rowling wrote it, e.g. the first book.", "Really?"],
        ),
        ("Wait... and then it rained. Later... Nothing.", ["Wait... and then it rained.", "Later...", "Nothing."]),
        ("Pi is 3.14159. Done", ["Pi is 3.14159.", "Done"]),
        # German: abbreviations, ordinals in dates
        (
            "Wir treffen uns am 3. Oktober, z. B. im Park. Das ist gut! Kommst du?",
            ["Wir treffen uns am 3. Oktober, z. B. im Park.", "Das ist gut!", "Kommst du?"],
        ),
        ("Das kostet ca. 5 Euro. Danke.", ["Das kostet ca. 5 Euro.", "Danke."]),
        # French: guillemets, spaced ? and !, M. and Mme
        (
            "M. Dupont est arrivé. « Bonjour ! » dit-il. Vraiment ? Oui.",
            ["M. Dupont est arrivé.", "« Bonjour ! »", "dit-il.", "Vraiment ?", "Oui."],
        ),
        # Chinese: full-width marks, no spaces, quotes
        ("今天天气很好。我们去公园吧！你觉得呢？", ["今天天气很好。", "我们去公园吧！", "你觉得呢？"]),
        ("他说：“你好。”然后走了。", ["他说：“你好。”", "然后走了。"]),
        # Japanese: 。！？ and 「」
        (
            "今日は晴れです。「行きましょう！」と彼は言った。",
            ["今日は晴れです。", "「行きましょう！」", "と彼は言った。"],
        ),
    ],
)
def test_sentences_in_five_languages(text: str, sentences: list[str]) -> None:
    assert whole(text) == sentences


def test_a_growing_text_keeps_its_unfinished_end() -> None:
    assert split_sentences("Hello there. How are you? I am", 100) == (["Hello there.", "How are you?"], " I am")
    assert split_sentences("Done.", 100) == ([], "Done.")  # the next piece may be "5 percent"
    assert split_sentences("Dr.", 100) == ([], "Dr.")
    assert split_sentences("你好。今", 100) == (["你好。"], "今")
    assert split_sentences("你好。", 100) == ([], "你好。")  # a closing quote may still come


def test_pieces_fed_one_by_one_give_the_whole_texts_sentences() -> None:
    text = "Dr. Smith came at 5 p.m. He said: “It is 3.5 km away.” We walked. 我们走了。好！"
    rest, out = "", []
    for i in range(0, len(text), 3):
        done, rest = split_sentences(rest + text[i : i + 3], 300)
        out += done
    out += split_sentences(rest, 300, complete=True)[0]
    assert out == whole(text)


def test_an_over_long_sentence_is_cut_at_a_clause_mark_or_a_space() -> None:
    text = "one two three four five, six seven eight nine ten eleven twelve thirteen fourteen"
    sentences = whole(text, max_chars=40)
    assert sentences[0] == "one two three four five,"
    assert all(len(s) <= 40 for s in sentences)
    assert " ".join(sentences).split() == text.split()


def test_punctuation_alone_joins_a_sentence() -> None:
    assert whole("... Hello. ") == ["... Hello."]
    assert whole("Hello. !!") == ["Hello. !!"]
