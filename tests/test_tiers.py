"""The test tiers (docs/development.md, "Test tiers"): a test without a process mark cannot start a
process (tests/conftest.py refuses it, naming the mark), and ``scripts/test --fast`` deselects
exactly the tier marks pyproject.toml registers."""

from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import subprocess
import tomllib

import pytest

from tests.conftest import PROCESS_MARKS
from tests.support.daemon import REPO

TIER_MARKS = ("slow", *PROCESS_MARKS)


def test_an_unmarked_test_cannot_start_a_process() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"test_tiers\.py::\S+ starts a process .* not marked integration"):
        subprocess.run(["true"], check=False)
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        os.system("true")


async def test_nor_through_asyncio() -> None:
    import asyncio

    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        await asyncio.create_subprocess_exec("true")


@pytest.mark.integration
def test_a_marked_one_can() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0


def test_the_probes_libraries_make_are_let_through() -> None:
    """torch's extension loader asks ninja for its version; ctypes asks ldconfig for a library."""
    if shutil.which("ninja") is not None:
        assert subprocess.run(["ninja", "--version"], capture_output=True, check=False).returncode == 0
    assert ctypes.util.find_library("c")


def test_fast_deselects_the_tier_marks_that_are_registered() -> None:
    script = (REPO / "scripts" / "test").read_text(encoding="utf-8")
    found = re.search(r'^FAST_TIER="([^"]+)"$', script, re.MULTILINE)
    assert found is not None, "scripts/test names its selection in FAST_TIER"
    assert found.group(1) == " and ".join(f"not {mark}" for mark in TIER_MARKS)
    markers = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    registered = {line.partition(":")[0] for line in markers["markers"]}
    assert set(TIER_MARKS) <= registered
    assert "--strict-markers" in markers["addopts"]
