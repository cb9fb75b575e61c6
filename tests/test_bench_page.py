"""The performance page (``s2s_daemon/bench/performance_page.py``): a benchmark's section is replaced
between its markers and nothing else moves; a new one is appended; malformed markers are refused before
anything is written; the table, the command line, the percentiles every script shares."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import pytest

from s2s_daemon.bench import performance_page
from s2s_daemon.bench.performance_page import (
    DEFAULT_PAGE,
    PAGE_ENV,
    REPO,
    PageError,
    add_doc_arguments,
    command_line,
    doc_target,
    markdown_table,
    page_path,
    publish,
    ratio,
    render_section,
    sections,
)
from s2s_daemon.bench.report import percentile, percentiles
from s2s_daemon.config import load_config

WHEN = datetime.datetime(2026, 12, 3, 10, 15, 42, tzinfo=datetime.UTC)
MACHINE = "AMD EPYC 7B12 with avx2 fma, 2 CPUs"

PAGE = """\
# Performance

Intro, with a mention of `<!-- bench:KEY -->` in prose.

<!-- bench:alpha -->
## Alpha

| a |
| - |
| 1 |
<!-- /bench:alpha -->

Text between the sections, typed by hand.

<!-- bench:beta -->
old beta
<!-- /bench:beta -->

