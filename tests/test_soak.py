"""``scripts/soak.py``: a short soak on the tone engine holds steady, and its verdict catches leaks."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "soak.py"
N, EVERY = 300, 50


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_soak_of_300_utterances_answers_each_once_and_leaks_nothing() -> None:
    command = [sys.executable, str(SCRIPT), "--engine", "tone", "-n", str(N), "--every", str(EVERY), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=80, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["failure"] is None
    assert report["machine"]["cpu"] and report["machine"]["cores"] >= 1 and report["machine"]["date"]
    assert report["setup"]["engine"] == "tone" and report["setup"]["warmup_utterances"] == EVERY

    # Every request answered by exactly one tts/finished, every one completed: no tolerance.
    assert report["answers"] == {
        "sent": N,
        "answered_once": N,
        "missing": 0,
        "duplicates": 0,
        "unexpected": 0,
        "statuses": {"completed": N},
    }

    samples = report["samples"]
    assert [s["done"] for s in samples] == list(range(0, N + 1, EVERY))
    after = [s for s in samples if s["done"] >= EVERY]  # warm-up: 10% of 300, at least one interval
    assert len(after) == N // EVERY
    # Strict where there is no noise: the same descriptors at every sample after warm-up (the
    # script keeps the lowest of three reads, so a file open for a moment is not counted).
    assert len({s["fds"] for s in after}) == 1, [s["fds"] for s in after]
    # Threads: the same at every sample after warm-up (the journal commits on a thread of its own).
    threads = [s["threads"] for s in after]
    assert len(set(threads)) == 1, threads
    # Tolerant where noise is real: RSS after warm-up, a few MiB of allocator movement at most.
    assert after[-1]["rss_mib"] - after[0]["rss_mib"] < 8, [s["rss_mib"] for s in after]
    assert all(s["rss_mib"] >= s["anon_mib"] > 0 for s in samples)
    # The journal: every request stored and answered, nothing left to send, its file bounded.
    journal = report["checks"]["journal_rows"]["value"]
    assert journal == {"requests": N, "unanswered": 0, "outgoing": 0}  # < PRUNE_EVERY: none pruned yet
    assert 0 < samples[-1]["journal_kib"] <= 8192
    assert report["checks"]["exit_code"]["value"] == 0
    assert report["checks"]["log_errors"]["value"] == 0


CLEAN: dict[str, Any] = {
    "samples": [
        {"done": d, "rss_mib": 60.0 + d / 1000, "anon_mib": 40.0, "fds": 9, "threads": 4, "journal_kib": 100.0}
        for d in range(0, N + 1, EVERY)
    ],
    "answers": {"sent": N, "answered_once": N, "missing": 0, "duplicates": 0, "unexpected": 0},
    "rows": {"requests": N, "unanswered": 0, "outgoing": 0},
}
LIMITS = {"rss_mib_per_1000": 20.0, "rss_floor_mib": 16.0, "fd_slack": 0, "thread_slack": 0, "max_journal_kib": 8192}


def run_verdict(soak: ModuleType, case: dict[str, Any], **kw: Any) -> dict[str, dict[str, Any]]:
    answers = {**case["answers"], "statuses": case["answers"].get("statuses", {"completed": N})}
    args = {"rows": case["rows"], "dedup_window": 256, "errors": 0, "exit_code": 0, **kw}
    checks: dict[str, dict[str, Any]] = soak.verdict(case["samples"], answers, LIMITS, N, EVERY, **args)
    return checks


def failing(checks: dict[str, dict[str, Any]]) -> set[str]:
    return {name for name, c in checks.items() if not c["ok"]}


def test_the_verdict_fails_each_kind_of_leak_and_lost_answer() -> None:
    soak = load_soak()
    assert failing(run_verdict(soak, CLEAN)) == set()

    def with_samples(change: Any) -> dict[str, Any]:
        case = copy.deepcopy(CLEAN)
        for s in case["samples"]:
            change(s)
        return case

    def fd_leak(s: dict[str, Any]) -> None:
        s["fds"] += s["done"] // 100  # one file per 100 utterances

    def thread_leak(s: dict[str, Any]) -> None:
        s["threads"] += s["done"] // 100

    def rss_leak(s: dict[str, Any]) -> None:
        s["rss_mib"] += s["done"] * 0.1  # 100 KiB per utterance: 25 MiB over the 250 after warm-up

    def warmup_only(s: dict[str, Any]) -> None:
        if s["done"] == 0:  # what happens before the baseline is warm-up: not held against it
            s.update(rss_mib=10.0, fds=5, threads=2)

    assert failing(run_verdict(soak, with_samples(fd_leak))) == {"fds_range"}
    assert failing(run_verdict(soak, with_samples(thread_leak))) == {"threads_range"}
    assert failing(run_verdict(soak, with_samples(rss_leak))) == {"rss_growth_mib"}
    assert failing(run_verdict(soak, with_samples(warmup_only))) == set()

    for wrong in (
        {"answered_once": N - 1, "missing": 1},
        {"answered_once": N - 1, "duplicates": 1},
        {"unexpected": 1},
        {"statuses": {"completed": N - 1, "cancelled": 1}},
    ):
        case = copy.deepcopy(CLEAN)
        case["answers"].update(wrong)
        assert failing(run_verdict(soak, case)) == {"answers"}, wrong

    assert failing(run_verdict(soak, CLEAN, rows={"requests": 2000, "unanswered": 0, "outgoing": 0})) == {
        "journal_rows"
    }
    assert failing(run_verdict(soak, CLEAN, rows={"requests": N, "unanswered": 1, "outgoing": 0})) == {"journal_rows"}
    assert failing(run_verdict(soak, CLEAN, rows=None)) == {"journal_rows"}
    assert failing(run_verdict(soak, CLEAN, exit_code=1)) == {"exit_code"}
    assert failing(run_verdict(soak, CLEAN, errors=2)) == {"log_errors"}
    big = with_samples(lambda s: s.update(journal_kib=9000.0))
    assert failing(run_verdict(soak, big)) == {"journal_max_kib"}
    too_short = copy.deepcopy(CLEAN)
    too_short["samples"] = too_short["samples"][:2]
    assert "samples_after_warmup" in failing(run_verdict(soak, too_short))
