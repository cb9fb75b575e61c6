"""The benchmark scripts share one helper (``s2s_daemon/bench/machine.py``, ``performance_page.py``,
``report.percentile``) and each publishes its table with ``--doc``: no script grows its own percentile,
machine or load code again, and a small run of the cheap ones writes its section into a scratch page."""

from __future__ import annotations

import ast
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from s2s_daemon.bench.performance_page import PAGE_ENV, sections

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "scripts").glob("*.py"))
BENCH_SCRIPTS = sorted((REPO / "scripts").glob("bench_*.py"))
HELPER = REPO / "s2s_daemon" / "bench" / "machine.py"
TINY = REPO / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"

OWN_HELPERS = {"pct", "percentile", "percentiles", "quantile", "machine", "machine_info", "machine_line"}
"""Function names that mean a script has its own copy of what the shared helper does."""
MACHINE_SOURCES = ("/proc/cpuinfo", "/proc/stat", "/proc/meminfo", "/proc/loadavg", "lscpu")


def copied_helpers(source: str, name: str, functions: bool = True) -> list[str]:
    """What in ``source`` does the shared helper's job: a percentile or machine function of its own
    (``functions``), the load average, the CPU model or steal time read directly."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in OWN_HELPERS:
            if functions:
                found.append(f"{name}:{node.lineno}: def {node.name}")
        elif isinstance(node, ast.Attribute) and node.attr == "getloadavg":
            found.append(f"{name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.extend(f"{name}:{node.lineno}: reads {s}" for s in MACHINE_SOURCES if s in node.value)
    return found


def test_no_script_has_its_own_percentile_machine_or_load_helper() -> None:
    found = [hit for path in SCRIPTS for hit in copied_helpers(path.read_text("utf-8"), path.name)]
    # The package's other modules (report.py owns the percentiles) read no machine facts either.
    package = [p for p in (REPO / "s2s_daemon" / "bench").glob("*.py") if p != HELPER]
    found += [hit for path in package for hit in copied_helpers(path.read_text("utf-8"), path.name, functions=False)]
    assert found == [], "use s2s_daemon.bench.machine / report.percentile instead:\n" + "\n".join(found)


def test_the_check_catches_a_copied_helper() -> None:
    source = (
        "import os\n"
        "def pct(values, q):\n    return sorted(values)[0]\n"
        "def line():\n    return os.getloadavg()[0]\n"
        "CPU = open('/proc/cpuinfo').read()\n"
    )
    assert copied_helpers(source, "bench_x.py") == [
        "bench_x.py:2: def pct",
        "bench_x.py:5: .getloadavg",
        "bench_x.py:6: reads /proc/cpuinfo",
    ]


def test_every_benchmark_script_offers_doc() -> None:
    missing = []
    for path in BENCH_SCRIPTS:
        calls = {
            node.func.id
            for node in ast.walk(ast.parse(path.read_text("utf-8")))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        if not {"add_doc_arguments", "doc_target"} <= calls:
            missing.append(path.name)
    assert len(BENCH_SCRIPTS) >= 16
    assert missing == []


def run_script(script: str, *args: str, page: Path, timeout_s: float = 150) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, PAGE_ENV: str(page.with_name("never-written.md"))}  # --doc-file must win
    command = [sys.executable, str(REPO / "scripts" / script), *args, "--doc-file", str(page)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def scratch_page(tmp_path: Path) -> Path:
    page = tmp_path / "performance.md"
    page.write_bytes((REPO / "docs" / "performance.md").read_bytes())
    return page


def outside_section(text: str, key: str) -> str:
    """The page without its section ``key`` (the whole page where it has none), the blank lines
    before where it stands left out (a new section comes after one)."""
    start, end = sections(text).get(key, (len(text), len(text)))
    return text[:start].rstrip("\n") + text[end:]


def section_of(page: Path, key: str) -> str:
    text = page.read_text(encoding="utf-8")
    start, end = sections(text)[key]
    return text[start:end]


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_sampling_prints_its_figures_and_publishes_them(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    page = scratch_page(tmp_path)
    before = page.read_text(encoding="utf-8")
    start, end = sections(before).get("sampling", (len(before), len(before)))
    done = run_script(
        "bench_sampling.py", "--rounds", "2", "--draws", "20", "--threads", "1", "--between", "8", page=page
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "native (one call):" in done.stdout and "top-k candidates:" in done.stdout and "/ native" in done.stdout
    section = section_of(page, "sampling")
    after = page.read_text(encoding="utf-8")
    start_after, end_after = sections(after)["sampling"]
    assert after[:start_after] + after[end_after:] == before[:start] + before[end:]  # the rest of the page kept
    assert "| draw              | us per draw (median) |" in section
    assert "| native (one call) |" in section and "1.00x |" in section and "| whole vocabulary  |" in section
    assert "- command: `" in section and "scripts/bench_sampling.py --rounds 2 --draws 20" in section
    assert not page.with_name("never-written.md").exists()


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_predictor_prints_both_ways_and_publishes_them(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.test_native_predictor import write_fused_checkpoint

    model = tmp_path / "fused"
    write_fused_checkpoint(model, "projected")
    page = scratch_page(tmp_path)
    before = page.read_text(encoding="utf-8")
    args = ["--frames", "8", "--streams", "2", "--rounds", "1", "--threads", "1"]
    done = run_script("bench_predictor.py", str(model), *args, page=page, timeout_s=200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "one utterance: ms a frame with audio, chunks of 4: one call" in done.stdout
    assert "2 streams together: ms a step, talker and predictor: one call" in done.stdout
    after = page.read_text(encoding="utf-8")
    assert outside_section(after, "predictor") == outside_section(before, "predictor")  # the rest of the page kept
    section = section_of(page, "predictor")
    assert "| what " in section and "| one call | loop | loop / one call |" in section.replace("  ", " ")
    assert "- command: `" in section and "scripts/bench_predictor.py" in section
    # the tiny fixture's predictor is too narrow for the kernels: said so, nothing published
    done = run_script("bench_predictor.py", str(TINY), "--frames", "4", page=page, timeout_s=120)
    assert done.returncode == 1 and "not fused here" in done.stdout
    assert page.read_text(encoding="utf-8") == after


def test_bench_callers_texts_are_each_one_utterance() -> None:
    """Random weights run every utterance to the cap: a text the daemon splits would give its
    caller twice the audio of the others (and the round's end)."""
    from s2s_daemon.pipeline.segment import split_sentences
    from s2s_daemon.tts.stage import SEGMENT_MAX_CHARS

    def utterances(text: str) -> list[str]:
        return split_sentences(text, SEGMENT_MAX_CHARS, complete=True, first=True, at_boundary=True)[0]

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench_callers
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert all(utterances(text) == [text] for text in bench_callers.TEXTS)
    assert len(utterances("Good night, sleep well, and I will see you again tomorrow morning.")) == 2  # the old fourth


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_callers_speaks_through_the_daemon_and_publishes(tmp_path: Path) -> None:
    """The daemon as a subprocess, callers through the openai SDK: every answer's audio counted."""
    pytest.importorskip("torch")
    pytest.importorskip("openai")
    pytest.importorskip("soundfile")
    page = scratch_page(tmp_path)
    before = page.read_text(encoding="utf-8")
    args = ["--callers", "1,2", "--frames", "8", "--rounds", "1", "--quantization", "int8"]
    done = run_script("bench_callers.py", str(TINY), *args, page=page, timeout_s=200)
    said = f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    assert done.returncode == 0, said
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if " callers: " in line}
    assert set(lines) == {"1 callers", "2 callers"}, said
    # at most 8 frames a caller (0.64 s; mp3 pads a little): the API samples, and the tiny
    # checkpoint's random weights may draw the end of speech sooner (never before 2 frames)
    one = float(lines["1 callers"].split(" for ")[1].split(" s of audio")[0])
    two = float(lines["2 callers"].split(" for ")[1].split(" s of audio")[0])
    assert 0.1 <= one <= 0.8 and 0.2 <= two <= 1.6, said
    after = page.read_text(encoding="utf-8")
    assert outside_section(after, "callers") == outside_section(before, "callers")  # the rest of the page kept
    section = section_of(page, "callers")
    assert "| callers | wall s | audio s |" in section and "scripts/bench_callers.py" in section


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_steady_on_the_tiny_checkpoint_publishes_ms_a_frame_against_real_time(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    page = scratch_page(tmp_path)
    done = run_script(
        "bench_steady.py", str(TINY), "--format", "int8", "--frames", "8", "--chunks", "2,4", "--rounds", "1",
        "--threads", "1", page=page,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chunks of  2 frames:" in done.stdout and "chunks of  4 frames:" in done.stdout
    section = section_of(page, "steady")
    rows = [line for line in section.splitlines() if line.startswith("| ") and line.split("|")[1].strip()[0].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["2 frames", "4 frames"]
    assert all(r.rstrip(" |").endswith("x") for r in rows)  # the ratio to real time
    assert re.search(r"Read bandwidth \d+\.\d GB/s before, \d+\.\d after", section)


@pytest.mark.integration
@pytest.mark.torch
def test_bench_memory_shows_the_peers_figure_beside_a_checkpoint_of_its_size_alone(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    bigger = tmp_path / "tiny-1b7"
    shutil.copytree(TINY, bigger)
    config = json.loads((bigger / "config.json").read_text(encoding="utf-8"))
    assert config["tts_model_size"] == "0b6"
    (bigger / "config.json").write_text(json.dumps({**config, "tts_model_size": "1b7"}), encoding="utf-8")
    peers: dict[str, str] = {}
    for model, key, size in ((TINY, "memory", "0b6"), (bigger, "memory-1.7b", "1b7")):
        page = scratch_page(tmp_path)
        args = ("--formats", "int8", "--codecs", "auto", "--rounds", "1", "--frames", "4", "--doc-key", key)
        done = run_script("bench_memory.py", str(model), *args, "--cache", str(tmp_path / "cache"), page=page)
        assert done.returncode == 0, done.stderr[-2000:]
        section = section_of(page, key)
        rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()]
        rows = [r for r in rows if r and r[0] == "int8"]
        assert len(rows) == 1 and int(rows[0][2].split("-")[0].replace(",", "")) > 0
        peers[key] = rows[0][3]
        assert f"Model `{model}` (tts_model_size {size})" in section
    assert peers == {"memory": "1,150-1,182", "memory-1.7b": "-"}


@pytest.mark.integration
@pytest.mark.torch
def test_bench_batch_on_the_tiny_checkpoint_publishes_the_codec_beside_the_talker_step(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    page = scratch_page(tmp_path)
    args = ("--format", "int8", "--frames", "8", "--streams", "1,2", "--rounds", "2", "--ways",
            "batched,interleaved,codec-thread,one-open-a-step")  # fmt: skip
    done = run_script("bench_batch.py", str(TINY), *args, page=page)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section_of(page, "batch").splitlines()]
    rows = [r for r in rows if r and r[0] in ("1", "2")]
    assert [r[0] for r in rows] == ["1", "2"] and all(len(r) == 19 for r in rows)
    ways = [json.loads(line)["way"] for line in done.stdout.splitlines() if line.startswith('{"streams"')]
    assert ways == ["batched", "interleaved", "codec-thread", "one-open-a-step"] * 2
    for r in rows:  # each way's audio a second, the batch's over it round by round, first chunks
        for first in (r[12], r[15], r[18]):
            mean, slowest = (float(x) for x in first.split(" / "))
            assert 0 < mean <= slowest
        assert all(float(r[k]) > 0 and float(r[k + 1].removesuffix("x")) > 0 for k in (13, 16))
    for r in rows:
        step, codec, share = float(r[9]), float(r[10]), int(r[11].removesuffix("%"))
        assert step > 0 and codec > 0
        # N codec frames over a step's whole (the table's figures are rounded to 0.1 ms)
        assert abs(share - 100 * int(r[0]) * codec / (step + int(r[0]) * codec)) <= 1.5
    assert rows[0][10] == rows[1][10]  # one codec figure: batching does not share it


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_bench_trim_on_the_tiny_checkpoint_publishes_both_thresholds_and_their_page_faults(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    page = scratch_page(tmp_path)
    done = run_script(
        "bench_trim.py", str(TINY), "--format", "int8", "--frames", "8", "--rounds", "2", "--threads", "1", page=page,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("trim 128 KiB:") == 2 and done.stdout.count("trim  32 MiB:") == 2
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section_of(page, "trim").splitlines()]
    rows = [r for r in rows if r and r[0] in ("128 KiB", "32 MiB")]
    assert [r[0] for r in rows] == ["128 KiB", "32 MiB"]
    assert rows[0][3] == "-" and rows[1][3].endswith(")")  # the ratio to the first, round by round
    assert all(float(r[1]) > 0 and float(r[4]) > 0 and float(r[5].replace(",", "")) >= 0 for r in rows)


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_quant_agreement_on_the_tiny_checkpoint_publishes_each_format_against_float32(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")
    page = scratch_page(tmp_path)
    done = run_script("bench_quant_agreement.py", str(TINY), "--frames", "6", "--threads", "1", page=page)
    assert done.returncode == 0, done.stderr[-2000:]
    section = section_of(page, "quant-agreement")
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| int")]
    assert [r[0].strip() for r in rows] == ["int8", "int4"]
    for row in rows:
        assert 0.9 < float(row[2]) <= 1.0  # the prompt's logits correlate (a wrong layout gives ~0)
        assert row[6].strip() == row[7].strip() == "6"  # the budget's frames, both sides
    # One product's error: int8 (per row, 255 steps) well under int4's (per group of 64, 15 steps).
    errors = [float(r[1].strip().rstrip("%")) for r in rows]
    assert 0 < errors[0] < 2 < errors[1] < 20, errors


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_prefill_on_the_tiny_checkpoint_publishes_both_ways_and_each_matrix(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")
    page = scratch_page(tmp_path)
    paths = ["auto", "generic"]
    done = run_script(
        "bench_prefill.py", str(TINY), "--rounds", "1", "--threads", "1", "--paths", ",".join(paths), page=page
    )
    assert done.returncode == 0, done.stderr[-2000:]
    section = section_of(page, "prefill")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| int")]
    prompts = [r for r in rows if r[2].isdigit()]
    widest = native.load().isa  # type: ignore[union-attr]
    assert [(r[0], r[1]) for r in prompts] == [(f, p) for f in ("int4", "int8") for p in (widest, "generic")]
    assert all(int(r[2]) > 4 and r[5].endswith("x") for r in prompts)  # a prompt longer than one block
    assert all(r[6] == "1.00x" for r in prompts[::2])  # the first path against itself
    matrices = [(r[0], r[1], r[2]) for r in rows if not r[2].isdigit()]
    names = ("qkv", "o", "gate_up", "down")
    assert matrices == [(f, p, m) for f in ("int4", "int8") for p in (widest, "generic") for m in names]


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_first_chunk_on_the_tiny_checkpoint_publishes_each_part_of_both_cases(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        pytest.skip(f"native kernels cannot run here: {native.why_not_here()}")
    page = scratch_page(tmp_path)
    done = run_script("bench_first_chunk.py", str(TINY), "--rounds", "2", "--threads", "1", page=page)
    assert done.returncode == 0, done.stderr[-2000:]
    section = section_of(page, "first-chunk")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| int")]
    assert [(r[0], r[2]) for r in rows] == [(f, c) for f in ("int4", "int8") for c in ("new voice", "same voice")]
    for fmt, _path, case, positions, *cells in rows:
        run, total = (int(n) for n in positions.split(" of "))
        # A kept voice runs fewer positions than its whole prompt; a new one runs them all.
        assert (run == total) if case == "new voice" else (0 < run < total), (fmt, case, positions)
        first, prepare, prefill, predictor, codec, _rest = (float(c) for c in cells)
        assert min(prepare, prefill, predictor, codec) >= 0 and first >= 0
        assert prepare + prefill + predictor + codec <= first + 2  # parts of one chunk (medians apart)


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_isa_on_the_tiny_checkpoint_publishes_each_path_beside_the_fastest(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        pytest.skip(f"no native kernels here: {native.why_not_here()}")
    page = scratch_page(tmp_path)
    done = run_script(
        "bench_isa.py", str(TINY), "--formats", "int8,int4", "--paths", "generic,auto", "--frames", "8",
        "--rounds", "1", "--threads", "1", page=page,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    widest = [p for p in native.carried_paths() if p in native.runnable_paths()][-1]
    rows = [line.split("|")[1:3] for line in section_of(page, "isa").splitlines() if line.startswith("| int")]
    assert [(w.strip(), p.strip()) for w, p in rows] == [
        ("int8", "generic"), ("int8", widest), ("int4", "generic"), ("int4", widest)
    ]  # fmt: skip
    if widest == "avx2":  # an AVX2-only CPU: auto is the avx2 path, whose goal is then measured
        assert "Goal on avx2: int4 " in done.stdout
    else:
        assert "Goal (int4 and int8 on avx2) not measured in this run." in done.stdout


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_codec_on_the_tiny_checkpoint_publishes_each_form_and_a_new_streams_first_push(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from s2s_daemon.tts.torch_qwen3 import native

    if native.why_not_here() is not None:
        pytest.skip(f"no native kernels here: {native.why_not_here()}")
    page = scratch_page(tmp_path)
    forms = ("float32", "bfloat16", "bfloat16-packed", "auto")
    done = run_script(
        "bench_codec.py", str(TINY), "--forms", ",".join(forms), "--chunks", "1,4", "--rounds", "1",
        "--pushes", "2", "--threads", "1", page=page,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section_of(page, "codec").splitlines()]
    rows = [r for r in rows if r and r[0] in ("1", "4", "first")]
    assert [(r[0], r[1]) for r in rows] == [(n, f) for n in ("1", "4", "first") for f in forms]
    for chunk, form, median, *_, ratio, audio in rows:
        assert float(median) > 0
        assert (ratio == "-") == (form == "float32"), (chunk, form, ratio)
        # each form's streamed audio within the guard against float32; a first push has no audio column
        assert audio == "-" if chunk == "first" or form == "float32" else audio.endswith("pass"), (chunk, form, audio)
