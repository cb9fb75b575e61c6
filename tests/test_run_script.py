"""``scripts/run``'s checks before it installs: what it says about the machine is true."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.daemon import REPO

pytestmark = pytest.mark.integration


def fake_tool(folder: Path, name: str, body: str) -> None:
    tool = folder / name
    tool.write_text("#!/bin/sh\n" + body + "\n")
    tool.chmod(0o755)


def run_script(tmp_path: Path, ldconfig: str) -> subprocess.CompletedProcess[str]:
    """A copy of ``scripts/run`` with ``ldconfig`` (a shell body) in front of the real tools, up to
    where it makes the virtual environment (``PYTHON=false`` stops it there)."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run", tree / "scripts" / "run")
    tools = tmp_path / "bin"
    tools.mkdir()
    fake_tool(tools, "ldconfig", ldconfig)
    fake_tool(tools, "apt-get", "exit 0")
    fake_tool(tools, "c++", "exit 0")
    return subprocess.run(
        ["bash", str(tree / "scripts" / "run")],
        env={**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "PYTHON": "false"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_run_does_not_call_portaudio_missing_when_ldconfig_lists_it(tmp_path: Path) -> None:
    """``ldconfig -p | grep -q`` under ``pipefail``: grep leaves at the first match, ldconfig dies of
    SIGPIPE writing the rest, and the pipeline failed (about one run in 200 with a real ldconfig,
    whose cache is short; always here, where the list goes on long after the match)."""
    # libportaudio first, then far more than a pipe holds: the writer outlives grep -q.
    proc = run_script(
        tmp_path,
        'echo "\tlibportaudio.so.2 (libc6,x86-64) => /usr/lib/libportaudio.so.2"\n'
        'yes "\tlibother.so.1 (libc6,x86-64) => /usr/lib/libother.so.1" | head -n 200000',
    )
    assert proc.returncode != 0  # it stopped at the virtual environment, as meant
    assert "PortAudio is missing" not in proc.stderr, proc.stderr


def test_run_says_portaudio_is_missing_when_it_is(tmp_path: Path) -> None:
    proc = run_script(tmp_path, 'echo "\tlibc.so.6 (libc6,x86-64) => /lib/libc.so.6"')
    assert "PortAudio is missing" in proc.stderr