Trailing words.
"""


def write(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "performance.md"
    page.write_bytes(text.encode("utf-8"))
    return page


def put(page: Path, key: str, table: str = "| x |\n| -: |\n| 2 |\n", notes: str = "") -> None:
    publish(key, f"Title {key}", "scripts/bench_x.py --doc", table, notes, path=page, machine=MACHINE, when=WHEN)


def test_a_section_is_rendered_with_machine_date_command_table_and_notes() -> None:
    got = render_section("torch", "The torch engine", "scripts/bench_torch.py /tmp/cv06 --doc", "| a |\n", "Notes.",
                         MACHINE, WHEN)  # fmt: skip
    assert got == (
        "<!-- bench:torch -->\n"
        "## The torch engine\n\n"
        "- machine: AMD EPYC 7B12 with avx2 fma, 2 CPUs\n"
        "- date: 2026-12-03 10:15 UTC\n"
        "- command: `scripts/bench_torch.py /tmp/cv06 --doc`\n\n"
        "| a |\n\n"
        "Notes.\n\n"
        "<!-- /bench:torch -->\n"
    )


def test_a_local_time_is_written_in_utc() -> None:
    local = WHEN.astimezone(datetime.timezone(datetime.timedelta(hours=-5)))
    assert "- date: 2026-12-03 10:15 UTC\n" in render_section("k", "T", "c", "t", "", MACHINE, local)


def test_publishing_replaces_only_its_own_section_and_keeps_every_other_byte(tmp_path: Path) -> None:
    page = write(tmp_path, PAGE)
    put(page, "beta")
    new = page.read_text(encoding="utf-8")
    head, tail = PAGE.split("<!-- bench:beta -->\nold beta\n<!-- /bench:beta -->\n")
    assert new.startswith(head) and new.endswith(tail)
    middle = new[len(head) : len(new) - len(tail)]
    assert middle.startswith("<!-- bench:beta -->\n## Title beta\n") and middle.endswith("<!-- /bench:beta -->\n")
    assert "old beta" not in new and "| 2 |" in middle
    # Again: the same place, still one section.
    put(page, "beta", table="| y |\n| -: |\n| 3 |\n")
    again = page.read_text(encoding="utf-8")
    assert again.startswith(head) and again.endswith(tail)
    assert again.count("<!-- bench:beta -->") == 1 and "| 3 |" in again and "| 2 |" not in again


def test_a_new_section_is_appended_after_a_blank_line(tmp_path: Path) -> None:
    page = write(tmp_path, PAGE)
    put(page, "gamma")
    new = page.read_text(encoding="utf-8")
    assert new.startswith(PAGE + "\n<!-- bench:gamma -->\n")
    assert new.endswith("<!-- /bench:gamma -->\n")
    assert set(sections(new)) == {"alpha", "beta", "gamma"}


def test_a_page_without_a_final_newline_gets_one_before_the_new_section(tmp_path: Path) -> None:
    page = write(tmp_path, "# Performance")
    put(page, "one")
    assert page.read_text(encoding="utf-8").startswith("# Performance\n\n<!-- bench:one -->\n")


def test_a_missing_scratch_page_is_created_with_the_section(tmp_path: Path) -> None:
    page = tmp_path / "scratch.md"
    put(page, "one")
    assert page.read_text(encoding="utf-8").startswith("<!-- bench:one -->\n## Title one\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- bench:beta -->\nno end\n", "section 'beta' is never closed"),
        ("text\n<!-- /bench:beta -->\n", "closing marker of 'beta' with no opening marker"),
        ("<!-- bench:a -->\n<!-- bench:b -->\n<!-- /bench:b -->\n<!-- /bench:a -->\n",
         "line 2: section 'b' opens inside 'a'"),
        ("<!-- bench:a -->\n<!-- /bench:b -->\n", "line 2: closing marker of 'b' inside 'a' (line 1)"),
        ("<!-- bench:a -->\n<!-- /bench:a -->\n<!-- bench:a -->\n<!-- /bench:a -->\n",
         "line 3: section 'a' appears a second time"),
        ("<!-- bench:Bad Key -->\n", "is not a marker"),
        ("<!-- bench:UPPER -->\n<!-- /bench:UPPER -->\n", "'UPPER' is not a section key"),
        ("<!-- bench:beta->\nold\n<!-- /bench:beta -->\n", "line 1: '<!-- bench:beta->' is not a marker"),
        ("<!--bench:beta-->\n", "is not a marker"),
    ],
)  # fmt: skip
def test_malformed_markers_are_refused_with_the_line_and_nothing_is_written(
    tmp_path: Path, text: str, message: str
) -> None:
    page = write(tmp_path, text)
    with pytest.raises(PageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        put(page, "beta")
    assert page.read_bytes() == text.encode("utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["performance.md"]  # no scratch file left behind


def test_a_key_must_be_a_key_and_notes_cannot_smuggle_markers(tmp_path: Path) -> None:
    page = write(tmp_path, PAGE)
    with pytest.raises(PageError, match="section key 'Torch Engine'"):
        put(page, "Torch Engine")
    with pytest.raises(PageError, match="hold a bench marker"):
        put(page, "beta", notes="<!-- /bench:beta -->")
    assert page.read_text(encoding="utf-8") == PAGE


def test_the_markdown_table_aligns_label_left_figures_right_and_escapes_pipes() -> None:
    table = markdown_table(["what", "ms", "ratio"], [["a|b", 1.5, None], ["c", float("nan"), "2.00x"]])
    assert table == (
        "| what |  ms | ratio |\n| ---- | --: | ----: |\n| a\\|b | 1.5 |     - |\n| c    |   - | 2.00x |\n"
    )
    assert markdown_table(["a", "b"], [["x", "y"]], "rl").splitlines()[1] == "| --: | --- |"
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        markdown_table(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="align 'lx'"):
        markdown_table(["a", "b"], [], "lx")


def test_ratio_is_written_with_an_x_and_missing_where_it_cannot_be() -> None:
    assert ratio(3.0, 2.0) == "1.50x"
    assert ratio(1.0, 3.0, 3) == "0.333x"
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(float("nan"), 1.0) is None


def test_percentiles_interpolate_linearly_like_numpy() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile([7.0], 99) == 7.0
    assert percentiles(values) == pytest.approx({"p50": 3.0, "p90": 4.6, "p99": 4.96, "max": 5.0})
    assert percentiles([1.0, 2.0], (25, 75), ndigits=1) == {"p25": 1.2, "p75": 1.8, "max": 2.0}
    assert percentiles([]) == {}


def test_the_command_is_shown_as_a_shell_would_with_paths_relative_to_the_repository() -> None:
    python = str(REPO / ".venv" / "bin" / "python")
    script = str(REPO / "scripts" / "bench_torch.py")
    assert (
        command_line([script, "/tmp/cv 06", "--doc"], python)
        == ".venv/bin/python scripts/bench_torch.py '/tmp/cv 06' --doc"
    )
    assert command_line([script, "--doc"], "/usr/bin/python3") == "python scripts/bench_torch.py --doc"
    main = str(REPO / "s2s_daemon" / "bench" / "__main__.py")
    assert command_line([main, "--engine", "torch"], python) == ".venv/bin/python -m s2s_daemon.bench --engine torch"
    assert command_line(["/opt/venv/bin/s2s-daemon", "bench", "--doc"], python) == "s2s-daemon bench --doc"


def test_a_command_with_backticks_stays_one_code_span() -> None:
    section = render_section("k", "T", "echo `date`", "t", "", MACHINE, WHEN)
    assert "- command: `` echo `date` ``\n" in section  # CommonMark strips one space each side


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_doc_arguments(parser, "torch")
    return parser.parse_args(argv)


def test_without_doc_nothing_is_published(tmp_path: Path) -> None:
    assert doc_target(parse(["m"])) is None


@pytest.mark.integration
def test_doc_file_implies_doc_and_a_second_key_names_itself_in_the_title(tmp_path: Path) -> None:
    page = write(tmp_path, PAGE)
    target = doc_target(parse(["m", "--doc-file", str(page), "--doc-key", "torch-xeon"]))
    assert target is not None and target.path == page and target.key == "torch-xeon"
    target.publish("The torch engine", "| a |\n")
    text = page.read_text(encoding="utf-8")
    assert "<!-- bench:torch-xeon -->\n## The torch engine (torch-xeon)\n" in text
    assert "- command: `" in text and "- date: " in text and "- machine: " in text


def test_doc_checks_the_page_before_the_benchmark_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = write(tmp_path, "<!-- bench:torch -->\n")
    with pytest.raises(PageError, match="never closed"):
        doc_target(parse(["m", "--doc-file", str(broken)]))
    with pytest.raises(PageError, match="its folder does not exist"):
        doc_target(parse(["m", "--doc-file", str(tmp_path / "no" / "page.md")]))
    monkeypatch.setenv(PAGE_ENV, str(broken))
    with pytest.raises(PageError, match="never closed"):
        doc_target(parse(["m", "--doc"]))


def test_the_environment_sends_doc_to_a_scratch_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PAGE_ENV, str(tmp_path / "scratch.md"))
    target = doc_target(parse(["m", "--doc"]))
    assert target is not None and target.path == tmp_path / "scratch.md"
    monkeypatch.delenv(PAGE_ENV)
    assert page_path() == DEFAULT_PAGE == REPO / "docs" / "performance.md"
    assert page_path(tmp_path / "x.md") == tmp_path / "x.md"


def test_the_default_page_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package has no docs/ beside it: --doc must not create one in site-packages."""
    monkeypatch.delenv(PAGE_ENV, raising=False)
    monkeypatch.setattr(performance_page, "DEFAULT_PAGE", tmp_path / "docs" / "performance.md")
    with pytest.raises(PageError, match="does not exist"):
        doc_target(parse(["m", "--doc"]))


def test_the_page_variable_is_not_a_configuration_key(tmp_path: Path) -> None:
    """A benchmark that starts the daemon (bench_http, bench_intake, bench_wyoming) passes its environment on."""
    config = load_config(None, environ={PAGE_ENV: str(tmp_path / "performance.md")})
    assert config.site_id


def test_the_real_page_has_well_formed_markers() -> None:
    sections(DEFAULT_PAGE.read_text(encoding="utf-8"), str(DEFAULT_PAGE))
