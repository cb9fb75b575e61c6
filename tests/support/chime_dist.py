"""The chime engine (``chime_engine.py``) installed as a distribution of its own into a site folder,
as an installer lays out a wheel (``<module>.py`` beside ``<name>-<version>.dist-info/`` with its
``METADATA``, ``entry_points.txt``, ``INSTALLER`` and ``RECORD``): put the folder on ``sys.path``
(or ``PYTHONPATH``) and ``importlib.metadata`` finds its entry points as it finds any other's."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).with_name("chime_engine.py")
DISTRIBUTION = "s2s-chime-engine"
MODULE = "s2s_chime_engine"


def install(site: Path, entry_points: dict[str, str] | None = None, distribution: str = DISTRIBUTION) -> Path:
    """Lay the distribution out in ``site`` (made if missing); ``entry_points``: its
    ``s2s_daemon.engines`` group (default: ``chime = s2s_chime_engine:ENGINE``). Returns ``site``."""
    site.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SOURCE, site / f"{MODULE}.py")
    points = entry_points if entry_points is not None else {"chime": f"{MODULE}:ENGINE"}
    info = site / f"{distribution.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1.0\nRequires-Dist: s2s-daemon\n",
        "entry_points.txt": "[s2s_daemon.engines]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()),
        "INSTALLER": "tests\n",
    }
    for name, text in files.items():
        (info / name).write_text(text, encoding="utf-8")
    record = [f"{MODULE}.py,,", *(f"{info.name}/{name},," for name in (*files, "RECORD"))]
    (info / "RECORD").write_text("\n".join(record) + "\n", encoding="utf-8")
    return site


@contextlib.contextmanager
def on_path(site: Path) -> Iterator[Path]:
    """``site`` first on ``sys.path`` while inside (the engine registry reads entry points per path)."""
    sys.path.insert(0, str(site))
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(MODULE, None)
