"""The package's layers (docs/development.md, Layout): a module imports only from its own group or a
lower row, and the doors (intake), the speaker (audio) and synthesis (tts) never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import s2s_daemon

ROWS = [
    {"config", "engines", "errors", "logs", "progress", "notify", "holders", "build_lock", "__init__"},
    {"pipeline", "text"},
    {"mqtt"},
    {"tts"},
    {"audio"},
    {"vad"},
    {"intake"},
    {"events"},
    {"wiring", "preflight", "app", "say", "cli", "__main__"},
    {"bench", "tools", "service"},
]
APART = {"intake": {"audio"}, "audio": {"intake"}, "tts": {"intake", "audio"}}
"""Groups a group never imports, whatever their rows: a caller's audio is a ``pipeline/`` type that
the TTS stage writes into and the intake reads (``pipeline/output.py``); the speaker is the playback
stage's alone; the TTS stage knows neither door nor device."""
RANK = {group: row for row, groups in enumerate(ROWS) for group in groups}
PACKAGE = Path(s2s_daemon.__file__).parent


def group_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "s2s_daemon":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_every_group_has_a_row() -> None:
    groups = {p.relative_to(PACKAGE).with_suffix("").parts[0] for p in PACKAGE.rglob("*.py")}
    assert groups <= set(RANK), groups - set(RANK)


def test_no_module_imports_against_the_arrows() -> None:
    against = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = path.relative_to(PACKAGE).with_suffix("").parts[0]
        for module in imports(path):
            theirs = group_of(module)
            if theirs is not None and theirs != mine and RANK[theirs] > RANK[mine]:
                against.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert against == []


def test_intake_audio_and_tts_never_import_each_other() -> None:
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = path.relative_to(PACKAGE).with_suffix("").parts[0]
        for module in imports(path):
            if group_of(module) in APART.get(mine, set()):
                crossing.append(f"{path.relative_to(PACKAGE)} imports {module}")
    rule = "an intake never imports audio, audio never imports an intake, tts never imports either"
    assert not crossing, f"{rule}; these do:\n" + "\n".join(crossing)
