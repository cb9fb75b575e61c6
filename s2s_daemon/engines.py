"""What ``tts.engine`` may name: the engines this installation declares, found without importing one.

An engine registers through the entry point group ``s2s_daemon.engines`` (``[project.entry-points]``
in its distribution's ``pyproject.toml``; the torch and mlx engines are declared in ours as another
distribution would declare its own). The entry point names an ``EngineSpec`` kept in a module that
imports nothing of the engine's extra: the engine class (imported only when it is chosen,
``tts/registry.py``), what it needs installed, its own ``tts.<name>`` block (an ``EngineSection``)
and its ``tts.options`` (an ``OptionsSchema``). ``config.py`` checks ``tts.engine`` and each
engine's block against what is found here. docs/extending.md ("Writing an engine") walks through writing one.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import BaseModel, ConfigDict

GROUP = "s2s_daemon.engines"
"""The entry point group engines register in."""
DISTRIBUTION = "s2s-daemon"
"""Ours: it declares the torch and mlx engines."""


class EngineSection(BaseModel):
    """The base of an engine's own block of the configuration, ``tts.<name>`` (``tts.torch``):
    every key typed, an unknown one refused. ``check-config`` validates it with the rest of the file
    (errors name the key and the file or ``S2S_TTS__<NAME>__<KEY>`` variable that set it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def engine_fields(self) -> Mapping[str, Any]:
        """The fields of ``EngineOptions`` this block sets, by name (``device``, ``quantization``...);
        none by default: an engine reads its block from ``EngineOptions.section``."""
        return {}


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What an engine declares: the object its entry point names. Nothing in it imports the
    engine's heavy packages; they are imported when the engine is chosen, after ``requires``
    was checked (a missing one is an error naming ``install``, before any download)."""

    engine: str | Callable[[Any], object]
    """``module:Class`` of the engine (called with ``EngineOptions``), imported when chosen; a
    callable for an engine registered in-process (``register_in_process``)."""
    install: str | None = None
    """What to ``pip install`` for ``requires``: ``s2s-daemon[torch]``."""
    requires: tuple[str, ...] = ()
    """Top-level modules that must import for the engine to work."""
    section: type[EngineSection] | None = None
    """Its ``tts.<name>`` block; None: it has none."""
    options: type[BaseModel] | None = None
    """Its ``tts.options`` (an ``OptionsSchema``); None: taken as they come."""


class EngineEntryError(ValueError):
    """An engine's entry point does not give an ``EngineSpec`` (it fails to import, names something
    else, or two distributions declare the same name)."""


_IN_PROCESS: dict[str, EngineSpec] = {}


def register_in_process(name: str, spec: EngineSpec) -> None:
    """For tests only: an engine this process alone knows (the tests' tone engine), never one of
    the installed metadata, so that no configuration names it in a daemon users run."""
    _IN_PROCESS[name] = spec


@functools.lru_cache(maxsize=4)
def _declared(path: tuple[str, ...]) -> dict[str, tuple[EntryPoint, ...]]:
    """The group's entry points by name for this ``sys.path`` (a site folder added later is read)."""
    found: dict[str, tuple[EntryPoint, ...]] = {}
    for point in entry_points(group=GROUP):
        found[point.name] = (*found.get(point.name, ()), point)
    return found


def _entry_points() -> dict[str, tuple[EntryPoint, ...]]:
    return _declared(tuple(sys.path))


def engine_names() -> tuple[str, ...]:
    """Every engine ``tts.engine`` may name here, sorted; no engine is imported."""
    return tuple(sorted({*_entry_points(), *_IN_PROCESS}))


def engine_spec(name: str) -> EngineSpec | None:
    """The spec of engine ``name`` (its entry point loaded: a light import); None when no engine
    has that name. ``EngineEntryError`` when its entry point is broken."""
    if name in _IN_PROCESS:
        return _IN_PROCESS[name]
    points = _entry_points().get(name, ())
    if not points:
        return None
    if len({point.value for point in points}) > 1:
        sources = ", ".join(f"{_source(point)} ({point.value})" for point in points)
        raise EngineEntryError(f"engine {name!r} is declared by more than one distribution: {sources}")
    point = points[0]
    try:
        spec = point.load()
    except Exception as exc:  # a third party's module: any import-time error is its own
        raise EngineEntryError(f"engine {name!r} ({_source(point)}: {point.value}) cannot be loaded: {exc!r}") from exc
    if not isinstance(spec, EngineSpec):
        msg = f"engine {name!r} ({_source(point)}: {point.value}) names a {type(spec).__name__}, not an EngineSpec"
        raise EngineEntryError(msg)
    return spec


def _source(point: EntryPoint) -> str:
    return f"distribution {point.dist.name!r}" if point.dist is not None else "an entry point"


def _ours(point: EntryPoint) -> bool:
    return point.dist is not None and point.dist.name.lower().replace("_", "-") == DISTRIBUTION


def sections() -> dict[str, type[EngineSection]]:
    """Each engine's ``tts.<name>`` block by engine name, for those that declare one; an engine whose
    entry point is broken is left out (it is an error where a configuration names it)."""
    found: dict[str, type[EngineSection]] = {}
    for name in engine_names():
        try:
            spec = engine_spec(name)
        except EngineEntryError:
            continue
        if spec is not None and spec.section is not None:
            found[name] = spec.section
    return found


def check_engine_name(name: str) -> None:
    """``ValueError`` (the message ``tts.engine`` gets) unless ``name`` is a working engine here."""
    names = engine_names()
    if name not in names:
        known = ", ".join(names) if names else "none"
        msg = f"{name!r} is not a registered engine (registered: {known})"
        if not any(_ours(point) for points in _entry_points().values() for point in points):
            msg += f"; this installation's metadata declares none of {DISTRIBUTION}'s: reinstall it (pip install .)"
        raise ValueError(msg)
    engine_spec(name)  # a broken entry point says why
