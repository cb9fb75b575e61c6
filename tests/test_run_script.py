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
    (tree / "configs").mkdir()
    shutil.copy(REPO / "scripts" / "run", tree / "scripts" / "run")
    shutil.copy(REPO / "configs" / "default.yaml", tree / "configs" / "default.yaml")
    tools = tmp_path / "bin"
    tools.mkdir()
    fake_tool(tools, "ldconfig", ldconfig)
    fake_tool(tools, "apt-get", "exit 0")
    fake_tool(tools, "c++", "exit 0")
    return subprocess.run(
        ["bash", str(tree / "scripts" / "run")],
        cwd=tree,
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


FAKE_PYTHON = r"""#!/bin/sh
# Stands in for .venv/bin/python: logs what it is asked, answers as an installed package would.
echo "python $*" >>"$RUN_LOG"
case "$*" in
  "-VV") echo "Python 3.11.7 (fake)";;
  "-m s2s_daemon check-config"*) exit "${CHECK_CONFIG_EXIT:-0}";;
  "-c import sys, torch"*) exit 1;;
esac
exit 0
"""


def fake_tree(tmp_path: Path) -> Path:
    """A checkout with ``scripts/run``, ``pyproject.toml``, ``configs/default.yaml`` and a ready
    ``.venv`` whose python and s2s-daemon only log what they are asked."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "configs").mkdir()
    shutil.copy(REPO / "scripts" / "run", tree / "scripts" / "run")
    shutil.copy(REPO / "pyproject.toml", tree / "pyproject.toml")
    shutil.copy(REPO / "configs" / "default.yaml", tree / "configs" / "default.yaml")
    bin_dir = tree / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake_tool(bin_dir, "python", FAKE_PYTHON.removeprefix("#!/bin/sh\n"))
    fake_tool(bin_dir, "s2s-daemon", 'echo "s2s-daemon $*" >>"$RUN_LOG"')
    return tree


def run_fake(tree: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = tree / "run.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        ["bash", str(tree / "scripts" / "run"), *args],
        cwd=tree,
        env={**os.environ, "RUN_LOG": str(log), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, log.read_text().splitlines() if log.exists() else []


def pip_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("python -m pip")]


def test_run_installs_once_then_only_when_what_it_installs_changed(tmp_path: Path) -> None:
    """Before: ~14 s of pip on every start (issue 41, Friction)."""
    tree = fake_tree(tmp_path)
    first, calls = run_fake(tree)
    assert first.returncode == 0, first.stderr
    installs = pip_calls(calls)
    assert installs and any("speed" in c and "-e" in c for c in installs), installs  # the README's speed extra
    assert calls[-1] == "s2s-daemon run -c configs/default.yaml"
    again, calls = run_fake(tree)
    assert again.returncode == 0 and pip_calls(calls) == [], calls  # nothing changed: no pip
    assert calls[-1] == "s2s-daemon run -c configs/default.yaml"
    with (tree / "pyproject.toml").open("a") as fh:
        fh.write("\n# a dependency changed\n")
    _, calls = run_fake(tree)
    assert pip_calls(calls), calls


def test_run_checks_the_configuration_before_it_installs(tmp_path: Path) -> None:
    tree = fake_tree(tmp_path)
    missing, calls = run_fake(tree, "configs/nowhere.yaml")
    assert missing.returncode == 78 and "no configuration file configs/nowhere.yaml" in missing.stderr
    assert calls == []  # said before the virtual environment, let alone pip
    (tree / "pyproject.toml").write_text((tree / "pyproject.toml").read_text() + "\n# changed\n")
    wrong, calls = run_fake(tree, CHECK_CONFIG_EXIT="78")
    assert wrong.returncode == 78 and pip_calls(calls) == [], calls
    held, calls = run_fake(tree, CHECK_CONFIG_EXIT="69")  # a missing extra: what pip installs next
    assert held.returncode == 0 and pip_calls(calls), calls
