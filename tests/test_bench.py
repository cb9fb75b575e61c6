"""``s2s-daemon bench``: interleaving, ratios, JSON, PNG, table, memory, error rows, the reference peer.

The benchmark runs as a real subprocess (``python -m s2s_daemon.bench``) with the tone test
engine registered in every worker through the hidden ``--plugin`` flag.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from s2s_daemon.bench.cli import parse_engine_spec
from s2s_daemon.bench.report import SCHEMA, percentile, ratios
from s2s_daemon.bench.runner import worker_env
from s2s_daemon.bench.texts import builtin_texts, load_texts

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "tests.support.tone_engine:register"


def run_bench(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 90, module: str = "s2s_daemon.bench"
) -> subprocess.CompletedProcess[str]:
    """``python -m s2s_daemon.bench`` (or the whole CLI: ``module="s2s_daemon", "bench", ...``)."""
    head = [sys.executable, "-m", module] if module == "s2s_daemon.bench" else [sys.executable, "-m", module, "bench"]
    command = [*head, "--plugin", PLUGIN, "--model", "tone-model", *args]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env or dict(os.environ), check=False
    )


def config_named(document: dict[str, Any], label: str) -> dict[str, Any]:
    matches = [c for c in document["configs"] if c["label"] == label]
    assert len(matches) == 1, [c["label"] for c in document["configs"]]
    return matches[0]


@pytest.mark.integration
def test_two_configurations_interleaved_with_ratios_json_png_and_table(tmp_path: Path) -> None:
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_bench(
        "--engine", "tone",
        "--engine", "tone:speed=40",
        "--runs", "3",
        "--texts", "short",
        "--warmup", "1",
        "--json", str(json_path),
        "--png", str(png_path),
        module="s2s_daemon",  # through the daemon's own command line
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    document = json.loads(json_path.read_text(encoding="utf-8"))

    # JSON schema.
    assert document["schema"] == SCHEMA
    keys = {"schema", "machine", "settings", "baseline", "texts", "configs", "runs", "recommendation"}
    assert set(document) == keys
    assert document["machine"]["logical_cores"] >= 1
    assert document["settings"]["runs"] == 3 and document["settings"]["greedy"] is True
    assert [t["size"] for t in document["texts"]] == ["short", "short"]
    assert document["baseline"] == "tone"
    summary_keys = {"ttfa_p50_ms", "ttfa_p95_ms", "synth_mean_s", "rtf", "frames_per_s", "load_s", "import_s"}
    summary_keys |= {"peak_rss_mib", "rss_end_mib", "device_peak_mib", "device_kind", "runs_ok", "runs_failed"}
    summary_keys |= {"by_size", "warmup_s", "rss_before_load_mib"}
    for config in document["configs"]:
        assert config["status"] == "ok" and config["error"] is None
        assert summary_keys <= set(config["summary"])
        assert config["summary"]["runs_ok"] == 3 * 2
        assert config["info"]["engine"] == "tone"
        assert config["summary"]["peak_rss_mib"] >= config["summary"]["rss_end_mib"] > 0
        assert config["summary"]["rss_before_load_mib"] > 0
        assert config["summary"]["frames_per_s"] > 0

    # Interleaved run by run: A, B, A, B... and run numbers never go back.
    runs = document["runs"]
    assert [r["seq"] for r in runs] == list(range(12))
    assert [r["config"] for r in runs] == ["tone", "tone:speed=40"] * 6
    assert [r["run"] for r in runs] == sorted(r["run"] for r in runs)
    assert [(r["run"], r["text_index"]) for r in runs[::2]] == [(run, i) for run in range(3) for i in range(2)]
    for record in runs:
        assert record["ok"] and record["peak_rss_mib"] > 0 and record["frames"] > 0
        assert 0 < record["ttfa_s"] <= record["synth_s"]

    # Ratios to the first configuration.
    first, second = config_named(document, "tone"), config_named(document, "tone:speed=40")
    assert all(v == pytest.approx(1.0) for v in first["ratios"].values() if v is not None)
    expected = second["summary"]["ttfa_p50_ms"] / first["summary"]["ttfa_p50_ms"]
    assert second["ratios"]["ttfa_p50_ms"] == pytest.approx(expected)
    assert second["ratios"]["ttfa_p50_ms"] > 1.5  # paced at 40x real time: 8 ms per chunk against well under 1 ms
    assert second["ratios"]["peak_rss_mib"] == pytest.approx(
        second["summary"]["peak_rss_mib"] / first["summary"]["peak_rss_mib"]
    )

    # Table on the terminal.
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("machine: ")
    assert "TTFA p50 ms" in lines[1] and "RSS MiB" in lines[1] and "xTTFA" in lines[1]
    rows = {line.split()[0]: line for line in lines[3:5]}
    assert set(rows) == {"tone", "tone:speed=40"}
    assert rows["tone"].split()[-3:] == ["1.00", "1.00", "1.00"]

    # The fastest configuration of the run, and the settings that choose it.
    best = document["recommendation"]
    assert best["label"] == "tone" and best["rtf"] == first["summary"]["rtf"] and best["of"] == 2
    assert best["settings"] == {"tts.engine": "tone"}
    assert lines[-1].startswith("recommended for this machine: tone (RTF ") and "tts.engine: tone" in lines[-1]

    # PNG chart.
    data = png_path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000

    # Progress on stderr (not a terminal here: one line per tenth).
    assert "bench: " in proc.stderr and "(100%" in proc.stderr


@pytest.mark.integration
def test_failing_engine_is_an_error_row_and_the_others_run(tmp_path: Path) -> None:
    json_path = tmp_path / "bench.json"
    proc = run_bench(
        "--engine", "tone",
        "--engine", "nosuch",
        "--engine", "tone:ms_per_char=20",
        "--runs", "2",
        "--texts", "short",
        "--json", str(json_path),
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""
    document = json.loads(json_path.read_text(encoding="utf-8"))
    broken = config_named(document, "nosuch")
    assert broken["status"] == "error" and "unknown engine 'nosuch'" in broken["error"]
    assert broken["ratios"] is None and broken["summary"]["runs_ok"] == 0
    for label in ("tone", "tone:ms_per_char=20"):
        config = config_named(document, label)
        assert config["status"] == "ok" and config["summary"]["runs_ok"] == 4
    assert [r["config"] for r in document["runs"]] == ["tone", "tone:ms_per_char=20"] * 4
    half = config_named(document, "tone:ms_per_char=20")["summary"]["audio_total_s"]
    assert half == pytest.approx(config_named(document, "tone")["summary"]["audio_total_s"] / 2, rel=0.1)
    error_rows = [line for line in proc.stdout.splitlines() if line.startswith("nosuch")]
    assert len(error_rows) == 1 and "ERROR" in error_rows[0]


@pytest.mark.integration
def test_a_failed_synthesis_is_counted_and_the_run_goes_on(tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("# comment\nenglish\tHello there.\n\nthis one will #fail\n", encoding="utf-8")
    json_path = tmp_path / "bench.json"
    proc = run_bench(
        "--engine", "tone", "--texts", str(texts), "--runs", "2", "--warmup", "0", "--json", str(json_path)
    )  # fmt: skip
    assert proc.returncode == 1
    document = json.loads(json_path.read_text(encoding="utf-8"))
    summary = document["configs"][0]["summary"]
    assert (summary["runs_ok"], summary["runs_failed"]) == (2, 2)
    failed = [r for r in document["runs"] if not r["ok"]]
    assert {r["text_index"] for r in failed} == {1}
    assert all("tone engine asked to fail" in r["error"] for r in failed)
    assert "2 runs failed" in proc.stdout


@pytest.mark.integration
def test_missing_reference_environment_is_an_error_row(tmp_path: Path) -> None:
    json_path = tmp_path / "bench.json"
    env = dict(os.environ)
    env.pop("S2S_BENCH_REFERENCE_PYTHON", None)
    proc = run_bench(
        "--engine", "tone", "--engine", "qwen-tts", "--reference-python", str(tmp_path / "nope" / "python"),
        "--texts", "short", "--runs", "1", "--json", str(json_path), "--no-progress", env=env,
    )  # fmt: skip
    assert proc.returncode == 1
    document = json.loads(json_path.read_text(encoding="utf-8"))
    reference = config_named(document, "qwen-tts")
    assert reference["status"] == "error" and "does not exist" in reference["error"]
    assert config_named(document, "tone")["summary"]["runs_ok"] == 2

    # --reference without an environment: a note, and the benchmark runs without it.
    proc = run_bench("--engine", "tone", "--reference", "--texts", "short", "--runs", "1", "--no-progress", env=env)
    assert proc.returncode == 0
    assert "no qwen-tts environment" in proc.stderr
    assert "qwen-tts" not in proc.stdout


@pytest.mark.integration
def test_sigterm_stops_the_benchmark_and_reports_what_was_measured(tmp_path: Path) -> None:
    """A slow configuration cut short: the finished runs are still in the table and the JSON."""
    json_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "s2s_daemon.bench", "--plugin", PLUGIN, "--model", "tone-model"]
    command += ["--engine", "tone:speed=4", "--texts", "long", "--runs", "50", "--warmup", "0"]
    command += ["--json", str(json_path)]  # progress on stderr: a line per tenth of the steps
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # bounded by the test's timeout
            if re.search(r"\) run \d+/50 ", line):  # the first such line comes after a few runs
                break
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr
    assert "INTERRUPTED" in stdout
    document = json.loads(json_path.read_text(encoding="utf-8"))
    assert document["settings"]["interrupted"] is True
    done = document["configs"][0]["summary"]["runs_ok"]
    assert 1 <= done < 100
    assert len(document["runs"]) == done


FAKE_QWEN_TTS = textwrap.dedent(
    '''
    """Stands in for the official package: same entry points, a tone instead of a model."""
    import time

    import numpy as np

    CALLS = []


    class Qwen3TTSModel:
        def __init__(self, path, kwargs):
            self.path, self.kwargs = path, kwargs
            self.model = type("Inner", (), {"tts_model_type": "custom_voice"})()

        @classmethod
        def from_pretrained(cls, path, **kwargs):
            return cls(path, kwargs)

        def get_supported_speakers(self):
            return ["ryan", "vivian"]

        def get_supported_languages(self):
            return ["auto", "english", "german"]

        def generate_custom_voice(self, text, speaker, language, **kwargs):
            assert kwargs["do_sample"] is False and kwargs["subtalker_dosample"] is False
            assert speaker in ("ryan", "vivian") and language in ("auto", "english", "german")
            frames = kwargs.get("max_new_tokens", 2048) - 1  # as the official package does when capped
            time.sleep(0.01)  # its synthesis time (the test asserts it is measured)
            return [np.zeros(frames * 1920, dtype=np.float32)], 24000
    '''
)


@pytest.mark.integration
@pytest.mark.torch
def test_reference_worker_speaks_the_protocol_and_is_marked_non_streaming(tmp_path: Path) -> None:
    """The reference worker runs with another interpreter; here ours, with a fake ``qwen_tts``."""
    package = tmp_path / "fake" / "qwen_tts"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_QWEN_TTS, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tmp_path / "fake")
    env["S2S_BENCH_REFERENCE_PYTHON"] = sys.executable
    json_path = tmp_path / "bench.json"
    proc = run_bench(
        "--engine", "tone", "--reference", "--max-frames", "6", "--voice", "Ryan",
        "--texts", "short", "--runs", "2", "--json", str(json_path), "--no-progress", env=env, timeout_s=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    document = json.loads(json_path.read_text(encoding="utf-8"))
    reference = config_named(document, "qwen-tts")
    assert reference["status"] == "ok" and reference["streaming"] is False
    assert reference["info"]["voices"] == ["ryan", "vivian"]
    assert reference["options"]["extra"] == {"max_frames": "6"}
    runs = [r for r in document["runs"] if r["config"] == "qwen-tts"]
    assert len(runs) == 4
    for record in runs:
        assert record["ttfa_s"] == record["synth_s"] >= 0.01
        assert record["frames"] == pytest.approx(6.0)
    assert reference["summary"]["peak_rss_mib"] > 0
    assert "does not stream" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("qwen-tts"))
    assert "*" in row


def test_engine_spec_parsing() -> None:
    spec = parse_engine_spec("torch:dtype=bf16,quantization=int8,cuda_graphs=false", "m", "cpu", 32)
    assert (spec.label, spec.engine) == ("torch:dtype=bf16,quantization=int8,cuda_graphs=false", "torch")
    assert spec.options == {
        "model": "m",
        "device": "cpu",
        "dtype": "bf16",
        "quantization": "int8",
        "extra": {"max_frames": "32", "cuda_graphs": "false"},
    }
    assert parse_engine_spec("torch", "m", None, None).options == {"model": "m", "quantization": "auto", "extra": {}}
    mlx = parse_engine_spec("mlx:quantization=4bit,model=other", "m", None, None)
    assert mlx.options == {"model": "other", "quantization": "4bit", "extra": {}}
    assert parse_engine_spec("reference:dtype=bf16", "m", None, None).is_reference
    named = parse_engine_spec("mlx:label=fast,env.LD_PRELOAD=/x/libblas.so.3", "m", None, None)
    assert named.label == "fast" and named.options["env"] == {"LD_PRELOAD": "/x/libblas.so.3"}
    assert worker_env(named)["LD_PRELOAD"] == "/x/libblas.so.3"
    assert str(ROOT) in worker_env(named)["PYTHONPATH"].split(os.pathsep)
    with pytest.raises(ValueError, match="not key=value"):
        parse_engine_spec("torch:bf16", "m", None, None)
    with pytest.raises(ValueError, match="no engine name"):
        parse_engine_spec(":dtype=bf16", "m", None, None)


@pytest.mark.integration
def test_bad_options_exit_78() -> None:
    proc = run_bench("--engine", "tone", "--runs", "0")
    assert proc.returncode == 78 and "--runs must be at least 1" in proc.stderr
    proc = run_bench("--engine", "tone", "--texts", "/no/such/file")
    assert proc.returncode == 78 and "--texts" in proc.stderr


@pytest.mark.integration
def test_doc_publishes_the_table_with_its_command_on_the_page(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\nHand-written intro.\n", encoding="utf-8")
    proc = run_bench(
        "--engine", "tone", "--engine", "tone:speed=40", "--runs", "1", "--texts", "short", "--warmup", "0",
        "--no-progress", "--doc-file", str(page),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("machine: ")  # the terminal table as before
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# Performance\n\nHand-written intro.\n\n<!-- bench:bench -->\n## Engines side by side")
    assert f" -m s2s_daemon.bench --plugin {PLUGIN} --model tone-model --engine tone" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| tone")}
    assert set(rows) == {"tone", "tone:speed=40"}
    assert rows["tone"].replace(" ", "").endswith("|1.00|1.00|1.00|")  # xTTFA, xRTF, xRSS of the baseline
    assert "ratio to tone (below 1 is better)" in text


@pytest.mark.integration
def test_doc_with_malformed_markers_exits_78_before_the_first_run(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text("<!-- bench:bench -->\nno end\n", encoding="utf-8")
    proc = run_bench("--engine", "tone", "--runs", "1", "--doc-file", str(page))
    assert proc.returncode == 78, proc.stderr
    assert "section 'bench' is never closed" in proc.stderr and "TTFA" not in proc.stdout
    assert page.read_text(encoding="utf-8") == "<!-- bench:bench -->\nno end\n"


def test_texts_and_statistics(tmp_path: Path) -> None:
    texts = builtin_texts()
    assert {t.size for t in texts} == {"short", "medium", "long"}
    assert len({t.language for t in texts}) >= 4
    assert [t.size for t in load_texts("long,short")] == ["short", "short", "long", "long"]
    path = tmp_path / "t.txt"
    path.write_text("German\tGuten Tag.\nplain line\n", encoding="utf-8")
    assert [(t.language, t.text) for t in load_texts(str(path))] == [("german", "Guten Tag."), ("auto", "plain line")]
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert ratios({"rtf": 0.5, "load_s": 2.0}, {"rtf": 0.25, "load_s": 0.0}) == {
        **dict.fromkeys(("rss_end_mib", "ttfa_p50_ms", "ttfa_p95_ms", "synth_total_s", "frames_per_s"), None),
        "rtf": 2.0,
        "load_s": None,
        "peak_rss_mib": None,
        "device_peak_mib": None,
    }


# --- the real engines on a tiny random checkpoint ---


TINY_CUSTOM_VOICE = ROOT / "tests" / "fixtures" / "qwen3_tiny" / "custom_voice"
"""The committed tiny random checkpoint (``python -m s2s_daemon.tools.make_checkpoint --size tiny``)."""


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.mlx
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torch_and_mlx_engines_through_the_protocol(tmp_path: Path) -> None:
    """The daemon's own engines, greedy, capped at 6 frames (1.5 chunks of 4) per text."""
    json_path, texts = tmp_path / "bench.json", tmp_path / "texts.txt"
    texts.write_text("english\tThe kettle is boiling.\n", encoding="utf-8")
    proc = subprocess.run(
        [
            sys.executable, "-m", "s2s_daemon.bench", "--model", str(TINY_CUSTOM_VOICE),
            "--engine", "torch:device=cpu",
            "--engine", "mlx:quantization=8bit",
            "--max-frames", "6", "--texts", str(texts), "--runs", "2", "--warmup", "0",
            "--json", str(json_path), "--no-progress",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=230, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    document = json.loads(json_path.read_text(encoding="utf-8"))
    torch_config, mlx_config = document["configs"]
    assert torch_config["info"]["engine"] == "torch" and torch_config["info"]["device"] == "cpu"
    assert mlx_config["info"]["engine"] == "mlx" and mlx_config["info"]["dtype"] == "8bit"
    assert mlx_config["summary"]["device_kind"] == "mlx" and mlx_config["summary"]["device_peak_mib"] > 0
    assert "torch" in torch_config["versions"] and "mlx" in mlx_config["versions"]
    assert [r["config"] for r in document["runs"]] == ["torch:device=cpu", "mlx:quantization=8bit"] * 2
    for record in document["runs"]:
        assert record["ok"], record
        assert record["frames"] == pytest.approx(6.0)  # max_frames reached the engine
        # chunk_frames 4: mlx one chunk of 4 frames and one of 2; torch a one-frame first chunk, 4, then 1
        assert record["chunks"] == (3 if record["config"].startswith("torch") else 2)
        assert 0 < record["ttfa_s"] < record["synth_s"]
    assert mlx_config["ratios"]["peak_rss_mib"] is not None


def test_without_engines_the_formats_of_this_machine_are_compared_auto_first() -> None:
    from s2s_daemon.bench.cli import default_engines
    from s2s_daemon.tts.torch_qwen3 import native

    engines = default_engines("cpu")
    assert engines[0] == "torch"
    if native.why_not_here() is None:
        assert engines == ["torch", "torch:quantization=int4", "torch:quantization=none"]
    assert default_engines("cuda")[0] == "torch" and "torch:dtype=fp32" in default_engines("cuda")


class RecordingHost:
    """A ``protocol.Host`` that records its calls; ``run`` fails on a text of "boom"."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("load")
        return {"info": {"engine": request["engine"]}}

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("run")
        if request["text"] == "boom":
            raise RuntimeError("engine failed")
        return {"chunks": 1}

    def close(self) -> dict[str, Any]:
        self.calls.append("close")
        return {}


def test_the_protocol_answers_each_request_in_order_and_closes_at_the_end() -> None:
    from s2s_daemon.bench.protocol import serve

    host = RecordingHost()
    lines = ['{"op": "load", "engine": "tone"}', "", '{"op": "run", "text": "hi"}', '{"op": "run", "text": "boom"}']
    lines.append('{"op": "dance"}')
    replies = io.StringIO()
    assert serve(host, io.StringIO("\n".join(lines) + "\n"), replies) == 0
    answers = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert answers == [
        {"info": {"engine": "tone"}, "ok": True},
        {"chunks": 1, "ok": True},
        {"ok": False, "error": "engine failed", "error_type": "RuntimeError"},
        {"ok": False, "error": "unknown op 'dance'", "error_type": "ValueError"},
    ]
    assert host.calls == ["load", "run", "run", "close"]  # stdin ended: closed as by "close"
    host = RecordingHost()
    assert serve(host, io.StringIO('{"op": "close"}\n{"op": "run", "text": "late"}\n'), io.StringIO()) == 0
    assert host.calls == ["close"]  # answered, then the worker exits


def test_both_workers_serve_the_one_protocol_loop() -> None:
    """``reference_worker.py`` runs with another interpreter and imports nothing of ours: it loads
    ``protocol.py`` by its path, as it would there (no copy of the loop of its own)."""
    import importlib.util

    from s2s_daemon.bench import protocol, worker

    path = ROOT / "s2s_daemon" / "bench" / "reference_worker.py"
    spec = importlib.util.spec_from_file_location("reference_worker_as_a_script", path)
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    assert worker.serve is protocol.serve
    assert reference.serve.__code__.co_filename == protocol.serve.__code__.co_filename
    assert not [name for name in vars(reference) if name.startswith("s2s_daemon")]
