"""Lazy engine registry: a backend's heavy imports happen only when it is chosen."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from s2s_daemon.config import ENGINE_NAMES, TtsConfig
from s2s_daemon.errors import UnavailableError
from s2s_daemon.tts.engine import EngineOptions, OptionsSchema, TtsEngine

EngineFactory = Callable[[EngineOptions], TtsEngine]
OptionsReader = Callable[[TtsConfig], EngineOptions]
"""Reads an engine's own part of the ``tts`` section (its ``tts.<engine>`` block and ``tts.options``)."""


def _torch_options(tts: TtsConfig) -> EngineOptions:
    section = tts.torch
    return EngineOptions(
        model=tts.model,
        device=section.device,
        dtype=section.dtype,
        quantization=section.quantization,
        kernels=section.kernels,
        isa=section.isa,
        threads=section.threads if isinstance(section.threads, int) else None,
        revision=tts.revision,
        extra=dict(tts.options),
    )


def _mlx_options(tts: TtsConfig) -> EngineOptions:
    section = tts.mlx
    return EngineOptions(
        model=tts.model,
        device=section.device,
        quantization=section.quantization,
        revision=tts.revision,
        extra=dict(tts.options),
    )


def _plain_options(tts: TtsConfig) -> EngineOptions:
    """An engine with no section of its own (a registered one): the model and ``tts.options``."""
    return EngineOptions(
        model=tts.model,
        quantization=tts.options.get("quantization", "none"),
        revision=tts.revision,
        extra=dict(tts.options),
    )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Where an engine lives and what must be installed for it."""

    target: str
    """``module:Class`` imported on first use."""
    extra: str
    """The pip extra that provides its dependencies."""
    requires: tuple[str, ...]
    """Top-level modules that must import for the engine to work."""
    options: OptionsReader
    """Its options from the configuration."""
    schema: str
    """``module:Class`` of its ``tts.options`` (an ``OptionsSchema``), imported without the engine's extra."""


_BUILTIN: dict[str, EngineSpec] = {
    "torch": EngineSpec(
        "s2s_daemon.tts.torch_qwen3:TorchQwen3Engine",
        "torch",
        ("torch", "safetensors", "tokenizers"),  # transformers only for tokenizers tokenizer.json misses
        _torch_options,
        "s2s_daemon.tts.torch_qwen3.options:TorchOptions",
    ),
    "mlx": EngineSpec(
        "s2s_daemon.tts.mlx_qwen3:MlxQwen3Engine",
        "mlx",
        ("mlx", "mlx_audio"),
        _mlx_options,
        "s2s_daemon.tts.mlx_qwen3:MlxOptions",
    ),
}
_REGISTERED: dict[str, EngineFactory] = {}
_REGISTERED_SCHEMAS: dict[str, type[OptionsSchema]] = {}


def register_engine(name: str, factory: EngineFactory, schema: type[OptionsSchema] | None = None) -> None:
    """Make an extra engine available in this process (tests, plugins); ``schema``: its
    ``tts.options`` (None: taken as they come)."""
    _REGISTERED[name] = factory
    if schema is not None:
        _REGISTERED_SCHEMAS[name] = schema
    else:
        _REGISTERED_SCHEMAS.pop(name, None)
    if name not in ENGINE_NAMES:
        ENGINE_NAMES.append(name)  # tts.engine may name it


def engine_names() -> tuple[str, ...]:
    return tuple(_BUILTIN) + tuple(n for n in _REGISTERED if n not in _BUILTIN)


def engine_options(tts: TtsConfig) -> EngineOptions:
    """The options of the engine ``tts.engine`` names, read from its own section."""
    spec = _BUILTIN.get(tts.engine)
    return spec.options(tts) if spec is not None and tts.engine not in _REGISTERED else _plain_options(tts)


def options_schema(name: str) -> type[OptionsSchema] | None:
    """The ``tts.options`` schema engine ``name`` declares; None for a registered engine without one."""
    if name in _REGISTERED:
        return _REGISTERED_SCHEMAS.get(name)
    spec = _BUILTIN.get(name)
    if spec is None:
        return None
    module_name, _, attr = spec.schema.partition(":")
    schema: type[OptionsSchema] = getattr(importlib.import_module(module_name), attr)
    return schema


def missing_extra(name: str) -> str | None:
    """What engine ``name`` lacks to run here (its extra's packages, imported as the engine will),
    or None when nothing is missing (or it is a registered engine)."""
    spec = _BUILTIN.get(name)
    if spec is None or name in _REGISTERED:
        return None
    try:
        _check_requirements(name, spec)
    except UnavailableError as exc:
        return str(exc)
    return None


def _check_requirements(name: str, spec: EngineSpec) -> None:
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            msg = (
                f"engine {name!r} needs the {module!r} package, which is not installed: "
                f"pip install 's2s-daemon[{spec.extra}]' ({exc})"
            )
            raise UnavailableError(msg) from exc


def create_engine(name: str, options: EngineOptions) -> TtsEngine:
    """Build (not load) the engine ``name``; a missing extra raises UnavailableError."""
    if name in _REGISTERED:
        return _REGISTERED[name](options)
    spec = _BUILTIN.get(name)
    if spec is None:
        msg = f"unknown engine {name!r}; choose one of {', '.join(engine_names())}"
        raise UnavailableError(msg)
    _check_requirements(name, spec)
    module_name, _, attr = spec.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            msg = f"engine {name!r} is not part of this build of s2s-daemon ({module_name} missing)"
            raise UnavailableError(msg) from exc
        raise
    factory: EngineFactory = getattr(module, attr)
    return factory(options)
