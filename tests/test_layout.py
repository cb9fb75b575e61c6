"""The package's layers (docs/development.md, Layout): a module imports only from its own group or a
lower row, and the doors (intake), the speaker (audio) and synthesis (tts) never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


@pytest.mark.slow
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


SAME_NAME_ELSEWHERE = {
    "CpuTimes": "the engine's CPU watch (tts/threads.py) and the benchmark's machine line (bench/machine.py)",
    "Progress": "a start's long steps (progress.py) and the benchmark's bar (bench/runner.py)",
    "RMSNorm": "the codec's and the talker's layers, inside the torch engine",
    "Samples": "the torch engine's overlap module's array alias, inside the engine",
}
"""Names two modules still define, apart from the daemon's own vocabulary (left as they are)."""


def _public_names(path: Path) -> set[str]:
    """The classes and type aliases ``path`` defines at module level (CapWords names)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(t.id for t in targets if isinstance(t, ast.Name) and t.id[:1].isupper() and not t.id.isupper())
    return {name for name in found if not name.startswith("_")}


def test_one_name_one_meaning() -> None:
    """A class or alias name is defined in one module: ``FirstSample`` the ledger's event (not also
    a sink's callback), ``Phase`` a request's (the daemon's is ``LifecyclePhase``)."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _public_names(path):
            where.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1 and name not in SAME_NAME_ELSEWHERE}
    assert twice == {}
    assert set(SAME_NAME_ELSEWHERE) <= {name for name, paths in where.items() if len(paths) > 1}  # none is stale


def test_the_stages_are_handed_their_jobs() -> None:
    """A say's walk hands each stage its job (``SpeakerTurn``): neither the TTS stage nor the
    speaker's side (``audio/``) looks a job up again by its id in the ledger's ``jobs``."""
    looked_up = []
    for path in sorted([*(PACKAGE / "audio").rglob("*.py"), *(PACKAGE / "tts").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            jobs = node.value if isinstance(node, ast.Subscript) else None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                jobs = node.func.value
            if isinstance(jobs, ast.Attribute) and jobs.attr == "jobs":
                looked_up.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert looked_up == []


def test_the_lifecycle_sets_nothing_on_what_it_was_handed() -> None:
    """``app.py`` runs what the wiring built whole: it assigns no attribute of another object
    (``journal.on_commit = ...``, ``self.readiness.broker_connected = ...``), only its own."""
    patched = []
    for node in ast.walk(ast.parse((PACKAGE / "app.py").read_text(encoding="utf-8"))):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            owner = target.value if isinstance(target, ast.Attribute) else None
            if owner is not None and not (isinstance(owner, ast.Name) and owner.id == "self"):
                patched.append(f"app.py:{node.lineno} {ast.unparse(target)}")
    assert patched == []
