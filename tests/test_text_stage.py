# ruff: noqa: RUF001 -- full-width CJK marks are the point
"""The text stage, part by part: Markdown, emoji, addresses, numbers, code blocks, the options and a
request's overrides, and what a stream holds back."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from s2s_daemon.config import TextConfig
from s2s_daemon.text import StreamingTextStage, TextOptions, TextOverrides, TextStage, prepare_text

DEFAULT = TextOptions()


def spoken(text: str, language: str | None = "en", **options: object) -> str:
    return prepare_text(text, TextOptions(**options), language).text  # type: ignore[arg-type]


# -- Markdown ---------------------------------------------------------------------------------


def test_emphasis_headings_links_images_and_inline_code_read_as_their_words() -> None:
    text = (
        "# Title\n\nSome **bold**, _italic_ and ~~old~~ words, a [link](https://x.org/a) and ![a cat](c.png)."
        "\n\nCall `get_user_id()` now."
    )
    assert spoken(text) == "Title.\nSome bold, italic and old words, a link and a cat.\nCall get user id now."


def test_list_items_and_table_rows_are_sentences_of_their_own() -> None:
    text = "Options:\n\n- first\n- second, really\n\n| Name | Age |\n|---|---:|\n| Ann | 31 |\n|  | 7 |\n"
    assert spoken(text) == "Options.\nfirst.\nsecond, really.\nName, Age.\nAnn, 31.\n7."


def test_html_tags_are_dropped_and_their_text_kept_but_not_a_script() -> None:
    text = "<div>Hello <em>there</em></div>\n\n<script>alert(1)</script>\n\nA <span>tag</span> inline."
    assert spoken(text) == "Hello there.\nA tag inline."


def test_a_task_list_reads_without_its_boxes_and_a_line_break_ends_a_sentence() -> None:
    assert spoken("- [ ] write tests\n- [x] ship") == "write tests.\nship."
    assert spoken("Weather today\nSunny and warm\nwith a breeze") == "Weather today. Sunny and warm with a breeze."


def test_markdown_off_reads_the_text_as_written() -> None:
    assert spoken("**bold** and `code`", markdown=False) == "**bold** and `code`"


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("skip", "Run this.\nCode block skipped.\nDone."),
        ("read", "Run this.\nmake all.\nmake install.\nDone."),
        ("drop", "Run this.\nDone."),
    ],
)
def test_code_blocks_are_skipped_with_a_note_read_or_dropped(mode: str, expected: str) -> None:
    assert spoken("Run this:\n\n```sh\nmake all\nmake install\n```\n\nDone.", code_blocks=mode) == expected


def test_the_code_note_is_in_the_language_of_the_answer() -> None:
    assert spoken("Voilà :\n\n```\nx\n```", "fr") == "Voilà.\nBloc de code omis."
    assert spoken("代码如下：\n\n```\nx\n```", None) == "代码如下。此处省略代码。"


# -- emoji and addresses ----------------------------------------------------------------------


def test_emoji_are_dropped_named_in_the_language_or_kept() -> None:
    assert spoken("Great job 👍👍👍 🎉") == "Great job."
    assert spoken("Great job 👍👍👍", emoji="name") == "Great job thumbs up."
    assert spoken("Gut gemacht 👍", "de", emoji="name") == "Gut gemacht daumen hoch."
    assert spoken("做得好👍", "zh", emoji="name") == "做得好拇指向上。"
    assert spoken("Great job 👍", emoji="keep") == "Great job 👍."
    assert spoken("🎉🎉", emoji="keep") == "🎉🎉."
    assert spoken("🎉🎉") == ""


def test_urls_read_as_their_host_and_e_mail_addresses_in_words() -> None:
    text = "See https://www.example.com/a/b?c=1, or mail first.last@mail.example.org."
    assert spoken(text) == "See example dot com, or mail first dot last at mail dot example dot org."
    assert spoken("Siehe https://www.bahn.de/x", "de") == "Siehe bahn Punkt de."
    assert spoken(text, urls=False) == text


# -- numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("language", "text", "expected"),
    [
        (
            "en",
            "It was 28,000 km on 2024-03-15 at 15:16:36.",
            "It was twenty-eight thousand kilometers on March 15, 2024 at 15 hours, 16 minutes and 36 seconds.",
        ),
        (
            "en",
            "The 21st try cost $3.50 and 40% more.",
            "The twenty-first try cost three dollars, fifty cents and 40 percent more.",
        ),
        ("de", "Es kostet 1.250 € bei 25 °C.", "Es kostet eintausendzweihundertfünfzig Euro bei 25 Grad Celsius."),
        ("fr", "Le 1er mai, 12 000 personnes.", "Le premier mai, douze mille personnes."),
        ("es", "La 2ª vez, el 1º puesto, 30 %.", "La segunda vez, el primer puesto, 30 por ciento."),
        ("ru", "Было 21 км и 5 кг.", "Было 21 километр и 5 килограммов."),
        ("zh", "2005年有2350人，增长55%。", "二零零五年有两千三百五十人，增长百分之五十五。"),
        ("ja", "価格は148,000円です。", "価格は十四万八千円です。"),
        ("ko", "가격은 1,750,000원입니다.", "가격은 백칠십오만원입니다."),
    ],
)
def test_numbers_the_model_misreads_are_rewritten_in_the_language(language: str, text: str, expected: str) -> None:
    assert spoken(text, language) == expected


def test_plain_numbers_stay_digits_unless_all_is_asked() -> None:
    assert spoken("I have 3 cats and 12 dogs since 1997.") == "I have 3 cats and 12 dogs since 1997."
    assert spoken("I have 3 cats since 1997.", numbers="all") == "I have three cats since nineteen ninety-seven."
    assert spoken("It was 28,000 km.", numbers="off") == "It was 28,000 km."


def test_without_a_known_language_latin_numbers_stay_as_written_and_chinese_is_guessed() -> None:
    assert spoken("Es kostet 1.250 € bei 25 °C.", None) == "Es kostet 1.250 € bei 25 °C."
    assert spoken("共有2350人。", "auto") == "共有两千三百五十人。"


def test_numbers_in_inline_code_stay_as_written() -> None:
    assert spoken("Install `requests==2.31.0` with 1,000 retries.") == (
        "Install requests==2.31.0 with one thousand retries."
    )


# -- options and overrides --------------------------------------------------------------------


def test_the_stage_takes_its_section_and_a_request_overrides_each_key() -> None:
    stage = TextStage(TextConfig(emoji="name", code_blocks="drop"))
    assert stage.prepare("Hi 👋\n\n```\nx\n```").text == "Hi waving hand."
    assert stage.prepare("Hi 👋", overrides=TextOverrides(emoji="drop")).text == "Hi."
    assert stage.prepare("**Hi**", overrides=TextOverrides(markdown=False)).text == "**Hi**"
    streamed = stage.stream("en", TextOverrides(emoji="keep"))
    assert streamed.feed("Hi 👋. ") + streamed.close() == "Hi 👋."


def test_an_override_with_an_unknown_key_or_a_wrong_type_is_refused() -> None:
    with pytest.raises(ValidationError):
        TextOverrides.model_validate({"emojis": "drop"})
    with pytest.raises(ValidationError):
        TextOverrides.model_validate({"markdown": "yes"})
    with pytest.raises(ValidationError):
        TextOverrides.model_validate({"numbers": "some"})
    assert TextOverrides.model_validate({}).model_dump(exclude_none=True) == {}


def test_changed_says_whether_more_than_white_space_changed() -> None:
    assert not prepare_text("Hello there.\nGeneral Kenobi.", DEFAULT, "en").changed
    assert not prepare_text("Turn on the kitchen light", DEFAULT, "en").changed  # only its full stop added
    assert prepare_text("Hello **there**.", DEFAULT, "en").changed


# -- streaming --------------------------------------------------------------------------------


def test_a_stream_gives_each_sentence_as_soon_as_the_next_one_starts() -> None:
    stage = StreamingTextStage(DEFAULT, "en")
    assert stage.feed("The first sentence is done. The sec") == "The first sentence is done."
    assert stage.feed("ond one is not") == ""
    assert stage.feed(" yet. And") == " The second one is not yet."
    assert stage.close() == " And."


def test_bold_opened_in_one_delta_and_closed_in_a_later_one_reads_as_its_words() -> None:
    stage = StreamingTextStage(DEFAULT, "en")
    said = [stage.feed("Here is **the impor"), stage.feed("tant part. It goes"), stage.feed(" on.** Done.")]
    said.append(stage.close())
    assert said[1] == "Here is the important part."
    assert "".join(said) == "Here is the important part. It goes on. Done."


def test_a_code_fence_split_across_deltas_gives_its_note_once_its_line_ends() -> None:
    stage = StreamingTextStage(DEFAULT, "en")
    assert stage.feed("Try this:\n\n``") == "Try this."
    assert stage.feed("`py") == ""
    assert stage.feed("thon\nprint('a. B')\n``") == "\nCode block skipped."
    assert stage.feed("`\nThat's all.") == ""
    assert stage.close() == "\nThat's all."


def test_a_list_split_across_deltas_gives_each_item_when_the_next_begins() -> None:
    stage = StreamingTextStage(DEFAULT, "en")
    assert stage.feed("- Mil") == ""
    assert stage.feed("k\n-") == ""
    assert stage.feed(" Eggs\n") == "Milk."
    assert stage.close() == "\nEggs."


def test_a_piece_that_continues_a_block_is_not_read_as_a_list_or_a_heading() -> None:
    assert spoken("We counted to 3. 2. Then we stopped. # Not a heading.") == (
        "We counted to 3. 2. Then we stopped. # Not a heading."
    )


def test_a_sentence_end_inside_a_link_or_code_span_does_not_cut_it() -> None:
    assert spoken("Read [the guide. It helps](https://x.org) today. Then `a. B` works.") == (
        "Read the guide. It helps today. Then a. B works."
    )


def test_a_carriage_return_split_from_its_line_feed_is_one_line_break() -> None:
    stage = StreamingTextStage(DEFAULT, "en")
    said = stage.feed("- one\r") + stage.feed("\n- two\r\n") + stage.close()
    assert said == prepare_text("- one\n- two\n", DEFAULT, "en").text == "one.\ntwo."


def test_chinese_sentences_follow_each_other_without_a_break() -> None:
    stage = StreamingTextStage(DEFAULT, "zh")
    said = stage.feed("第一句话。第二") + stage.feed("句话！\n\n- 项目") + stage.close()
    assert said == "第一句话。第二句话！项目。"
