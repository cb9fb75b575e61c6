"""Builds the engine ``tts.engine`` names from the spec it declares (``engines.py``): its extra
checked first, its heavy imports only then, its options read from its own block."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from s2s_daemon.config import TtsConfig
from s2s_daemon.engines import (
    EngineEntryError,
    EngineSection,
    EngineSpec,
    engine_names,
    engine_spec,
    register_in_process,
)
from s2s_daemon.errors import UnavailableError
from s2s_daemon.tts.engine import EngineOptions, OptionsSchema, TtsEngine

__all__ = ["create_engine", "engine_names", "engine_options", "missing_extra", "options_schema", "register_engine"]

EngineFactory = Callable[[EngineOptions], TtsEngine]


def register_engine(
    name: str,
    factory: EngineFactory,
    schema: type[OptionsSchema] | None = None,
    section: type[EngineSection] | None = None,
) -> None:
    """For tests only: make ``factory`` engine ``name`` in this process, never in the installed
    metadata (``engines.register_in_process``); ``schema``: its ``tts.options`` (None: taken as they
    come); ``section``: its ``tts.<name>`` block."""
    register_in_process(name, EngineSpec(engine=factory, section=section, options=schema))


def _spec(name: str) -> EngineSpec:
    try:
        spec = engine_spec(name)
    except EngineEntryError as exc:
        raise UnavailableError(str(exc)) from exc
    if spec is None:
        msg = f"unknown engine {name!r}; choose one of {', '.join(engine_names())}"
        raise UnavailableError(msg)
    return spec


def engine_options(tts: TtsConfig) -> EngineOptions:
    """The options of the engine ``tts.engine`` names: the model, ``tts.options`` and its own block."""
    spec = _spec(tts.engine)
    options = EngineOptions(
        model=tts.model,
        quantization=tts.options.get("quantization", "none"),
        revision=tts.revision,
        extra=dict(tts.options),
    )
    if spec.section is None:
        return options
    section = tts.section(tts.engine, spec.section)
    return dataclasses.replace(options, section=section, **section.engine_fields())


def options_schema(name: str) -> type[OptionsSchema] | None:
    """The ``tts.options`` schema engine ``name`` declares; None for one without."""
    schema = _spec(name).options
    if schema is None:
        return None
    if not issubclass(schema, OptionsSchema):
        msg = f"engine {name!r} declares options {schema.__name__}, which is not an OptionsSchema"
        raise TypeError(msg)
    return schema


def missing_extra(name: str) -> str | None:
    """What engine ``name`` lacks to run here (its extra's packages, imported as the engine will),
    or None when nothing is missing."""
    try:
        _check_requirements(name, _spec(name))
    except UnavailableError as exc:
        return str(exc)
    return None


def _check_requirements(name: str, spec: EngineSpec) -> None:
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = f": pip install '{spec.install}'" if spec.install else ""
            msg = f"engine {name!r} needs the {module!r} package, which is not installed{hint} ({exc})"
            raise UnavailableError(msg) from exc


def create_engine(name: str, options: EngineOptions) -> TtsEngine:
    """Build (not load) the engine ``name``; a missing extra raises UnavailableError before any
    of the engine's own modules is imported."""
    spec = _spec(name)
    _check_requirements(name, spec)
    factory = spec.engine
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                msg = f"engine {name!r} is not part of this installation ({module_name} missing)"
                raise UnavailableError(msg) from exc
            raise
        factory = getattr(module, attr)
    engine = factory(options)
    if not isinstance(engine, TtsEngine):
        msg = f"engine {name!r} made a {type(engine).__name__}, which lacks TtsEngine's methods"
        raise TypeError(msg)
    return engine
