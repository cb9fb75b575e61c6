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


def test_a_text_that_ends_at_a_boundary_ends_its_last_sentence() -> None:
    """What the text stage gave out ends where a sentence may end: a terminator at its very end is
    one (still not after an abbreviation or an initial); without ``at_boundary`` it waits."""
    assert split_sentences("Done.", 300) == ([], "Done.")
    assert split_sentences("Done.", 300, at_boundary=True) == (["Done."], "")
    assert split_sentences("One. Two!", 300, at_boundary=True) == (["One.", "Two!"], "")
    assert split_sentences("你好。今天很好！", 300, at_boundary=True) == (["你好。", "今天很好！"], "")
    assert split_sentences("I met Dr.", 300, at_boundary=True) == ([], "I met Dr.")
    assert split_sentences("By J. K.", 300, at_boundary=True) == ([], "By J. K.")
    assert split_sentences('It said "Go."', 300, at_boundary=True) == (['It said "Go."'], "")


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


@pytest.mark.timeout(30)
def test_a_long_text_of_short_sentences_splits_in_linear_time() -> None:
    """Every full stop once read the rest of the text again (a copy of it): 2 MiB of ``Ab. ``
    took minutes, with the event loop blocked, where a linear pass takes a second or two."""
    text = "Ab. " * (2 * 1024 * 1024 // 4)
    sentences, rest = split_sentences(text, 2000)
    assert len(sentences) == len(text) // 4 and set(sentences) == {"Ab."} and rest.strip() == ""


@pytest.mark.timeout(30)
def test_a_long_first_sentence_of_empty_clauses_finds_its_first_clause_in_linear_time() -> None:
    """The first clause was measured from the start of the text at every clause mark."""
    text = ", " * (1024 * 1024) + "and then some words, the rest of it. Next"
    sentences, rest = split_sentences(text, 300, first=True)
    assert sentences[0].endswith(", and then some words,") and sentences[1:] == ["the rest of it."]
    assert rest == " Next"


@pytest.mark.timeout(30)
def test_an_over_long_rest_is_cut_into_pieces_under_the_limit() -> None:
    text = "word " * (400 * 1024)
    sentences, rest = split_sentences(text, 300)
    assert all(len(s) <= 300 for s in sentences) and len(rest.strip()) <= 300
    assert " ".join([*sentences, rest.strip()]).split() == text.split()
